"""Thin handlers: parse with pydantic, call the service, serialize."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from appliance.gateway import sse
from appliance.gateway.appkeys import (
    COMPLETIONS,
    EMBEDDINGS,
    METRICS,
    NAMES,
    NODE_ID,
    OFFLOAD,
    REGISTRY,
    SETTINGS,
    STORE,
    TRACING,
    api_key,
)
from appliance.gateway.errors import error_data
from appliance.gateway.middleware import route_label
from appliance.gateway.parsing import read_json
from appliance.inference.bodies import chunk_body, response_body
from appliance.inference.completions import (
    GENAI_PROVIDER,
    Generation,
    Prepared,
    Sink,
    invalid_output,
)
from appliance.inference.embeddings import response_body as embeddings_body
from appliance.inference.models import find_entry, model_entries
from appliance.inference.schemas import EmbeddingRequest, completion_request, parse_body
from appliance.serving.catalog import embedded_models
from shared import __version__
from shared.errors import ApiError, DomainError, ErrorCode

if TYPE_CHECKING:
    from appliance.inference.choices import ChoiceDelta
    from appliance.serving.engine import Event
    from appliance.serving.supervisor import Replica

log = logging.getLogger(__name__)

# Names the body fields a completion ignored (server.strict_parameters refuses them).
IGNORED_HEADER = "Kvl-Ignored-Parameters"


# Usage status of a generation whose client disconnected (nginx's convention).
async def healthz(request: web.Request) -> web.Response:
    return web.json_response(
        {"status": "alive", "version": __version__, "node_id": request.app[NODE_ID]}
    )


async def readyz(request: web.Request) -> web.Response:
    host = request.app[REGISTRY]
    embedder = request.app[EMBEDDINGS]
    if host.load_error is not None:
        raise ApiError(ErrorCode.model_not_ready, f"the model failed to load: {host.load_error}")
    if embedder.load_error is not None:
        raise ApiError(
            ErrorCode.model_not_ready,
            f"the embedding model failed to load: {embedder.load_error}; fix that, or set "
            "embeddings.enabled to false",
        )
    if not host.ready:
        raise ApiError(ErrorCode.model_not_ready, "the model is loading", retry_after=2)
    if embedder.enabled and not embedder.ready:
        raise ApiError(ErrorCode.model_not_ready, "the embedding model is loading", retry_after=2)
    models = [r.ref for r in host.served()] + [m.ref for m in embedder.served()]
    devices = {replica.record.ref: _layout(replica) for replica in host.replicas()}
    devices.update(
        {m.ref: {"device": "onnxruntime", "provider": m.provider} for m in embedder.served()}
    )
    return web.json_response({"status": "ready", "models": models, "devices": devices})


def _layout(replica: Replica) -> dict[str, Any]:
    if replica.layout is None:
        return {"device": "unknown"}
    return replica.layout.to_json()


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": await _model_entries(request)})


async def retrieve_model(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    entry = find_entry(await _model_entries(request), model)
    if entry is None:
        raise ApiError(ErrorCode.model_not_found, f"no model {model!r}", param="model")
    return web.json_response(entry)


async def _model_entries(request: web.Request) -> list[dict[str, Any]]:
    store = request.app[STORE]
    registered = await store.run(store.sync.list_models)
    served = request.app[EMBEDDINGS].served()
    return model_entries(
        registered,
        request.app[REGISTRY].loaded_models(),
        served[0] if served else None,
        request.app[NAMES],
        embedded_models(),
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def _completion(request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await read_json(request)
    req = completion_request(body, chat=chat, strict=request.app[SETTINGS].server.strict_parameters)
    key = api_key(request)
    # A request the fleet could take when refused here is prepared whole first.
    early = not request.app[OFFLOAD].possible(key.account.service_class)
    prepared = await request.app[COMPLETIONS].prepare(
        req, key, route_label(request), refuse_early=early
    )
    return await _respond_or_offload(request, prepared, body, stream=req.stream)


async def offloaded(request: web.Request) -> web.StreamResponse:
    """A request another node shed, handed over by the hub: served here like any of the
    account's requests, never offloaded again."""
    body = await read_json(request)
    req = completion_request(body, chat=request.path.endswith("/chat/completions"))
    prepared = await request.app[COMPLETIONS].prepare(req, api_key(request), route_label(request))
    metrics = request.app[METRICS]
    try:
        response = await _respond(request, prepared, stream=req.stream)
    except DomainError:
        metrics.offloads.labels("served", "refused").inc()
        raise
    metrics.offloads.labels("served", "served").inc()
    return response


async def _respond_or_offload(
    request: web.Request, prepared: Prepared, body: dict[str, Any], *, stream: bool
) -> web.StreamResponse:
    """Serve here; shed for load, hand it to the fleet where its class allows."""
    try:
        return await _respond(request, prepared, stream=stream)
    except DomainError as err:
        offload = request.app[OFFLOAD]
        if not offload.eligible(err, prepared):
            raise
        return await offload.forward(request, prepared, body, err)


async def embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    req = parse_body(EmbeddingRequest, body)
    attributes = {
        "gen_ai.operation.name": "embeddings",
        "gen_ai.provider.name": GENAI_PROVIDER,
        "gen_ai.request.model": req.model,
    }
    with request.app[TRACING].span("embeddings", attributes) as span:
        embedded = await request.app[EMBEDDINGS].embed(req, api_key(request), route_label(request))
        span.set_attribute("gen_ai.response.model", embedded.model.ref)
        span.set_attribute("gen_ai.usage.input_tokens", sum(embedded.result.token_counts))
    # Thousands of floats to format: off the event loop, which other requests share.
    text = await asyncio.to_thread(
        lambda: json.dumps(embeddings_body(embedded), separators=(",", ":"))
    )
    headers = {"X-Kvl-Model": embedded.model.ref}
    if embedded.result.truncated:
        headers["X-Kvl-Truncated-Inputs"] = str(embedded.result.truncated)
    return web.Response(text=text, content_type="application/json", headers=headers)


async def _respond(request: web.Request, prepared: Prepared, *, stream: bool) -> web.StreamResponse:
    service = request.app[COMPLETIONS]
    headers = {"X-Kvl-Model": prepared.model}
    if prepared.ignored:
        headers[IGNORED_HEADER] = ", ".join(prepared.ignored)
    if stream:
        return await _stream(request, prepared, headers)
    completed = await service.complete(prepared)
    if completed.problems:
        raise invalid_output(completed)
    return web.json_response(response_body(completed), headers=headers)


class _EventStream(Sink):
    """A completion as server-sent events: the stream opens with the first event, or
    earlier with a keep-alive comment when the first token is long in coming (an S0
    request may wait minutes), so a proxy does not cut it; an error after that is the
    stream's last event."""

    stream_span = True
    record_when_gone = True

    def __init__(
        self,
        request: web.Request,
        prepared: Prepared,
        headers: dict[str, str],
        keepalive_s: float,
    ) -> None:
        self._request = request
        self._prepared = prepared
        self._headers = headers
        self._keepalive_s = keepalive_s
        self._opening = asyncio.Lock()
        self._last = time.monotonic()
        self._keeper: asyncio.Task[None] | None = None
        self.response: web.StreamResponse | None = None  # once it has begun

    async def started(self, generation: Generation) -> None:
        if self._keepalive_s > 0:
            self._keeper = asyncio.create_task(self._keep_alive(), name="kvl-sse-keepalive")

    async def first(self, event: Event) -> None:
        await self._open()

    async def _open(self) -> web.StreamResponse:
        async with self._opening:
            if self.response is None:
                self.response = await sse.open_stream(self._request, self._headers)
            return self.response

    async def _keep_alive(self) -> None:
        with contextlib.suppress(ConnectionResetError):
            while True:
                await asyncio.sleep(self._keepalive_s - (time.monotonic() - self._last))
                if time.monotonic() - self._last >= self._keepalive_s:
                    response = await self._open()
                    self._last = time.monotonic()
                    await sse.send_comment(response)

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()

    async def streaming(self) -> None:
        if self._prepared.kind == "chat":
            for index in range(self._prepared.n):
                await self.send(chunk_body(self._prepared, index=index, role=True))

    async def delta(self, index: int, delta: ChoiceDelta) -> None:
        await self.send(chunk_body(self._prepared, index=index, delta=delta))

    async def send(self, data: dict[str, Any]) -> None:
        if self.response is not None:
            self._last = time.monotonic()
            await sse.send(self.response, data)


async def _stream(
    request: web.Request, prepared: Prepared, headers: dict[str, str]
) -> web.StreamResponse:
    keepalive_s = request.app[SETTINGS].server.sse_keepalive_s
    events = _EventStream(request, prepared, headers, keepalive_s)
    try:
        completed = await request.app[COMPLETIONS].complete(prepared, events)
    except DomainError as err:
        if events.response is None:
            raise  # before the stream began: a status code of its own
        # Failed after the stream began (the worker died): the error is the last event.
        # The tokens it spent died with it; nothing reached the client as a finished answer.
        with contextlib.suppress(ConnectionResetError):
            await events.send(error_data(err))
            await events.response.write_eof()
        return events.response
    except ConnectionResetError:
        if events.response is None:
            raise
        # The client went away; the tokens it spent are recorded.
        log.info("client closed the stream of %s", prepared.id)
        return events.response
    finally:
        events.close()
    response = events.response
    if response is None:  # pragma: no cover - the first event opens it
        raise AssertionError("a completed stream has begun")
    finished = completed.finished
    if completed.problems:
        await sse.send(response, error_data(invalid_output(completed)))
    else:
        for choice in completed.choices:
            last = choice is completed.choices[-1]
            data = chunk_body(prepared, choice=choice, finished=finished if last else None)
            await sse.send(response, data)
        if prepared.include_usage:
            await sse.send(response, chunk_body(prepared, finished=finished, usage_only=True))
        await sse.send_done(response)
    await response.write_eof()
    return response
