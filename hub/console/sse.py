"""The console's live updates: server-sent events carrying what a page shows (the fleet
table's rows, the rollouts) whenever it changes. A stream ends when the hub shuts down,
when its login ends, or when the browser goes away."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from aiohttp import web

from hub.console.fleet import Filters, fleet_table
from hub.console.web import console, current_session, hub_settings, hub_store
from shared.supervise import wait_until_set

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from typing import Any

KEEPALIVE_S = 15.0  # a comment now and then, so proxies and the browser keep the stream
SESSION_CHECK_S = 30.0  # how often a stream checks that its login still holds


def event(name: str, data: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def nodes_stream(request: web.Request) -> web.StreamResponse:
    """`GET /console/nodes/stream[?site=&status=&name=]`: `nodes` events with the rows of
    the fleet table (the page's filters), and `logout` when the login ended."""
    state = console(request)
    settings = hub_settings(request)
    store = hub_store(request)
    filters = Filters.from_query(request.query)

    async def rows() -> object:
        nodes = await state.snapshot.nodes(store, settings.console.stream_every_s)
        return fleet_table(nodes, settings, time.time(), filters)

    return await stream(request, "nodes", rows)


async def stream(
    request: web.Request, name: str, read: Callable[[], Awaitable[object]]
) -> web.StreamResponse:
    """A live stream of a page: `name` events with what `read` answers, each time it
    changed (every `console.stream_every_s`), and `logout` when the login ended; 401
    without a login."""
    if await current_session(request) is None:
        return web.Response(status=401, text="log in to the console first\n")
    state = console(request)
    every = hub_settings(request).console.stream_every_s
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                 "X-Accel-Buffering": "no"}
    )  # fmt: skip
    await response.prepare(request)
    last_sent = None
    last_write = last_check = time.monotonic()
    try:
        await response.write(f"retry: {int(every * 1000) + 1000}\n\n".encode())
        while not state.closing.is_set():
            if time.monotonic() - last_check >= SESSION_CHECK_S:
                last_check = time.monotonic()
                if await current_session(request) is None:
                    await response.write(event("logout", {}))
                    break
            payload = await read()
            if payload != last_sent:
                await response.write(event(name, payload))
                last_sent, last_write = payload, time.monotonic()
            elif time.monotonic() - last_write >= KEEPALIVE_S:
                await response.write(b": keepalive\n\n")
                last_write = time.monotonic()
            await wait_until_set(state.closing, every)
    except (ConnectionResetError, ConnectionError):
        pass  # the browser left
    return response
