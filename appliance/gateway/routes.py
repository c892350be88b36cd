"""The route table: one list that the app, the OpenAPI document and the docs test all read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from appliance.gateway import handlers, websocket
from appliance.gateway.schemas import ChatCompletionRequest, CompletionRequest
from shared.errors import ErrorCode

if TYPE_CHECKING:
    from pydantic import BaseModel

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_AUTH = (ErrorCode.missing_api_key, ErrorCode.invalid_api_key, ErrorCode.revoked_api_key)
_BODY = (
    ErrorCode.invalid_json,
    ErrorCode.invalid_parameter,
    ErrorCode.missing_parameter,
    ErrorCode.unknown_parameter,
    ErrorCode.unsupported_parameter,
    ErrorCode.request_too_large,
)
_GENERATE = (
    ErrorCode.model_not_found,
    ErrorCode.context_length_exceeded,
    ErrorCode.queue_full,
    ErrorCode.model_not_ready,
)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    auth: bool
    body: type[BaseModel] | None = None
    errors: tuple[ErrorCode, ...] = ()
    streams: bool = False


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", handlers.healthz, "Liveness: the process is up.", auth=False),
    Route(
        "GET",
        "/readyz",
        handlers.readyz,
        "Readiness: 200 once the model is loaded, 503 before.",
        auth=False,
        errors=(ErrorCode.model_not_ready,),
    ),
    Route("GET", "/metrics", handlers.metrics, "OpenMetrics exposition.", auth=False),
    Route("GET", "/openapi.json", handlers.openapi, "This API's OpenAPI 3.1 document.", auth=False),
    Route(
        "GET",
        "/v1/models",
        handlers.list_models,
        "The models this appliance serves.",
        auth=True,
        errors=_AUTH,
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        handlers.chat_completions,
        "Chat completion (OpenAI), streaming with `stream: true`; `response_format` json_object "
        "and json_schema are enforced by constrained decoding and validated.",
        auth=True,
        body=ChatCompletionRequest,
        errors=(
            *_AUTH,
            *_BODY,
            *_GENERATE,
            ErrorCode.invalid_schema,
            ErrorCode.output_validation_failed,
        ),
        streams=True,
    ),
    Route(
        "POST",
        "/v1/completions",
        handlers.completions,
        "Text completion (OpenAI legacy), streaming with `stream: true`.",
        auth=True,
        body=CompletionRequest,
        errors=(*_AUTH, *_BODY, *_GENERATE),
        streams=True,
    ),
    Route(
        "GET",
        "/v1/ws",
        websocket.stream,
        "WebSocket streaming: several chat and text completions on one connection, each "
        "with its own id, cancellable by message (see the README).",
        auth=True,
        errors=(*_AUTH, ErrorCode.bad_request),
    ),
)
