"""The console's rollouts page (`/console/rollouts`): every staged rollout with each wave's
nodes, live (server-sent events from `/console/rollouts/stream`, the same views the
operator API answers), and the operator's pause, resume, abort and (of a rollback) finish,
through the call the API and `kvl hub rollouts` make (hub/rollouts.py's `take_step`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from hub.console.fleet import ago
from hub.console.sse import stream
from hub.console.web import (
    SESSION,
    hub_settings,
    hub_store,
    page,
    render,
    see_other,
)
from hub.planning.rollout import STEPS
from hub.rollouts import rollout_view, take_step
from hub.state.rollouts import RolloutConflictError

if TYPE_CHECKING:
    from hub.settings import HubSettings
    from hub.state.store import AsyncHubStore


async def rollouts_table(store: AsyncHubStore, settings: HubSettings) -> list[dict[str, Any]]:
    """Every rollout, newest first, as the page and its stream show it."""
    rollouts = await store.run(store.sync.rollouts.all)
    nodes = {n.id: n for n in await store.nodes()}
    now = time.time()
    views = [rollout_view(r, nodes, settings, now) for r in rollouts]
    for view in views:
        for wave in view["waves"]:
            for n in wave["nodes"]:
                image = n.get("image") or {}
                n["running"] = image.get("version") or (", ".join(n.get("models", [])) or "-")
                n["update"] = image.get("state") or (
                    "-" if not n.get("release_error") else "refused"
                )
                n["heard"] = ago(nodes[n["id"]].last_seen, now) if n["id"] in nodes else "gone"
    return views


async def _page(
    request: web.Request, *, status: int = 200, error: str | None = None
) -> web.Response:
    views = await rollouts_table(hub_store(request), hub_settings(request))
    # Each step with the states it is taken from: a rollout shows only the buttons it takes.
    steps = [(action, allowed) for action, (_, allowed, _) in STEPS.items()]
    return render(request, "rollouts.html", status=status, error=error, rollouts=views,
                  steps=steps)  # fmt: skip


@page
async def rollouts_page(request: web.Request) -> web.StreamResponse:
    return await _page(request)


@page
async def rollout_step(request: web.Request) -> web.StreamResponse:
    action = request.match_info["action"]
    if action not in STEPS:
        return await _page(request, status=404, error=f"No step {action!r}.")
    _, _, done = STEPS[action]
    store = hub_store(request)
    try:
        await store.run(
            take_step,
            store.sync,
            hub_settings(request),
            request.match_info["id"],
            action,
            by=request[SESSION].user,
            now=time.time(),
        )
    except RolloutConflictError as err:
        return await _page(request, status=409, error=str(err))
    return see_other("/console/rollouts", f"rollout-{done}")


async def rollouts_stream(request: web.Request) -> web.StreamResponse:
    """`GET /console/rollouts/stream`: `rollouts` events with every rollout's view whenever
    it changes, and `logout` when the login ended."""
    store, settings = hub_store(request), hub_settings(request)

    async def views() -> object:
        return {"rollouts": await rollouts_table(store, settings)}

    return await stream(request, "rollouts", views)


def rollout_routes() -> list[web.RouteDef]:
    return [
        web.get("/console/rollouts", rollouts_page),
        web.get("/console/rollouts/stream", rollouts_stream),
        web.post("/console/rollouts/{id}/{action}", rollout_step),
    ]
