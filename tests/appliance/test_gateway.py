"""The gateway in-process: a real aiohttp server on loopback, real SQLite, the scripted model
(the real one where the model is what is tested)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest
from aiohttp import web
from pydantic import BaseModel
from pytest_aiohttp import AiohttpClient

from appliance.app import create_app
from appliance.gateway.appkeys import EMBEDDINGS, REGISTRY, STORE
from appliance.gateway.openapi import Route, build_openapi
from appliance.gateway.routes import ROUTES
from appliance.settings import ApplianceSettings
from appliance.state.store import Store
from shared.errors import ErrorCode
from tests.conftest import SLOW, Client
from tests.gateway import MODEL, assert_error, auth, post

GEMMA = "gemma-3-270m"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"


@pytest.mark.model
async def test_health_ready_and_models(client: Client, api_key: str) -> None:
    health = await client.get("/healthz")
    assert health.status == 200
    assert (await health.json())["status"] == "alive"
    ready = await client.get("/readyz")
    assert ready.status == 200
    models = await client.get("/v1/models", headers=auth(api_key))
    listed = (await models.json())["data"]
    # The embedded chat model is listed too: a first request registers and loads it.
    assert [m["id"] for m in listed] == [GEMMA, "smollm2-135m-instruct", EMBEDDING_MODEL]
    assert listed[1]["state"] == "unloaded"
    data = [listed[0], listed[2]]
    assert data[0]["quantization"] == "Q4_K_M"
    assert data[1]["format"] == "onnx"
    # Where each model runs: this CPU-only build keeps every layer on the CPU, which the
    # worker read from ggml's device list; the embedding model names its ONNX provider.
    devices = (await ready.json())["devices"]
    llm = devices[data[0]["ref"]]
    assert llm["device"] == data[0]["device"] == "cpu"
    assert llm["gpu_offload"] is False
    assert any(d["kind"] == "cpu" and d["memory_total_mib"] > 0 for d in llm["devices"])
    assert devices[data[1]["ref"]]["provider"] == data[1]["provider"] == "CPUExecutionProvider"
    assert data[0]["slots"] == 4


async def test_readyz_is_503_until_the_model_is_loaded(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings
) -> None:
    app = create_app(settings)
    client: Client = await aiohttp_client(app)
    # The model loads in a background task; right after start-up it cannot be ready yet.
    early = await client.get("/readyz")
    if not app[REGISTRY].ready:
        assert early.status == 503
        assert early.headers["Retry-After"]
        assert_error(await early.json(), ErrorCode.model_not_ready)
    await app[REGISTRY].wait_loaded()
    await app[EMBEDDINGS].wait_loaded()
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert len((await ready.json())["models"]) == 2


async def test_chat_completion(client: Client, api_key: str) -> None:
    status, body, headers = await post(
        client,
        "/v1/chat/completions",
        api_key,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in {"stop", "length"}
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert headers["X-Request-Id"]


@pytest.mark.model
async def test_greedy_and_seeded_sampling_repeat_exactly(client: Client, api_key: str) -> None:
    async def text(extra: dict[str, Any]) -> str:
        body = {"model": GEMMA, "prompt": "Once upon a time", "max_tokens": 12, **extra}
        status, out, _ = await post(client, "/v1/completions", api_key, body)
        assert status == 200, out
        return str(out["choices"][0]["text"])

    assert await text({"temperature": 0}) == await text({"temperature": 0})
    seeded = {"temperature": 1.0, "seed": 1234}
    assert await text(seeded) == await text(seeded)


@pytest.mark.model
async def test_concurrent_streams_interleave_and_match_their_solo_runs(
    client: Client, api_key: str
) -> None:
    """Continuous batching: 8 streams at once all finish, their tokens interleave, and at
    temperature 0 each gives the text it gives when it runs alone."""
    prompts = [f"Item {i}: the best thing about the number {i} is" for i in range(8)]

    async def run(prompt: str) -> tuple[str, list[float]]:
        response = await client.post(
            "/v1/completions",
            headers=auth(api_key),
            json={
                "model": GEMMA,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "stream": True,
            },
        )
        assert response.status == 200
        pieces, arrivals = [], []
        loop = asyncio.get_running_loop()
        async for raw in response.content:  # as the chunks arrive
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and chunk["choices"][0]["text"]:
                pieces.append(chunk["choices"][0]["text"])
                arrivals.append(loop.time())
        return "".join(pieces), arrivals

    alone = [(await run(p))[0] for p in prompts]
    together = await asyncio.gather(*(run(p) for p in prompts))
    # llama.cpp's CPU kernels are not batch-invariant: a step that decodes 4 rows sums in
    # another order than one that decodes 1, so a greedy run can drift from its solo run
    # after a few tokens. Sequences mixed up in the batch (wrong seq_id, stale KV cells)
    # differ from the first token on, so the first word of each must match its solo run.
    for (text, _), solo in zip(together, alone, strict=True):
        assert text.split()[:1] == solo.split()[:1], (text, solo)
    # Interleaved: some stream received a token before another stream's last one.
    firsts = sorted(arrivals[0] for _, arrivals in together if arrivals)
    lasts = sorted(arrivals[-1] for _, arrivals in together if arrivals)
    assert firsts[-1] < lasts[-1]
    assert sum(1 for f in firsts if f < lasts[0]) >= 2


@pytest.mark.model
async def test_penalties_are_applied(client: Client, api_key: str) -> None:
    body = {"model": GEMMA, "prompt": "la la la la la la", "max_tokens": 8, "temperature": 0}
    status, plain, _ = await post(client, "/v1/completions", api_key, body)
    assert status == 200, plain
    penalised = {**body, "presence_penalty": 2.0, "frequency_penalty": 2.0}
    status, out, _ = await post(client, "/v1/completions", api_key, penalised)
    assert status == 200, out
    assert out["choices"][0]["text"] != plain["choices"][0]["text"]


async def test_stop_and_max_tokens(client: Client, api_key: str) -> None:
    status, body, _ = await post(
        client,
        "/v1/completions",
        api_key,
        {
            "model": MODEL,
            "prompt": "1, 2, 3, 4,",
            "max_tokens": 30,
            "temperature": 0,
            "stop": [","],
        },
    )
    assert status == 200, body
    assert "," not in body["choices"][0]["text"]
    assert body["choices"][0]["finish_reason"] == "stop"
    status, body, _ = await post(
        client,
        "/v1/completions",
        api_key,
        {"model": MODEL, "prompt": "Count: 1 2 3", "max_tokens": 3, "temperature": 0},
    )
    assert body["usage"]["completion_tokens"] <= 3


async def sse_events(response: Any) -> list[Any]:
    events = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_chat_streaming(client: Client, api_key: str) -> None:
    response = await client.post(
        "/v1/chat/completions",
        headers=auth(api_key),
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 10,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        },
    )
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert "usage" in finals[0]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == finals[0]["usage"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert finals[0]["usage"]["completion_tokens"] >= 1
    assert isinstance(text, str)


async def test_usage_event_is_committed_before_the_response(
    client: Client, api_key: str, settings: ApplianceSettings
) -> None:
    status, body, _ = await post(
        client, "/v1/completions", api_key, {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    )
    assert status == 200
    store = Store(settings.db_path)  # a second connection sees it: it was committed
    try:
        events = store.usage_events("tester")
    finally:
        store.close()
    assert [e.id for e in events] == [body["id"].removeprefix("cmpl-")]
    assert events[0].tokens_out == body["usage"]["completion_tokens"]
    assert events[0].tokens_in == body["usage"]["prompt_tokens"]
    assert events[0].status == 200
    assert events[0].ttft_ms is not None


# Every constraint here is one the grammar enforces while decoding.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def json_schema_request(schema: dict[str, Any], max_tokens: int = 60) -> dict[str, Any]:
    return {
        "model": GEMMA,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Give a person as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    }


@pytest.mark.model
async def test_json_schema_output_validates(client: Client, api_key: str) -> None:
    status, body, _ = await post(
        client, "/v1/chat/completions", api_key, json_schema_request(PERSON)
    )
    assert status == 200, body
    person = json.loads(body["choices"][0]["message"]["content"])
    jsonschema.validate(person, PERSON)


@pytest.mark.model
async def test_constraints_the_grammar_cannot_enforce_are_still_checked(
    client: Client, api_key: str
) -> None:
    """The grammar does not express `multipleOf`; the validator still checks it."""
    bounded = {
        **PERSON,
        "properties": {**PERSON["properties"], "age": {"type": "integer", "multipleOf": 7}},
    }
    status, body, _ = await post(
        client, "/v1/chat/completions", api_key, json_schema_request(bounded)
    )
    if status == 200:
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), bounded)
    else:
        assert status == 422, body
        assert_error(body, ErrorCode.output_validation_failed, "response_format")
        assert "age" in body["error"]["message"]


@pytest.mark.model
async def test_json_object_output(client: Client, api_key: str) -> None:
    status, body, _ = await post(
        client,
        "/v1/chat/completions",
        api_key,
        {
            "model": GEMMA,
            "max_tokens": 80,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Describe a cat as JSON."}],
            "response_format": {"type": "json_object"},
        },
    )
    if status == 200:
        assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    else:  # cut by max_tokens before the object closed: refused, never returned as valid
        assert status == 422
        assert_error(body, ErrorCode.output_validation_failed, "response_format")


@pytest.mark.model
async def test_structured_output_cut_short_fails_closed(client: Client, api_key: str) -> None:
    request = json_schema_request(PERSON, max_tokens=3)
    status, body, _ = await post(client, "/v1/chat/completions", api_key, request)
    assert status == 422
    assert_error(body, ErrorCode.output_validation_failed, "response_format")
    assert "max_tokens=3" in body["error"]["message"]
    response = await client.post(
        "/v1/chat/completions", headers=auth(api_key), json={**request, "stream": True}
    )
    events = await sse_events(response)
    assert "[DONE]" not in events  # the stream ends in an error, never in a valid finish
    assert_error(events[-1], ErrorCode.output_validation_failed)
    assert not any(c.get("choices") and c["choices"][0]["finish_reason"] for c in events[:-1])


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (
            {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
            ErrorCode.invalid_value,
            "messages[0].tool_call_id",
        ),
        ({"model": MODEL}, ErrorCode.missing_required_parameter, "messages"),
        ({"model": MODEL, "messages": []}, ErrorCode.invalid_value, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
            ErrorCode.invalid_value,
            "messages[0].role",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            ErrorCode.invalid_value,
            "messages[0].content",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
            ErrorCode.invalid_value,
            "temperature",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
            ErrorCode.invalid_value,
            "max_tokens",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            ErrorCode.invalid_value,
            "max_tokens",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "stop": ["a", "b", "c", "d", "e"],
            },
            ErrorCode.invalid_value,
            "stop",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function"}],
            },
            ErrorCode.missing_required_parameter,
            "tools[0].function",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 9},
            ErrorCode.invalid_value,
            "n",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "functions": [{}]},
            ErrorCode.unsupported_parameter,
            "functions",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
            ErrorCode.unsupported_parameter,
            "messages[0]",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            ErrorCode.invalid_value,
            "top_logprobs",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "logit_bias": {"not-a-token": 1},
            },
            ErrorCode.invalid_value,
            "logit_bias",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "function", "function": {"name": "absent"}},
            },
            ErrorCode.invalid_value,
            "tool_choice",
        ),
        (
            {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            ErrorCode.model_not_found,
            "model",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
            ErrorCode.invalid_value,
            "max_tokens",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2040},
            ErrorCode.context_length_exceeded,
            "messages",
        ),
        (
            {"model": MODEL, "messages": [{"role": "assistant", "content": "x"}]},
            ErrorCode.invalid_value,
            "messages",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "xml"},
            },
            ErrorCode.invalid_value,
            "response_format",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "nonsense"}},
                },
            },
            ErrorCode.invalid_schema,
            "response_format.json_schema.schema",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad name!", "schema": {}},
                },
            },
            ErrorCode.invalid_value,
            "response_format.json_schema.name",
        ),
    ],
)
async def test_bad_chat_requests_get_the_error_shape(
    client: Client, api_key: str, body: dict[str, Any], code: ErrorCode, param: str
) -> None:
    status, out, _ = await post(client, "/v1/chat/completions", api_key, body)
    assert status == code.status, out
    assert_error(out, code, param)


@pytest.mark.parametrize("kind", [[], {}, ["text"], 3.5, None])
async def test_a_content_part_of_any_json_type_is_refused_not_raised(
    client: Client, api_key: str, kind: object
) -> None:
    """A part's `type` is looked up among the text kinds: a list or an object there (the
    fuzzing found a list) is a 400 like any type the models do not read, never a 500."""
    part = {"type": kind, "text": "hi"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
    responses = {"model": MODEL, "input": [{"role": "user", "content": [part], "type": kind}]}
    for route, body in (("/v1/chat/completions", chat), ("/v1/responses", responses)):
        status, out, _ = await post(client, route, api_key, body)
        assert 400 <= status < 500, (route, out)
        assert out["error"]["type"] == "invalid_request_error", out


async def test_invalid_json_and_non_object_bodies(client: Client, api_key: str) -> None:
    lone_surrogate = b'{"model": "gemma-3-270m", "prompt": "\\ud800"}'
    # A surrogate's three UTF-8-like bytes (Python's JSON decoder takes them), and JSON in
    # UTF-16 (which it takes for JSON too): the wire's JSON is UTF-8 (RFC 8259, 8.1).
    raw_surrogate = '{"prompt": "\ud800"}'.encode("utf-8", "surrogatepass")
    utf16 = '{"model": "gemma-3-270m", "prompt": "hi"}'.encode("utf-16")
    bad = [b"{not json", b"\xff\xfe", b"[1, 2]", b"", b"null", lone_surrogate, raw_surrogate]
    for raw in [*bad, utf16]:
        response = await client.post("/v1/completions", headers=auth(api_key), data=raw)
        assert response.status == 400, raw
        assert_error(await response.json(), ErrorCode.invalid_json)


async def test_body_over_the_limit_is_413(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    small = ApplianceSettings.model_validate(
        {**settings.model_dump(), "server": {"max_body_bytes": 2048}}
    )
    client: Client = await aiohttp_client(create_app(small))
    body = {"model": MODEL, "prompt": "x" * 5000}
    response = await client.post("/v1/completions", headers=auth(api_key), json=body)
    assert response.status == 413
    assert_error(await response.json(), ErrorCode.request_too_large)


async def test_authentication(client: Client, api_key: str, settings: ApplianceSettings) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    cases = [
        ({}, ErrorCode.missing_api_key),
        ({"Authorization": "Basic abc"}, ErrorCode.missing_api_key),
        ({"Authorization": "Bearer nope"}, ErrorCode.invalid_api_key),
    ]
    for headers, code in cases:
        response = await client.post("/v1/completions", headers=headers, json=body)
        assert response.status == 401
        assert_error(await response.json(), code)
    store = Store(settings.db_path)
    prefix = store.authenticate(api_key).prefix  # type: ignore[union-attr]
    store.revoke_key(prefix)
    store.close()
    response = await client.post("/v1/completions", headers=auth(api_key), json=body)
    assert response.status == 401
    assert_error(await response.json(), ErrorCode.revoked_api_key)


async def test_every_route_answers_errors_in_the_one_shape(client: Client) -> None:
    """Walk the router: wrong methods, unknown paths and unauthenticated calls."""
    for route in ROUTES:
        wrong = "DELETE"
        path = re.sub(r"\{[^}]+\}", "x", route.path)  # a value where the path takes one
        response = await client.request(wrong, path)
        assert response.status in {401, 405}, route.path
        body = await response.json()
        assert_error(
            body, ErrorCode.missing_api_key if route.auth else ErrorCode.method_not_allowed
        )
        if route.auth:
            response = await client.request(route.method, path)
            assert response.status == 401
            assert_error(await response.json(), ErrorCode.missing_api_key)
    for path in ["/nope", "/v2/models", "/healthz/x"]:
        response = await client.get(path)
        assert response.status == 404
        assert_error(await response.json(), ErrorCode.not_found)


async def test_metrics_count_requests_tokens_and_errors(client: Client, api_key: str) -> None:
    await post(
        client, "/v1/completions", api_key, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    )
    await post(client, "/v1/completions", api_key, {"model": "nope", "prompt": "Hi"})
    response = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert response.headers["Content-Type"].startswith("application/openmetrics-text")
    text = await response.text()
    assert 'kvl_http_requests_total{method="POST",route="/v1/completions",status="200"} 1.0' in text
    assert 'kvl_http_errors_total{code="model_not_found",route="/v1/completions"} 1.0' in text
    assert "kvl_completion_tokens_total" in text
    assert "kvl_time_to_first_token_seconds_bucket" in text
    assert f'kvl_model_ready{{model="{MODEL}@' in text
    assert text.rstrip().endswith("# EOF")


async def test_openapi_document_lists_every_route(client: Client) -> None:
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    for route in ROUTES:
        assert route.method.lower() in doc["paths"][route.path]


async def ok_handler(request: web.Request) -> web.Response:
    return web.json_response({})


def test_openapi_refuses_two_request_models_of_one_name() -> None:
    """Components are keyed by model name: two models of one name would make the document
    describe one body with the other's schema (the Responses API's named tool choice once
    replaced the chat one's, so every schema-valid chat request with one was refused)."""

    class Inner(BaseModel):
        a: int

    class First(BaseModel):
        inner: Inner

    inner_first = Inner

    class Inner(BaseModel):  # type: ignore[no-redef]
        b: str

    class Second(BaseModel):
        inner: Inner

    assert inner_first is not Inner
    routes = [
        Route("POST", "/one", ok_handler, "one", auth=True, body=First),
        Route("POST", "/two", ok_handler, "two", auth=True, body=Second),
    ]
    with pytest.raises(ValueError, match="two request models are named Inner"):
        build_openapi(routes)
    build_openapi(ROUTES)  # the served document has no such pair


async def test_queue_full_is_429_with_retry_after(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    strict = ApplianceSettings.model_validate(
        {
            **settings.model_dump(),
            "model": {**settings.model.model_dump(), "max_queue": 0, "n_slots": 1},
        }
    )
    app = create_app(strict)
    client: Client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    # One long streaming request occupies the model; with max_queue 0 the next is refused.
    long = await client.post(
        "/v1/completions",
        headers=auth(api_key),
        json={
            "model": SLOW,
            "prompt": "Tell a long story.",
            "max_tokens": 200,
            "stream": True,
            "temperature": 0,
        },
    )
    assert long.status == 200
    await long.content.readline()  # the first chunk arrived: it is running
    status, body, headers = await post(
        client, "/v1/completions", api_key, {"model": SLOW, "prompt": "x", "max_tokens": 1}
    )
    assert status == 429
    assert_error(body, ErrorCode.queue_full)
    assert int(headers["Retry-After"]) >= 1
    long.close()
    assert app[STORE] is not None
