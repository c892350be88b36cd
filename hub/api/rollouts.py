"""The operator API of image releases, sites' update windows and staged rollouts
(`/v1/admin/releases`, `/v1/admin/update-windows/…`, `/v1/admin/rollouts`): thin handlers
over hub/releases.py, hub/rollouts.py and the store. What the store finds missing is a 404
(hub/api/operator.py's middleware); a conflict is 409 `rollout_conflict`."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from aiohttp import web

from hub.api.requests import ReleaseQuery, RolloutRequest, WindowRequest
from hub.appkeys import OPERATOR, SETTINGS, STORE
from hub.http import parse, query
from hub.planning.rollout import STEPS
from hub.releases import BundleTooLargeError, keep_stream
from hub.rollouts import begin, rollout_view, take_step
from hub.state.rollouts import RolloutConflictError
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from hub.state.rollouts import Release


def release_view(release: Release, nodes: int) -> dict[str, Any]:
    return {**asdict(release), "nodes": nodes}


async def _conflicts(call: Callable[[], Awaitable[web.Response]]) -> web.Response:
    try:
        return await call()
    except RolloutConflictError as err:
        raise ApiError(ErrorCode.rollout_conflict, str(err)) from err


async def list_releases(request: web.Request) -> web.Response:
    store = request.app[STORE]
    releases = await store.run(store.sync.releases)
    given = await store.run(store.sync.node_release_versions)
    data = [release_view(r, sum(1 for v in given.values() if v == r.version)) for r in releases]
    return web.json_response({"data": data})


async def add_release(request: web.Request) -> web.Response:
    """The body is the bundle; `?version=` names the image version it installs."""
    q = query(request, ReleaseQuery)
    store = request.app[STORE]
    if any(r.version == q.version for r in await store.run(store.sync.releases)):
        # Refused before the body is read: an image is gigabytes.
        raise ApiError(ErrorCode.rollout_conflict, f"release {q.version} exists already")
    try:
        sha256, size = await keep_stream(
            request.app[SETTINGS].artifacts_dir, request.content.iter_chunked(1 << 20)
        )
    except BundleTooLargeError as err:
        raise ApiError(ErrorCode.request_too_large, str(err)) from err

    async def add() -> web.Response:
        release = await store.run(store.sync.add_release, q.version, q.notes, sha256, size)
        return web.json_response(release_view(release, 0), status=201)

    return await _conflicts(add)


async def show_release(request: web.Request) -> web.Response:
    store = request.app[STORE]
    release = await store.run(store.sync.release, request.match_info["version"])
    given = await store.run(store.sync.release_nodes, release.version)
    return web.json_response(release_view(release, len(given)))


async def set_window(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, WindowRequest)
    site = request.match_info["site"]
    await store.run(store.sync.set_update_window, site, req.window())
    return web.json_response({"site": site, "start": req.start, "end": req.end})


async def delete_window(request: web.Request) -> web.Response:
    store = request.app[STORE]
    site = request.match_info["site"]
    await store.run(store.sync.set_update_window, site, None)
    return web.json_response({"site": site, "start": None, "end": None})


async def list_rollouts(request: web.Request) -> web.Response:
    store = request.app[STORE]
    rollouts = await store.run(store.sync.rollouts)
    nodes = {n.id: n for n in await store.nodes()}
    settings, now = request.app[SETTINGS], time.time()
    return web.json_response({"data": [rollout_view(r, nodes, settings, now) for r in rollouts]})


async def start_rollout(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, RolloutRequest)

    async def start() -> web.Response:
        rollout = await store.run(
            begin, store.sync, req.kind, req.target(), req.strategy.strategy(), request[OPERATOR]
        )
        return await _view(request, rollout.id, status=201)

    return await _conflicts(start)


async def show_rollout(request: web.Request) -> web.Response:
    return await _view(request, request.match_info["id"])


async def _view(request: web.Request, rollout_id: str, status: int = 200) -> web.Response:
    store = request.app[STORE]
    rollout = await store.run(store.sync.rollout, rollout_id)
    nodes = {n.id: n for n in await store.nodes()}
    view = rollout_view(rollout, nodes, request.app[SETTINGS], time.time())
    return web.json_response(view, status=status)


def _stepper(action: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of one of the operator's steps (`pause`, `resume`, `abort`, `finish`):
    abort gives the nodes the rollout reached what they had before; finish ends its
    rollback, recording the nodes that never confirmed."""

    async def rollout_step(request: web.Request) -> web.Response:
        store = request.app[STORE]
        rollout_id = request.match_info["id"]
        settings, by = request.app[SETTINGS], request[OPERATOR]

        async def move() -> web.Response:
            await store.run(
                take_step, store.sync, settings, rollout_id, action, by=by, now=time.time()
            )
            return await _view(request, rollout_id)

        return await _conflicts(move)

    return rollout_step


def rollout_routes() -> list[web.RouteDef]:
    return [
        web.get("/v1/admin/releases", list_releases),
        web.post("/v1/admin/releases", add_release),
        web.get("/v1/admin/releases/{version}", show_release),
        web.put("/v1/admin/update-windows/{site}", set_window),
        web.delete("/v1/admin/update-windows/{site}", delete_window),
        web.get("/v1/admin/rollouts", list_rollouts),
        web.post("/v1/admin/rollouts", start_rollout),
        web.get("/v1/admin/rollouts/{id}", show_rollout),
        *(web.post(f"/v1/admin/rollouts/{{id}}/{action}", _stepper(action)) for action in STEPS),
    ]
