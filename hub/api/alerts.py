"""The operator API of alerts and silences (`/v1/admin/alerts`, `/v1/admin/silences`):
what the alert loop (hub/alerting/) recorded, and the silences that hold alerts back.
Behind the operator token (hub/api/operator.py's middleware)."""

from __future__ import annotations

import time

from aiohttp import web

from hub.api.requests import SilenceRequest
from hub.api.route_kinds import Auth, Param, Route
from hub.appkeys import OPERATOR, STORE
from hub.http import parse
from hub.views import alert_view, silence_view
from shared.errors import ApiError, ErrorCode


async def list_alerts(request: web.Request) -> web.Response:
    """The hub's alerts, newest first: `?state=firing` (or `resolved`) for those only."""
    state = request.query.get("state")
    if state not in {None, "firing", "resolved"}:
        raise ApiError(ErrorCode.invalid_value, "`state` is `firing` or `resolved`", param="state")
    store = request.app[STORE]
    found = await store.run(store.sync.alerts.all, state)
    return web.json_response({"data": [alert_view(a) for a in found]})


async def create_silence(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, SilenceRequest)
    silence = await store.run(
        store.sync.alerts.create_silence,
        req.matchers,
        time.time() + req.duration_s,
        request[OPERATOR],
        req.comment,
    )
    return web.json_response(silence_view(silence, time.time()), status=201)


async def list_silences(request: web.Request) -> web.Response:
    store = request.app[STORE]
    now = time.time()
    found = await store.run(store.sync.alerts.silences)
    return web.json_response({"data": [silence_view(s, now) for s in found]})


async def delete_silence(request: web.Request) -> web.Response:
    store = request.app[STORE]
    silence_id = request.match_info["id"]
    await store.run(store.sync.alerts.delete_silence, silence_id)
    return web.json_response({"id": silence_id, "deleted": True})


ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/admin/alerts",
        list_alerts,
        "The alerts the hub recorded, newest first: rule, labels, state, when it fired "
        "and resolved, value, summary, whether a silence held it back.",
        Auth.operator,
        params=(
            Param(
                "state",
                "query",
                "only those `firing`, or `resolved`",
                {"type": "string", "enum": ["firing", "resolved"]},
            ),
        ),
    ),
    Route("GET", "/v1/admin/silences", list_silences, "Silences, newest first.", Auth.operator),
    Route(
        "POST",
        "/v1/admin/silences",
        create_silence,
        "Silence the alerts whose rule and labels match: recorded, not delivered.",
        Auth.operator,
        SilenceRequest,
        status=201,
    ),
    Route(
        "DELETE",
        "/v1/admin/silences/{id}",
        delete_silence,
        "End a silence.",
        Auth.operator,
        errors=(ErrorCode.not_found,),
    ),
)
