"""The appliance as a real process on loopback, driven by the official `openai` package."""

from __future__ import annotations

import json
import sqlite3

import openai
import pytest
from openai import OpenAI

from tests.conftest import ApplianceProcess

pytestmark = pytest.mark.model

MODEL = "gemma-3-270m"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def sdk(appliance_process: ApplianceProcess) -> OpenAI:
    return OpenAI(
        base_url=f"{appliance_process.base_url}/v1", api_key=appliance_process.key, max_retries=0
    )


def test_models(sdk: OpenAI) -> None:
    assert [m.id for m in sdk.models.list()] == [MODEL, EMBEDDING_MODEL]


def test_embeddings(sdk: OpenAI) -> None:
    reply = sdk.embeddings.create(model=EMBEDDING_MODEL, input=["Hello, world!", "Hi there!"])
    assert [item.index for item in reply.data] == [0, 1]
    assert all(len(item.embedding) == 384 for item in reply.data)
    assert reply.usage.prompt_tokens > 0


def test_chat(sdk: OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in {"stop", "length"}
    assert reply.usage is not None
    assert 0 < reply.usage.completion_tokens <= 12


def test_chat_streaming_matches_non_streaming(sdk: OpenAI) -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    whole = sdk.chat.completions.create(**request)  # type: ignore[call-overload]
    stream = sdk.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: the same text either way
    assert usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions(sdk: OpenAI) -> None:
    reply = sdk.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert reply.object == "text_completion"
    assert reply.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in sdk.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == reply.choices[0].text


def test_json_schema_output_is_parsed_and_valid(sdk: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer"},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    }
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    content = reply.choices[0].message.content
    assert content is not None
    value = json.loads(content)
    assert set(value) == {"city", "country", "population"}
    assert isinstance(value["population"], int)


def test_sdk_raises_its_usual_errors(sdk: OpenAI, appliance_process: ApplianceProcess) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5
        )
    assert bad.value.code == "invalid_parameter"
    assert bad.value.param == "temperature"
    wrong = OpenAI(base_url=f"{appliance_process.base_url}/v1", api_key="kvl_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_usage_was_recorded_for_every_generation(
    sdk: OpenAI, appliance_process: ApplianceProcess
) -> None:
    sdk.completions.create(model=MODEL, prompt="One", max_tokens=2)
    db = sqlite3.connect(appliance_process.data_dir / "appliance.db")
    rows = db.execute("SELECT route, tokens_in, tokens_out, status FROM usage_events").fetchall()
    db.close()
    assert rows
    assert all(tokens_in > 0 for _, tokens_in, _, _ in rows)
    assert {route for route, *_ in rows} >= {"/v1/completions"}
