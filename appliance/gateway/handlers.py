"""Thin handlers: parse with pydantic, call the service, serialize."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

from aiohttp import web

from appliance.gateway import sse
from appliance.gateway.completions import (
    CLIENT_CLOSED,
    Generation,
    Prepared,
    chunk_body,
    drain,
    invalid_output,
    response_body,
)
from appliance.gateway.embeddings import response_body as embeddings_body
from appliance.gateway.keys import (
    COMPLETIONS,
    EMBEDDINGS,
    HOST,
    METRICS,
    NODE_ID,
    OFFLOAD,
    TRACING,
    api_key,
)
from appliance.gateway.middleware import route_label
from appliance.gateway.parsing import parse_body, read_json
from appliance.gateway.schemas import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from appliance.serving.engine import Event, Finished, TextDelta
from shared import __version__
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from appliance.serving.supervisor import Replica

log = logging.getLogger(__name__)


# Usage status of a generation whose client disconnected (nginx's convention).
async def healthz(request: web.Request) -> web.Response:
    return web.json_response(
        {"status": "alive", "version": __version__, "node_id": request.app[NODE_ID]}
    )


async def readyz(request: web.Request) -> web.Response:
    host = request.app[HOST]
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
    devices = {replica.record.ref: _placement(replica) for replica in host.replicas()}
    devices.update(
        {m.ref: {"device": "onnxruntime", "provider": m.provider} for m in embedder.served()}
    )
    return web.json_response({"status": "ready", "models": models, "devices": devices})


def _placement(replica: Replica) -> dict[str, Any]:
    if replica.placement is None:
        return {"device": "unknown"}
    return replica.placement.to_json()


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def list_models(request: web.Request) -> web.Response:
    host = request.app[HOST]
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
            "device": replica.placement.device if replica.placement is not None else "unknown",
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
    body = await read_json(request)
    req = parse_body(ChatCompletionRequest, body, UNSUPPORTED_CHAT)
    prepared = await request.app[COMPLETIONS].prepare_chat(
        req, api_key(request), route_label(request)
    )
    return await _respond_or_offload(request, prepared, body, stream=req.stream)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req = parse_body(CompletionRequest, body, UNSUPPORTED_COMPLETION)
    prepared = await request.app[COMPLETIONS].prepare_text(
        req, api_key(request), route_label(request)
    )
    return await _respond_or_offload(request, prepared, body, stream=req.stream)


async def offloaded(request: web.Request) -> web.StreamResponse:
    """A request another node shed, handed over by the hub: served here like any of the
    account's requests, never offloaded again."""
    body = await read_json(request)
    service = request.app[COMPLETIONS]
    key, label = api_key(request), route_label(request)
    if request.path.endswith("/chat/completions"):
        chat = parse_body(ChatCompletionRequest, body, UNSUPPORTED_CHAT)
        prepared, stream = await service.prepare_chat(chat, key, label), chat.stream
    else:
        text = parse_body(CompletionRequest, body, UNSUPPORTED_COMPLETION)
        prepared, stream = await service.prepare_text(text, key, label), text.stream
    metrics = request.app[METRICS]
    try:
        response = await _respond(request, prepared, stream=stream)
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
    async with contextlib.aclosing(service.start(prepared)) as generation:
        # Wait for the first event before answering, so a grammar the engine refuses is
        # still a proper status code rather than an error inside a 200 stream.
        first = await anext(generation)
        if not stream:
            finished = first if isinstance(first, Finished) else await drain(generation)
            problems = service.problems(prepared, finished)
            status = ErrorCode.output_validation_failed.status if problems else 200
            await service.record(prepared, finished, status)
            if problems:
                raise invalid_output(problems)
            return web.json_response(response_body(prepared, finished), headers=headers)
        return await _stream(request, prepared, first, generation, headers)


async def _stream(
    request: web.Request,
    prepared: Prepared,
    first: Event,
    generation: Generation,
    headers: dict[str, str],
) -> web.StreamResponse:
    service = request.app[COMPLETIONS]
    response = await sse.open_stream(request, headers)
    try:
        with request.app[TRACING].span("stream", {"kvl.model": prepared.model}):
            if prepared.kind == "chat":
                await sse.send(response, chunk_body(prepared, role=True))
            event = first
            while isinstance(event, TextDelta):
                await sse.send(response, chunk_body(prepared, text=event.text))
                event = await anext(generation)
            finished = event
    except ApiError as err:
        # Failed after the stream began (the worker died): the error is the last event.
        # The tokens it spent died with it; nothing reached the client as a finished answer.
        with contextlib.suppress(ConnectionResetError):
            await sse.send(response, err.body())
            await response.write_eof()
        return response
    except (ConnectionResetError, asyncio.CancelledError):
        # The client went away: stop the sequence and still count the tokens it spent.
        generation.cancel()
        finished = await asyncio.shield(drain(generation))
        await asyncio.shield(service.record(prepared, finished, CLIENT_CLOSED))
        if isinstance(sys.exc_info()[1], asyncio.CancelledError):
            raise
        log.info("client closed the stream of %s", prepared.id)
        return response
    problems = service.problems(prepared, finished)
    await service.record(prepared, finished, 422 if problems else 200)
    if problems:
        await sse.send(response, invalid_output(problems).body())
    else:
        await sse.send(response, chunk_body(prepared, finished=finished))
        if prepared.include_usage:
            await sse.send(response, chunk_body(prepared, finished=finished, usage_only=True))
        await sse.send_done(response)
    await response.write_eof()
    return response


async def openapi(request: web.Request) -> web.Response:
    from appliance.gateway.openapi import build_openapi  # noqa: PLC0415 - the route table imports this module

    return web.json_response(build_openapi())
