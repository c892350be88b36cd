"""The console's alerts page (`/console/alerts`): what fires, what resolved lately, and
the silences, which it makes and ends through the store methods the operator API and
`kvl hub alerts` call."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from pydantic import ValidationError

from hub.api.requests import SilenceRequest
from hub.appkeys import SCHEDULED
from hub.console.fleet import backup_cells
from hub.console.web import FORM, SESSION, hub_store, page, render, see_other

ALERTS_SHOWN = 200
DURATIONS = {"1h": 3600.0, "4h": 14_400.0, "24h": 86_400.0, "7d": 604_800.0}


async def _alerts(
    request: web.Request, *, status: int = 200, error: str | None = None
) -> web.Response:
    store = hub_store(request)
    alerts = await store.run(store.sync.alerts.all, None, ALERTS_SHOWN)
    silences = await store.run(store.sync.alerts.silences)
    own = await asyncio.to_thread(request.app[SCHEDULED].report)
    return render(
        request, "alerts.html", status=status, error=error,
        firing=[a for a in alerts if a.state == "firing"],
        resolved=[a for a in alerts if a.state == "resolved"],
        silences=silences, durations=list(DURATIONS),
        own_backup=own, own_backup_cells=backup_cells(own, time.time()),
    )  # fmt: skip


@page
async def alerts_page(request: web.Request) -> web.StreamResponse:
    return await _alerts(request)


@page
async def silence_create(request: web.Request) -> web.StreamResponse:
    """A silence from the form: a rule, and optionally one label's value (node=n1)."""
    form = request[FORM]
    matchers = {"rule": form.get("rule", "").strip()} if form.get("rule", "").strip() else {}
    label, _, value = form.get("label", "").strip().partition("=")
    if label:
        matchers[label.strip()] = value.strip()
    try:
        req = SilenceRequest(
            matchers=matchers,
            duration_s=DURATIONS.get(form.get("duration", ""), 0),
            comment=form.get("comment", "").strip(),
        )
    except ValidationError:
        return await _alerts(
            request, status=400, error="Name a rule or a label=value, and pick a duration."
        )
    store = hub_store(request)
    await store.run(
        store.sync.alerts.create_silence,
        req.matchers,
        time.time() + req.duration_s,
        request[SESSION].user,
        req.comment,
    )
    return see_other("/console/alerts", "silenced")


@page
async def silence_delete(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    await store.run(store.sync.alerts.delete_silence, request.match_info["id"])
    return see_other("/console/alerts", "silence-ended")


def alert_routes() -> list[web.RouteDef]:
    return [
        web.get("/console/alerts", alerts_page),
        web.post("/console/silences", silence_create),
        web.post("/console/silences/{id}/end", silence_delete),
    ]
