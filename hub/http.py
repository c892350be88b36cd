"""What every hub route shares: the error middleware (every error in the one shape), the
body parser, the bearer token, the protocol version a node speaks, and protocol answers."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from hub.appkeys import METRICS, REQUEST_ID
from shared import protocol
from shared.errors import ApiError, DomainError, ErrorCode, error_body
from shared.tracing import new_request_id

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)

_HTTP_CODES = {
    404: ErrorCode.not_found,
    405: ErrorCode.method_not_allowed,
    413: ErrorCode.request_too_large,
}


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in the one error shape, with the request's id (`X-Kvl-Request-Id`,
    also in the log): ours, aiohttp's, and any other exception, which is a bug, logged
    with its traceback and answered 500 `internal_error`, never a plain-text page."""
    request_id = new_request_id()
    request[REQUEST_ID] = request_id
    started = time.perf_counter()
    code: ErrorCode | None = None
    try:
        response = await handler(request)
    except DomainError as err:
        api = (
            err
            if isinstance(err, ApiError)
            else ApiError(err.code, err.message, param=err.param, retry_after=err.retry_after)
        )
        code = api.code
        response = web.json_response(api.body(), status=api.status, headers=api.headers())
        if code is ErrorCode.shutting_down:
            response.force_close()  # the client's next request finds the new server
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, ErrorCode.bad_request)
        response = web.json_response(error_body(code, exc.reason), status=code.status)
    except Exception:
        log.exception(
            "unhandled error in %s %s (request %s)", request.method, request.path, request_id
        )
        code = ErrorCode.internal_error
        response = web.json_response(
            error_body(code, f"internal error; request id {request_id}"), status=code.status
        )
    if not response.prepared:
        response.headers["X-Kvl-Request-Id"] = request_id
    if METRICS in request.app:
        route = route_label(request)
        metrics = request.app[METRICS]
        metrics.requests.labels(route, request.method, str(response.status)).inc()
        if code is not None:
            metrics.errors.labels(route, code.value).inc()
        metrics.request_seconds.labels(route).observe(time.perf_counter() - started)
    return response


def route_label(request: web.Request) -> str:
    """The route's pattern (`/v1/admin/nodes/{node}/drain`), never the path itself: a
    label per node name or sha256 would grow without end."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "(unmatched)"


async def parse(request: web.Request, model: type[M]) -> M:
    """The body as `model`, or 400 in the error shape naming the first bad field (nesting
    past the JSON reader's depth is refused there too)."""
    raw = await request.read()
    try:
        return model.model_validate_json(raw or b"{}")  # no body: every default
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "json_invalid":
            raise ApiError(ErrorCode.invalid_json, f"the body is not JSON: {first['msg']}") from err
        raise ApiError(ErrorCode.invalid_value, f"`{param}`: {first['msg']}", param=param) from err


def query(request: web.Request, model: type[M]) -> M:
    """The query string as `model`, or 400 in the error shape naming the first bad
    parameter (a parameter given twice: its last value)."""
    try:
        return model.model_validate(dict(request.query))
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(ErrorCode.invalid_value, f"`{param}`: {first['msg']}", param=param) from err


def bearer(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer …` header, or None."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def protocol_version(request: web.Request) -> int:
    """The caller's protocol version (`Kvl-Protocol`), or 400 `protocol_unsupported`
    saying which side to upgrade."""
    header = request.headers.get(protocol.PROTOCOL_HEADER)
    version = protocol.node_protocol(header)
    if protocol.supported(version):
        assert version is not None  # noqa: S101 - supported() checked it
        return version
    window = f"{protocol.OLDEST_NODE_PROTOCOL}..{protocol.PROTOCOL_VERSION}"
    if version is not None and version > protocol.PROTOCOL_VERSION:
        fix = "upgrade the hub (a fleet is upgraded hub first)"
    else:
        fix = "upgrade the node"
    said = "no Kvl-Protocol header" if header is None else f"Kvl-Protocol {header[:20]!r}"
    raise ApiError(
        ErrorCode.protocol_unsupported,
        f"this hub serves node protocol versions {window}; the call has {said}: {fix}",
        param=protocol.PROTOCOL_HEADER,
    )


LARGE_BODY = 1 << 20  # bytes: aiohttp's own threshold for a body written whole


def answer(
    message: protocol.Message, status: int = 200, *, version: int = protocol.PROTOCOL_VERSION
) -> web.Response:
    """A protocol message, with the protocol version this hub speaks; for a node of an
    older ``version``, without the fields that version does not know."""
    body = protocol.dump_for(message, version).encode()
    return web.Response(
        # A body of over 1 MiB (a large fleet's desired state) written from bytes whole
        # holds the event loop, and aiohttp warns so at every answer: a stream of them
        # is written in chunks.
        body=io.BytesIO(body) if len(body) > LARGE_BODY else body,
        status=status,
        content_type="application/json",
        headers=protocol_header(),
    )


def protocol_header() -> dict[str, str]:
    return {protocol.PROTOCOL_HEADER: str(protocol.PROTOCOL_VERSION)}
