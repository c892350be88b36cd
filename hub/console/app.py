"""The console's wiring: its routes, its state, the sampler that keeps each node's load
for the charts, and the end of its live streams when the hub shuts down."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from hub.appkeys import BEATS, LOOPS, RUNNING, SETTINGS, STORE
from hub.console.alerts import alert_routes
from hub.console.auth import LoginThrottle
from hub.console.models import model_routes
from hub.console.objectives import objectives_routes
from hub.console.pages import console_routes
from hub.console.rollouts import rollout_routes
from hub.console.samples import Sampler
from hub.console.web import (
    CONSOLE,
    HERE,
    ConsoleState,
    guarded,
    not_found,
    security_headers,
    templates,
)
from hub.loops import running

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from hub.settings import HubSettings
    from hub.state.nodes import Heartbeat
    from hub.state.store import AsyncHubStore
    from shared.supervise import Failures

log = logging.getLogger(__name__)

STATIC = {"console.css": "text/css", "console.js": "text/javascript"}


def setup_console(app: web.Application) -> None:
    """Add the console to the hub's application (after its store's cleanup context)."""
    settings = app[SETTINGS]
    app[CONSOLE] = ConsoleState(
        settings=settings,
        templates=templates(),
        throttle=LoginThrottle(settings.console.login_failures_allowed),
        static={name: ((HERE / "static" / name).read_bytes(), kind)
                for name, kind in STATIC.items()},
    )  # fmt: skip
    app.add_routes(console_routes())
    app.add_routes(alert_routes())
    app.add_routes(objectives_routes())
    app.add_routes(rollout_routes())
    app.add_routes(model_routes())
    app.add_routes([
        web.get("/console/static/{name}", static),
        # Last: any other console path is an HTML 404, not the API's JSON one.
        web.route("*", "/console/{tail:.*}", guarded(not_found)),
    ])  # fmt: skip
    app.on_response_prepare.append(security_headers)
    app.on_shutdown.append(_end_streams)
    app.cleanup_ctx.append(_sampler)


async def static(request: web.Request) -> web.StreamResponse:
    found = request.app[CONSOLE].static.get(request.match_info["name"])
    if found is None:
        return await not_found(request)
    body, kind = found
    return web.Response(body=body, content_type=kind, headers={"Cache-Control": "max-age=300"})


async def _end_streams(app: web.Application) -> None:
    app[CONSOLE].closing.set()


async def _sampler(app: web.Application) -> AsyncIterator[None]:
    """Samples of each node's load for its charts, taken from the heartbeats the flusher
    writes (a node's first, then one each `console.sample_every_s`); old ones pruned."""
    settings = app[SETTINGS]
    store = app[STORE]
    sampler = Sampler(settings.console.sample_every_s)

    # Its failures are counted by the flusher, which runs each listener under its own
    # guard (hub/fleet/heartbeats.py), as `heartbeats.console_samples`.
    async def console_samples(beats: list[Heartbeat]) -> None:
        if samples := sampler.due(beats):
            await store.run(store.sync.console.record_samples, samples)

    app[BEATS].listeners.append(console_samples)
    async with running(app[RUNNING], "console.prune", prune_forever(store, settings, app[LOOPS])):
        yield


async def prune_forever(store: AsyncHubStore, settings: HubSettings, failures: Failures) -> None:
    """Every `console.sample_every_s`, the first at once: samples older than
    `console.samples_kept_s`, and expired sessions, deleted. A round that fails is logged
    and counted; the next tries again."""

    async def once() -> None:
        now = time.time()
        await store.run(
            store.sync.console.prune, now=now, samples_before=now - settings.console.samples_kept_s
        )

    await failures.forever("console.prune", once, settings.console.sample_every_s, wait_first=False)
