"""LangChain's OpenAI chat model against the real appliance process: tool binding, a tool
result sent back, and `with_structured_output` in each of its methods."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from tests.conftest import ApplianceProcess

pytestmark = pytest.mark.model

MODEL = "gemma-3-270m"


@tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """The current weather in a city."""
    return f"18 degrees {unit} and sunny in {city}"


class Rating(BaseModel):
    """A film's rating."""

    title: str = Field(description="The film's title", max_length=60)
    stars: int = Field(description="From 1 to 5", ge=1, le=5)


@pytest.fixture(scope="module")
def llm(appliance_process: ApplianceProcess) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{appliance_process.base_url}/v1",
        api_key=appliance_process.key,
        temperature=0,
        max_retries=0,
        max_tokens=96,  # type: ignore[call-arg]
    )


def test_bound_tools_are_called_with_arguments_that_fit(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="required")
    message = bound.invoke("What is the weather in Paris?")
    assert message.tool_calls
    call = message.tool_calls[0]
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str)
    # The tool's result goes back; the model answers in text (tools allowed, not required).
    result = get_weather.invoke(call["args"])
    answer = llm.bind_tools([get_weather]).invoke(
        [
            HumanMessage("What is the weather in Paris?"),
            message,
            ToolMessage(result, tool_call_id=call["id"]),
        ]
    )
    assert answer.content or answer.tool_calls


def test_streamed_tool_calls_assemble(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    chunks = list(bound.stream("Weather in Oslo?"))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk  # type: ignore[assignment]
    calls = whole.tool_calls
    assert calls
    assert calls[0]["name"] == "get_weather"
    assert "city" in calls[0]["args"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_structured_output_fits_the_model(llm: ChatOpenAI, method: str) -> None:
    structured = llm.with_structured_output(Rating, method=method)  # type: ignore[arg-type]
    rating = structured.invoke("Rate the film Jaws.")
    assert isinstance(rating, Rating)
    assert 1 <= rating.stars <= 5


def test_structured_output_in_json_mode_is_a_json_object(llm: ChatOpenAI) -> None:
    # json_mode asks for any JSON object (OpenAI's json_object): the keys are the model's
    # choice, so LangChain hands back the parsed object as it is.
    schema = Rating.model_json_schema()
    structured = llm.with_structured_output(schema, method="json_mode", include_raw=True)
    out = structured.invoke("Rate the film Jaws as JSON with keys title and stars.")
    assert isinstance(out, dict)
    raw = out["raw"]
    assert isinstance(json.loads(raw.content), dict)
