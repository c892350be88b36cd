"""OpenTelemetry spans of every request stage, received by a real OTLP/HTTP endpoint."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider

from appliance.app import create_app
from appliance.gateway.appkeys import EMBEDDINGS, REGISTRY, TRACING
from appliance.observability.tracing import Tracing
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from tests.conftest import SCRIPTED, make_settings

if TYPE_CHECKING:
    from pathlib import Path

    from opentelemetry.proto.trace.v1.trace_pb2 import Span
    from pytest_aiohttp import AiohttpClient, AiohttpServer


async def test_every_stage_of_a_request_is_a_span_of_one_trace(
    aiohttp_client: AiohttpClient,
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    scripted_model: ModelRecord,
) -> None:
    received: list[Span] = []
    services: set[str] = set()

    async def traces(request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    services.add(attribute.value.string_value)
            for scope in resource_spans.scope_spans:
                received.extend(scope.spans)
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/traces", traces)
    server = await aiohttp_server(collector)

    settings = make_settings(
        tmp_path / "data",
        embeddings={"enabled": False},
        tracing={"otlp_endpoint": str(server.make_url("/v1/traces"))},
    )
    store = Store(settings.db_path)
    try:
        store.add_model(scripted_model)
        key = store.create_key("traced").plaintext
    finally:
        store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()

    response = await client.post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": SCRIPTED,
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 4,
            "stream": True,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
        },
    )
    assert response.status == 200
    chunks = (await response.read()).decode()
    app[TRACING].flush()
    for _ in range(50):
        if any(s.name == "stream" for s in received):
            break
        await asyncio.sleep(0.1)

    by_name = {span.name: span for span in received}
    stages = ["auth", "quota", "router", "admission", "batcher", "worker", "validation", "stream"]
    assert set(stages) <= set(by_name), sorted(by_name)
    root = by_name["POST /v1/chat/completions"]
    assert root.parent_span_id == b""
    assert services == {"kovenlab-appliance"}
    for name in stages:
        span = by_name[name]
        assert span.trace_id == root.trace_id, name
        assert span.parent_span_id == root.span_id, name
        assert span.end_time_unix_nano >= span.start_time_unix_nano, name
    # The worker's own timings place its spans in order: queued, then generating.
    assert by_name["batcher"].end_time_unix_nano <= by_name["worker"].start_time_unix_nano + 1000
    attributes = {a.key: a.value for a in by_name["worker"].attributes}
    assert attributes["kvl.completion_tokens"].int_value > 0
    # The model call in OpenTelemetry's GenAI semantic conventions.
    genai = {
        key: (
            value.string_value
            or value.int_value
            or value.double_value
            or [v.string_value for v in value.array_value.values]
        )
        for key, value in attributes.items()
        if key.startswith("gen_ai.")
    }
    model = genai.pop("gen_ai.response.model")
    assert isinstance(model, str)
    assert model.startswith(f"{SCRIPTED}@")
    response_id = genai.pop("gen_ai.response.id")
    assert f'"id":"{response_id}"' in chunks.replace(" ", "")
    reasons = genai.pop("gen_ai.response.finish_reasons")
    assert isinstance(reasons, list)
    assert len(reasons) == 1
    assert reasons[0] in {"stop", "length"}
    output = genai.pop("gen_ai.usage.output_tokens")
    assert output == attributes["kvl.completion_tokens"].int_value
    assert genai.pop("gen_ai.usage.input_tokens") == attributes["kvl.prompt_tokens"].int_value
    assert genai == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "kovenlab-edge",
        "gen_ai.request.model": SCRIPTED,
        "gen_ai.request.max_tokens": 4,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 7,
    }
    status = {a.key: a.value for a in root.attributes}["http.response.status_code"]
    assert status.int_value == 200


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_clients_traceparent_makes_the_request_part_of_its_trace(
    aiohttp_client: AiohttpClient, aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    received: list[Span] = []

    async def traces(request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            for scope in resource_spans.scope_spans:
                received.extend(scope.spans)
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/traces", traces)
    server = await aiohttp_server(collector)
    # No model needed: the route's own span is what joins the client's trace.
    settings = make_settings(
        tmp_path / "data",
        model={"default": "absent-model"},
        embeddings={"enabled": False},
        tracing={"otlp_endpoint": str(server.make_url("/v1/traces"))},
    )
    store = Store(settings.db_path)
    try:
        key = store.create_key("traced").plaintext
    finally:
        store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    response = await client.get(
        "/v1/models", headers={"Authorization": f"Bearer {key}", "traceparent": TRACEPARENT}
    )
    assert response.status == 200
    app[TRACING].flush()
    for _ in range(50):
        if any(s.name == "GET /v1/models" for s in received):
            break
        await asyncio.sleep(0.1)
    (root,) = [s for s in received if s.name == "GET /v1/models"]
    assert root.trace_id.hex() == TRACEPARENT.split("-")[1]
    assert root.parent_span_id.hex() == TRACEPARENT.split("-")[2]


def test_the_next_hop_gets_the_trace_headers() -> None:
    off = Tracing()  # tracing off here: what came in goes on
    headers: dict[str, str] = {}
    off.inject(headers, {"traceparent": TRACEPARENT, "tracestate": "a=1"})
    assert headers == {"traceparent": TRACEPARENT, "tracestate": "a=1"}
    provider = TracerProvider()
    on = Tracing(provider)
    sent: dict[str, str] = {}
    with on.span("offload", parent={"traceparent": TRACEPARENT}):
        on.inject(sent, {})
    version, trace_id, span_id, _ = sent["traceparent"].split("-")
    assert (version, trace_id) == ("00", TRACEPARENT.split("-")[1])
    assert span_id != TRACEPARENT.split("-")[2]  # this hop's span is the next one's parent


async def test_an_embeddings_request_is_a_genai_span(
    aiohttp_client: AiohttpClient, aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    received: list[Span] = []

    async def traces(request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            for scope in resource_spans.scope_spans:
                received.extend(scope.spans)
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/traces", traces)
    server = await aiohttp_server(collector)
    # The embedding model only: no generation model is needed.
    settings = make_settings(
        tmp_path / "data",
        model={"default": "absent-model"},
        tracing={"otlp_endpoint": str(server.make_url("/v1/traces"))},
    )
    store = Store(settings.db_path)
    try:
        key = store.create_key("traced").plaintext
    finally:
        store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[EMBEDDINGS].wait_loaded()
    response = await client.post(
        "/v1/embeddings",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "all-MiniLM-L6-v2", "input": ["one text", "and another"]},
    )
    assert response.status == 200, await response.text()
    usage = (await response.json())["usage"]
    app[TRACING].flush()
    for _ in range(50):
        if any(s.name == "embeddings" for s in received):
            break
        await asyncio.sleep(0.1)
    (span,) = [s for s in received if s.name == "embeddings"]
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["gen_ai.operation.name"].string_value == "embeddings"
    assert attributes["gen_ai.provider.name"].string_value == "kovenlab-edge"
    assert attributes["gen_ai.request.model"].string_value == "all-MiniLM-L6-v2"
    assert attributes["gen_ai.response.model"].string_value
    assert attributes["gen_ai.usage.input_tokens"].int_value == usage["prompt_tokens"]
