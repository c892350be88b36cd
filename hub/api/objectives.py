"""The operator API of the fleet's objectives (`/v1/admin/objectives`): attainment, error
budgets and burn rates over a window (hub/fleet/objectives.py), as a report and as the
points of its charts. Behind the operator token (hub/api/operator.py's middleware)."""

from __future__ import annotations

import time

from aiohttp import web

from hub.api.requests import ObjectivesQuery
from hub.api.route_kinds import Auth, Param, Route
from hub.appkeys import SETTINGS, STORE
from hub.fleet.objectives import report_view, series_view
from hub.http import query
from shared.errors import ErrorCode


async def objectives(request: web.Request) -> web.Response:
    """The fleet's objectives over a window: attainment, target, budget left, burn rate."""
    q = query(request, ObjectivesQuery)
    store = request.app[STORE]
    view = await store.read(
        report_view,
        store.reader,
        request.app[SETTINGS].objectives,
        window=q.window,
        by=q.by,
        filters=q.filters(),
        now=time.time(),
    )
    return web.json_response(view)


async def objectives_series(request: web.Request) -> web.Response:
    """The points of the objectives' charts over a window, per class."""
    q = query(request, ObjectivesQuery)
    store = request.app[STORE]
    view = await store.read(
        series_view,
        store.reader,
        request.app[SETTINGS].objectives,
        window=q.window,
        step_s=q.step_s,
        filters=q.filters(),
        now=time.time(),
    )
    return web.json_response(view)


_WINDOW = {"type": "string", "pattern": "^[0-9]{1,7}[smhdw]$"}
_FILTERS = (
    Param("window", "query", "how far back from now: 5m, 1h, 1d, 30d, … (at most 35d)", _WINDOW),
    Param("class", "query", "one service class", {"enum": ["S0", "S1", "S2", "S3", "S4"]}),
    Param("account", "query", "one account (`(other)`: those the hub does not know)",
          {"type": "string"}),
    Param("site", "query", "one site", {"type": "string"}),
    Param("node", "query", "one node, by id or name", {"type": "string"}),
)  # fmt: skip
ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/admin/objectives",
        objectives,
        "The fleet's objectives over a window (1h unless named), per class and `by` "
        "group: met, missed, attainment, target, error budget left over the budget "
        "period, burn rate; and requests by outcome.",
        Auth.operator,
        errors=(ErrorCode.invalid_value,),
        params=(
            *_FILTERS,
            Param(
                "by",
                "query",
                "the groups: class (the default), account, site or node",
                {"enum": ["class", "account", "site", "node"]},
            ),
        ),
    ),
    Route(
        "GET",
        "/v1/admin/objectives/series",
        objectives_series,
        "The objectives over a window as points in time, per class: requests, attainment "
        "and burn rate of each objective, TTFT median and 95th percentile.",
        Auth.operator,
        errors=(ErrorCode.invalid_value,),
        params=(
            *_FILTERS,
            Param(
                "step",
                "query",
                "time between points (rounded to the buckets' 5 min or 1 h)",
                _WINDOW,
            ),
        ),
    ),
)
