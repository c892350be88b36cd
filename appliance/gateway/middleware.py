"""Request ids, the one error shape, metrics, and API-key authentication."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from opentelemetry.trace import SpanKind

from appliance.gateway.appkeys import (
    ADMISSION,
    CERTIFICATE,
    METRICS,
    REQUEST_ID,
    REQUEST_KEY,
    STORE,
    TRACING,
)
from appliance.gateway.errors import error_response
from appliance.gateway.fleet import FLEET_PREFIX
from appliance.gateway.offload import OFFLOADED_PREFIX
from appliance.inference.authentication import authenticate as authenticate_key
from shared import tls
from shared.errors import ApiError, DomainError, ErrorCode, error_body
from shared.tracing import new_request_id

if TYPE_CHECKING:
    from appliance.state.store import ApiKey

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_CODES = {
    404: ErrorCode.not_found,
    405: ErrorCode.method_not_allowed,
    413: ErrorCode.request_too_large,
}

PEER_PREFIX = "/v1/peer/"  # appliance/gateway/peers.py: the hub's ticket, no key


def route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "(unmatched)"


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: request id, then every failure as the error shape, then the metrics."""
    request_id = request.headers.get("X-Request-Id") or new_request_id()
    request[REQUEST_ID] = request_id
    started = time.perf_counter()
    route = route_label(request)
    metrics = request.app[METRICS]
    with request.app[TRACING].span(
        f"{request.method} {route}",
        {
            "http.request.method": request.method,
            "url.path": request.path,
            "http.route": route,
            "kvl.request_id": request_id,
        },
        kind=SpanKind.SERVER,
        # A client's (or the previous hop's) `traceparent`: this request joins its trace.
        parent=request.headers,
    ) as span:
        response, code = await _answer(request, handler, request_id)
        span.set_attribute("http.response.status_code", response.status)
        if code is not None:
            span.set_attribute("error.type", code.value)
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
    metrics.requests.labels(route, request.method, str(response.status)).inc()
    if code is not None:
        metrics.errors.labels(route, code.value).inc()
    metrics.request_seconds.labels(route).observe(time.perf_counter() - started)
    return response


async def _answer(
    request: web.Request, handler: Handler, request_id: str
) -> tuple[web.StreamResponse, ErrorCode | None]:
    """The handler's response, or the error shape of whatever it raised, and its code."""
    code: ErrorCode | None = None
    try:
        response = await handler(request)
    except DomainError as err:
        code = err.code
        response = error_response(err)
        if code is ErrorCode.shutting_down:
            response.force_close()  # the client's next request finds the new server
        if (key := request.get(REQUEST_KEY)) is not None:
            await request.app[ADMISSION].hold_refusal(
                key.id, code, _connection(request), err.retry_after
            )
    except RequestPayloadError as exc:
        # The body could not be read: a Content-Encoding that does not decode, bad chunking.
        code = ErrorCode.bad_request
        response = web.json_response(
            error_body(code, f"the body cannot be read: {exc}"), status=code.status
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, ErrorCode.invalid_value)
        message = _http_message(exc, request)
        response = web.json_response(error_body(code, message), status=code.status)
    except Exception:
        log.exception(
            "unhandled error in %s %s (request %s)", request.method, request.path, request_id
        )
        code = ErrorCode.internal_error
        response = web.json_response(
            error_body(code, f"internal error; request id {request_id}"), status=code.status
        )
    return response, code


def _http_message(exc: web.HTTPException, request: web.Request) -> str:
    if exc.status == 404:
        return f"no route {request.method} {request.path}"
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        return f"{request.method} is not allowed on {request.path}; allowed: {allowed}"
    if exc.status == 413:
        limit = request.client_max_size
        return f"the body is larger than the limit of {limit} bytes"
    return exc.reason


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every /v1 route needs `Authorization: Bearer <key>` of a key that is not revoked,
    but the hub's own (`/v1/fleet/…`), which need the hub's certificate and no key, and
    the site's peers' (`/v1/peer/…`), which need the hub's ticket for the file."""
    if not request.path.startswith("/v1/") and request.path != "/v1":
        return await handler(request)
    if request.path.startswith(PEER_PREFIX):
        return await handler(request)  # the hub's ticket, checked by the route
    if request.path.startswith(FLEET_PREFIX):
        # Only a fleet route that exists asks for the hub's certificate: a path not routed,
        # or a method not allowed, is a 404 or a 405 whoever calls.
        if request.match_info.http_exception is None:
            with request.app[TRACING].span("auth"):
                _from_the_hub(request)
        return await handler(request)
    with request.app[TRACING].span("auth"):
        # Offloaded requests (/v1/offloaded/…) carry their client's own key: the same
        # check as every route; and they come from the hub (a route that exists only).
        key = await _authenticated(request)
        if request.path.startswith(OFFLOADED_PREFIX) and request.match_info.http_exception is None:
            _from_the_hub(request)
    request[REQUEST_KEY] = key
    return await handler(request)


def _from_the_hub(request: web.Request) -> None:
    """An offloaded request, or a fleet route's, comes from the hub, over mutual TLS: the
    fleet listener verified a certificate of the fleet, and it must be the hub's."""
    transport = request.transport
    peercert = transport.get_extra_info("peercert") if transport is not None else None
    if not peercert:
        raise ApiError(
            ErrorCode.client_certificate_required,
            f"{request.path} is the hub's to call, over mutual TLS on the fleet listener",
        )
    hub = request.app[CERTIFICATE].hub_uri() if CERTIFICATE in request.app else None
    if hub is None or hub not in tls.peer_uris(peercert):
        raise ApiError(
            ErrorCode.certificate_mismatch, "the client certificate is not the fleet hub's"
        )


async def _authenticated(request: web.Request) -> ApiKey:
    """The request's key, not revoked, from an address that is not throttled."""
    app = request.app
    key = await authenticate_key(
        request.headers.get("Authorization", ""),
        request.remote or "unknown",
        store=app[STORE],
        admission=app[ADMISSION],
        metrics=app[METRICS],
    )
    if request.path.startswith("/v1/admin/") and not key.admin:
        raise ApiError(
            ErrorCode.permission_denied,
            f"the API key {key.prefix} is not an admin key; create one with "
            "`kvl appliance keys create --account NAME --admin`",
        )
    return key


def _connection(request: web.Request) -> str:
    """The client's connection: its address and port while it is open."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return repr(peer) if peer else (request.remote or "")
