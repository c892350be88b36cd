"""Domain errors as HTTP answers: the gateway maps them here, and nowhere else.

A service raises the DomainError that says what went wrong (shared.errors), never an
HTTP status. Its HTTP answer is the status and type of its code, its body in the one
error shape, and Retry-After (with `x-should-retry: false` for a spent allowance) when it
says when to ask again. The middleware answers with it; a stream that has begun sends its
body as its last event, or frame.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from shared.errors import ApiError, DomainError


def http_error(err: DomainError) -> ApiError:
    """The HTTP error that `err` answers as."""
    if isinstance(err, ApiError):
        return err  # the gateway's own: HTTP's already
    return ApiError(err.code, err.message, param=err.param, retry_after=err.retry_after)


def error_response(err: DomainError) -> web.Response:
    http = http_error(err)
    return web.json_response(http.body(), status=http.status, headers=http.headers())


def error_data(err: DomainError) -> dict[str, Any]:
    """The error shape of `err`, for a stream whose status went out already."""
    return http_error(err).body()
