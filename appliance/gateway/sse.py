"""Server-sent events in OpenAI's streaming format."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


async def open_stream(
    request: web.Request, headers: dict[str, str] | None = None
) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # tell a reverse proxy not to buffer the stream
            **(headers or {}),
        },
    )
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")


async def send_comment(response: web.StreamResponse, text: str = "keep-alive") -> None:
    """A comment line: clients ignore it, proxies see a live stream."""
    await response.write(b": " + text.encode() + b"\n\n")
