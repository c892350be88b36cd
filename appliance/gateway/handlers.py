"""Thin handlers: parse with pydantic, call the service, serialize."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from appliance.gateway import sse
from appliance.gateway.keys import (
    COMPLETIONS,
    EMBEDDINGS,
    METRICS,
    NODE_ID,
    OFFLOAD,
    REGISTRY,
    api_key,
)
from appliance.gateway.middleware import route_label
from appliance.gateway.parsing import read_json
from appliance.inference.completions import Prepared, Sink, invalid_output
from appliance.inference.embeddings import response_body as embeddings_body
from appliance.inference.responses import chunk_body, response_body
from appliance.inference.schemas import EmbeddingRequest, completion_request, parse_body
from shared import __version__
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from appliance.serving.engine import Event
    from appliance.serving.supervisor import Replica

log = logging.getLogger(__name__)


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
    host = request.app[REGISTRY]
    data = [
        {
            "id": replica.record.name,
            "object": "model",
            "created": 0,
            "owned_by": "kovenlab",
            "version": replica.record.version,
            "ref": replica.record.ref,
            "format": replica.record.format,
            "quantization": replica.record.quantization,
            "sha256": replica.record.sha256,
            "context_length": replica.options.n_ctx,
            "slots": replica.options.n_slots,
            "device": replica.layout.device if replica.layout is not None else "unknown",
        }
        for replica in host.replicas()
    ]
    data += [
        {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "kovenlab",
            "version": model.version,
            "ref": model.ref,
            "format": "onnx",
            "quantization": "int8",
            "sha256": model.sha256,
            "provider": model.provider,
            "dimension": model.dimension,
        }
        for model in request.app[EMBEDDINGS].served()
    ]
    return web.json_response({"object": "list", "data": data})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def _completion(request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await read_json(request)
    req = completion_request(body, chat=chat)
    prepared = await request.app[COMPLETIONS].prepare(req, api_key(request), route_label(request))
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
    except ApiError:
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
    except ApiError as err:
        offload = request.app[OFFLOAD]
        if not offload.eligible(err, prepared):
            raise
        return await offload.forward(request, prepared, body, err)


async def embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    req = parse_body(EmbeddingRequest, body)
    embedded = await request.app[EMBEDDINGS].embed(req, api_key(request), route_label(request))
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
    if stream:
        return await _stream(request, prepared, headers)
    completed = await service.complete(prepared)
    if completed.problems:
        raise invalid_output(completed.problems)
    return web.json_response(response_body(prepared, completed.finished), headers=headers)


class _EventStream(Sink):
    """A completion as server-sent events: the stream opens with the first event."""

    stream_span = True
    record_when_gone = True

    def __init__(self, request: web.Request, prepared: Prepared, headers: dict[str, str]) -> None:
        self._request = request
        self._prepared = prepared
        self._headers = headers
        self.response: web.StreamResponse | None = None  # once it has begun

    async def first(self, event: Event) -> None:
        self.response = await sse.open_stream(self._request, self._headers)

    async def streaming(self) -> None:
        if self._prepared.kind == "chat":
            await self.send(chunk_body(self._prepared, role=True))

    async def text(self, text: str) -> None:
        await self.send(chunk_body(self._prepared, text=text))

    async def send(self, data: dict[str, Any]) -> None:
        if self.response is not None:
            await sse.send(self.response, data)


async def _stream(
    request: web.Request, prepared: Prepared, headers: dict[str, str]
) -> web.StreamResponse:
    events = _EventStream(request, prepared, headers)
    try:
        completed = await request.app[COMPLETIONS].complete(prepared, events)
    except ApiError as err:
        if events.response is None:
            raise  # before the stream began: a status code of its own
        # Failed after the stream began (the worker died): the error is the last event.
        # The tokens it spent died with it; nothing reached the client as a finished answer.
        with contextlib.suppress(ConnectionResetError):
            await events.send(err.body())
            await events.response.write_eof()
        return events.response
    except ConnectionResetError:
        if events.response is None:
            raise
        # The client went away; the tokens it spent are recorded.
        log.info("client closed the stream of %s", prepared.id)
        return events.response
    response = events.response
    if response is None:  # pragma: no cover - the first event opens it
        raise AssertionError("a completed stream has begun")
    finished = completed.finished
    if completed.problems:
        await sse.send(response, invalid_output(completed.problems).body())
    else:
        await sse.send(response, chunk_body(prepared, finished=finished))
        if prepared.include_usage:
            await sse.send(response, chunk_body(prepared, finished=finished, usage_only=True))
        await sse.send_done(response)
    await response.write_eof()
    return response
