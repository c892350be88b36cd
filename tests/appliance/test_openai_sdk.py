"""The appliance as a real process on loopback, driven by the official `openai` package."""

from __future__ import annotations

import json
import sqlite3
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion

from tests.benchmarks.api import WEATHER as BENCH_WEATHER
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
    ids = [m.id for m in sdk.models.list()]
    assert ids == [MODEL, "smollm2-135m-instruct", EMBEDDING_MODEL]


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
    assert bad.value.code == "invalid_value"
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


def test_models_retrieve(sdk: OpenAI) -> None:
    model = sdk.models.retrieve(MODEL)
    assert model.id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_several_choices_logprobs_and_extra_samplers(sdk: OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        n=2,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        # llama.cpp's samplers, as Open WebUI and continue.dev send them.
        extra_body={"top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1},
    )
    assert [choice.index for choice in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.logprobs is not None
        assert choice.logprobs.content
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0
            assert len(entry.top_logprobs) == 2
    assert reply.system_fingerprint
    assert reply.usage is not None
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens is not None


def test_a_chat_without_model_is_served_by_the_chat_model(sdk: OpenAI) -> None:
    # The SDK insists on `model`; llama-server's and vLLM's clients (curl) do not.
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    reply = sdk.post("/chat/completions", body=body, cast_to=ChatCompletion)
    assert reply.model.startswith("smollm2-135m-instruct@")


def test_responses_plain_and_streamed(sdk: OpenAI) -> None:
    first = sdk.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Say hello.",
        max_output_tokens=8,
        temperature=0,
    )
    assert first.status in {"completed", "incomplete"}
    assert first.output_text
    assert first.usage is not None
    assert first.usage.output_tokens > 0
    # A follow-up continues the stored conversation, and the stored answer can be read.
    follow = sdk.responses.create(
        model=MODEL, input="Again.", previous_response_id=first.id, max_output_tokens=4
    )
    assert follow.previous_response_id == first.id
    assert follow.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert sdk.responses.retrieve(first.id).id == first.id
    kinds: list[str] = []
    text, final = "", ""
    with sdk.responses.stream(model=MODEL, input="Count to three.", max_output_tokens=8) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            # Cut at max_output_tokens it ends `incomplete`, as OpenAI's does.
            if event.type in {"response.completed", "response.incomplete"}:
                final = event.response.output_text
    assert kinds[0] == "response.created"
    assert kinds[-1] in {"response.completed", "response.incomplete"}
    assert text == final
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)


def test_cors_preflight_of_a_real_process(appliance_process: ApplianceProcess) -> None:
    # The module's process allows no origin: a preflight is refused, nothing leaks.
    request = urllib.request.Request(
        f"{appliance_process.base_url}/v1/chat/completions",
        method="OPTIONS",
        headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    with refused.value:
        assert "Access-Control-Allow-Origin" not in refused.value.headers


# Typed loosely: the SDK's TypedDicts refuse plain dict literals. The benchmark's tool.
WEATHER: Any = BENCH_WEATHER
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def _arguments_fit(call: Any) -> dict[str, Any]:
    import jsonschema  # noqa: PLC0415 - only these tests check arguments

    schemas = {"get_weather": WEATHER, "get_time": TIME}
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name]["function"]["parameters"])
    return dict(arguments)


@pytest.mark.parametrize("model", [MODEL, "smollm2-135m-instruct"])
def test_tool_choice_required_and_named(sdk: OpenAI, model: str) -> None:
    choices: list[Any] = ["required", {"type": "function", "function": {"name": "get_time"}}]
    for choice in choices:
        reply = sdk.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=96,
        )
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        assert message.tool_calls is not None
        assert len(message.tool_calls) == 1
        call: Any = message.tool_calls[0]
        assert call.id.startswith("call_")
        _arguments_fit(call)
        if isinstance(choice, dict):
            assert call.function.name == "get_time"


def test_a_named_function_is_called_once_and_a_call_cut_short_says_by_what(sdk: OpenAI) -> None:
    # Named, without parallel_tool_calls: one call (the grammar allows no second).
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=200,
    )
    calls: list[Any] = list(reply.choices[0].message.tool_calls or [])
    assert [call.function.name for call in calls] == ["get_weather"]
    # Cut by max_tokens mid-call: refused (fails closed), saying so and what to change.
    with pytest.raises(openai.UnprocessableEntityError) as cut:
        sdk.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=4
        )
    error = cut.value.body
    assert isinstance(error, dict)
    assert error["param"] == "tools"
    assert "the tool calls are not valid" in error["message"]
    assert "max_tokens=4" in error["message"]
    assert "response_format" not in error["message"]


def test_parallel_calls_and_auto(sdk: OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather and time in Oslo and in Lima?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=True,
        temperature=0,
        max_tokens=200,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert calls
    assert len({call.id for call in calls}) == len(calls)
    for call in calls:
        _arguments_fit(call)
    # auto: a call or an answer, never anything else.
    for seed in range(3):
        reply = sdk.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            seed=seed,
            max_tokens=96,
        )
        message = reply.choices[0].message
        if message.tool_calls:
            assert reply.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                _arguments_fit(call)
        else:
            assert message.content is not None


def test_streamed_tool_calls_assemble_into_the_same_call(sdk: OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 96,
    }
    whole = sdk.chat.completions.create(**request)
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in sdk.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
    assert "tool_calls" in reasons
    expected = whole.choices[0].message.tool_calls
    assert expected is not None
    assert [c["name"] for c in calls.values()] == [c.function.name for c in expected]
    # Greedy: the same arguments either way (ids are made per answer).
    assert [json.loads(c["arguments"]) for c in calls.values()] == [
        json.loads(c.function.arguments) for c in expected
    ]


def test_a_tool_result_goes_back_to_the_model(sdk: OpenAI) -> None:
    first = sdk.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=96,
    )
    message = first.choices[0].message
    assert message.tool_calls
    call = message.tool_calls[0]
    history: list[Any] = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    reply = sdk.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=32,
    )
    assert reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls


def test_structured_output_that_fails_is_the_sdks_422(sdk: OpenAI) -> None:
    # Cut at 3 tokens, no JSON object is complete: it fails closed, as a 422 the SDK
    # raises as UnprocessableEntityError (OpenAI itself never sends one).
    with pytest.raises(openai.UnprocessableEntityError) as failed:
        sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "A city as JSON."}],
            max_tokens=3,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "city",
                    "schema": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                    },
                },
            },
        )
    assert failed.value.code == "output_validation_failed"


def test_responses_with_tools(sdk: OpenAI) -> None:
    tool: Any = {"type": "function", **WEATHER["function"]}
    response = sdk.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_output_tokens=96,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls
    assert calls[0].name == "get_weather"
    json.loads(calls[0].arguments)
    # The call's output goes back as an input item, after the stored conversation.
    follow = sdk.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"}],
        max_output_tokens=16,
    )
    assert follow.status in {"completed", "incomplete"}
