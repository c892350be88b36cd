"""CORS for browser clients of the LAN API (`server.cors_origins`).

The preflight is answered by the outermost middleware, before authentication (a browser
sends it without the key); every answer, errors and streams included, gets the headers a
browser needs to read it just before its headers go out (`on_response_prepare`).
Credentials are never allowed: the API takes bearer keys, not cookies.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from aiohttp import web

from appliance.gateway.appkeys import SETTINGS
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from appliance.gateway.middleware import Handler

# What a browser script may read of an answer besides the CORS-safelisted headers.
_EXPOSED = "Retry-After, X-Request-Id, X-Kvl-Model, Kvl-Ignored-Parameters"
_METHODS = "GET, POST, DELETE, OPTIONS"
# Header names a preflight may ask for: HTTP tokens, a bounded list (SDKs send a dozen).
_HEADER_LIST = re.compile(
    r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+){0,63}$"
)
PREFLIGHT_MAX_AGE_S = 600


def _allowed(origin: str, origins: list[str]) -> str | None:
    """The `Access-Control-Allow-Origin` value for `origin`, or None if it is not allowed."""
    if "*" in origins:
        return "*"
    return origin if origin in origins else None


@web.middleware
async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    origins = request.app[SETTINGS].server.cors_origins
    origin = request.headers.get("Origin")
    if not origins or origin is None:
        return await handler(request)
    allow = _allowed(origin, origins)
    asked = request.headers.get("Access-Control-Request-Method")
    if request.method == "OPTIONS" and asked is not None:
        if allow is None:
            error = ApiError(
                ErrorCode.permission_denied,
                f"origin {origin!r} is not in server.cors_origins",
            )
            return web.json_response(error.body(), status=error.status)
        headers = request.headers.get("Access-Control-Request-Headers", "").strip()
        answer = web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": allow,
                "Access-Control-Allow-Methods": _METHODS,
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                "Vary": "Origin",
            },
        )
        if headers and _HEADER_LIST.match(headers):
            answer.headers["Access-Control-Allow-Headers"] = headers
        return answer
    return await handler(request)


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The CORS headers of an answer to an allowed origin (an `on_response_prepare` hook)."""
    origins = request.app[SETTINGS].server.cors_origins
    origin = request.headers.get("Origin")
    if not origins or origin is None or "Access-Control-Allow-Origin" in response.headers:
        return
    allow = _allowed(origin, origins)
    if allow is not None:
        response.headers["Access-Control-Allow-Origin"] = allow
        response.headers["Access-Control-Expose-Headers"] = _EXPOSED
        response.headers["Vary"] = "Origin"
