"""`GET /metrics`: the hub's Prometheus metrics. On the hub API it takes an operator token
(hub/api/operator.py's middleware); `metrics.listen` serves it, alone and without a token,
on a plain-HTTP listener of its own for a Prometheus beside the hub (`metrics_app`)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from hub.api.route_kinds import Auth, Route, route_defs
from hub.appkeys import METRICS, SCHEDULED, SETTINGS, STORE
from hub.observability.fleet import refresh


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    own = await asyncio.to_thread(app[SCHEDULED].report)
    await refresh(app[METRICS], app[STORE], app[SETTINGS], own_backup=own)
    body, content_type = app[METRICS].render(request.headers.get("Accept", ""))
    # The content type carries its own parameters (version, charset): set it whole.
    return web.Response(body=body, headers={"Content-Type": content_type})


METRICS_ROUTE = Route(
    "GET",
    "/metrics",
    metrics,
    "The hub's Prometheus metrics (OpenMetrics, or the text format when only that is "
    "accepted); without a token on the `metrics.listen` listener only.",
    Auth.operator,
    answer_types=("application/openmetrics-text", "text/plain"),
)


def metrics_app(hub: web.Application) -> web.Application:
    """The `metrics.listen` listener's application: `/metrics` alone, on the hub's own
    registry and store, without a token."""
    app = web.Application()
    app[METRICS] = hub[METRICS]
    app[SETTINGS] = hub[SETTINGS]
    app[STORE] = hub[STORE]
    app[SCHEDULED] = hub[SCHEDULED]
    app.add_routes(route_defs([METRICS_ROUTE]))
    return app
