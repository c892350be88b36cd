"""The operator API of image releases, sites' update windows and staged rollouts
(`/v1/admin/releases`, `/v1/admin/update-windows/…`, `/v1/admin/rollouts`): thin handlers
over hub/releases.py, hub/rollouts.py and the store. What the store finds missing is a 404
(hub/api/operator.py's middleware); a conflict is 409 `rollout_conflict`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from hub.api.requests import BandwidthRequest, ReleaseQuery, RolloutRequest, WindowRequest
from hub.api.route_kinds import Auth, Param, Route
from hub.appkeys import OPERATOR, SETTINGS, STORE
from hub.http import parse, query
from hub.planning.rollout import STEPS
from hub.releases import BundleTooLargeError, keep_stream
from hub.rollouts import begin, release_view, rollout_view, take_step
from hub.state.rollouts import RolloutConflictError
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


async def _conflicts(call: Callable[[], Awaitable[web.Response]]) -> web.Response:
    try:
        return await call()
    except RolloutConflictError as err:
        raise ApiError(ErrorCode.rollout_conflict, str(err)) from err


async def list_releases(request: web.Request) -> web.Response:
    store = request.app[STORE]
    releases = await store.run(store.sync.rollouts.releases)
    given = await store.run(store.sync.rollouts.node_release_versions)
    data = [release_view(r, sum(1 for v in given.values() if v == r.version)) for r in releases]
    return web.json_response({"data": data})


async def add_release(request: web.Request) -> web.Response:
    """The body is the bundle; `?version=` names the image version it installs."""
    q = query(request, ReleaseQuery)
    store = request.app[STORE]
    if any(r.version == q.version for r in await store.run(store.sync.rollouts.releases)):
        # Refused before the body is read: an image is gigabytes.
        raise ApiError(ErrorCode.rollout_conflict, f"release {q.version} exists already")
    try:
        sha256, size = await keep_stream(
            request.app[SETTINGS].artifacts_dir, request.content.iter_chunked(1 << 20)
        )
    except BundleTooLargeError as err:
        raise ApiError(ErrorCode.request_too_large, str(err)) from err

    async def add() -> web.Response:
        release = await store.run(store.sync.rollouts.add_release, q.version, q.notes, sha256, size)
        return web.json_response(release_view(release, 0), status=201)

    return await _conflicts(add)


async def show_release(request: web.Request) -> web.Response:
    store = request.app[STORE]
    release = await store.run(store.sync.rollouts.release, request.match_info["version"])
    given = await store.run(store.sync.rollouts.release_nodes, release.version)
    return web.json_response(release_view(release, len(given)))


async def set_window(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, WindowRequest)
    site = request.match_info["site"]
    await store.run(store.sync.rollouts.set_update_window, site, req.window())
    return web.json_response({"site": site, "start": req.start, "end": req.end})


async def delete_window(request: web.Request) -> web.Response:
    store = request.app[STORE]
    site = request.match_info["site"]
    await store.run(store.sync.rollouts.set_update_window, site, None)
    return web.json_response({"site": site, "start": None, "end": None})


async def set_bandwidth(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, BandwidthRequest)
    site = request.match_info["site"]
    await store.run(store.sync.rollouts.set_bandwidth, site, req.bytes_per_s)
    return web.json_response({"site": site, "bytes_per_s": req.bytes_per_s})


async def delete_bandwidth(request: web.Request) -> web.Response:
    store = request.app[STORE]
    site = request.match_info["site"]
    await store.run(store.sync.rollouts.set_bandwidth, site, None)
    return web.json_response({"site": site, "bytes_per_s": None})


async def list_rollouts(request: web.Request) -> web.Response:
    store = request.app[STORE]
    rollouts = await store.run(store.sync.rollouts.all)
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
    rollout = await store.run(store.sync.rollouts.get, rollout_id)
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


_NOT_FOUND = (ErrorCode.not_found,)
_CONFLICT = (ErrorCode.not_found, ErrorCode.rollout_conflict)
_VERSION = ReleaseQuery.model_json_schema()["properties"]["version"]
# Each of the operator's steps (hub/planning/rollout.py's STEPS: a new one needs its words).
_STEPS = {
    "pause": "Pause a rollout: no node more is reached until it is resumed.",
    "resume": "Resume a paused or halted rollout (a halt's failed nodes are judged again).",
    "abort": "Abort a rollout: the nodes it reached get what they had before.",
    "finish": "Finish a rolling-back rollout now: aborted, the nodes that have not reported "
    "what they had before recorded as never confirmed (they keep it as their target).",
}

ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/admin/releases",
        list_releases,
        "Image releases the hub holds: version, notes, sha256, size, and how many nodes "
        "have it as their target.",
        Auth.operator,
    ),
    Route(
        "POST",
        "/v1/admin/releases",
        add_release,
        "Keep an image release: the body is its bundle (a RAUC `.raucb`, opaque to the "
        "hub), kept under its sha256.",
        Auth.operator,
        status=201,
        body_type="application/octet-stream",
        errors=(ErrorCode.request_too_large, ErrorCode.rollout_conflict),
        params=(
            Param(
                "version",
                "query",
                "the image version the bundle installs",
                _VERSION,
                required=True,
            ),
            Param("notes", "query", "release notes", {"type": "string", "maxLength": 2000}),
        ),
    ),
    Route(
        "GET",
        "/v1/admin/releases/{version}",
        show_release,
        "One release.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "PUT",
        "/v1/admin/update-windows/{site}",
        set_window,
        "A site's update window (UTC): its nodes fetch and install a release only then.",
        Auth.operator,
        WindowRequest,
    ),
    Route(
        "DELETE",
        "/v1/admin/update-windows/{site}",
        delete_window,
        "A site's nodes may update at any time again.",
        Auth.operator,
    ),
    Route(
        "PUT",
        "/v1/admin/bandwidth/{site}",
        set_bandwidth,
        "A site's bandwidth for the files its nodes fetch from the hub (models, packages, "
        "releases), shared by the site's nodes.",
        Auth.operator,
        BandwidthRequest,
    ),
    Route(
        "DELETE",
        "/v1/admin/bandwidth/{site}",
        delete_bandwidth,
        "A site's nodes fetch as fast as they can again.",
        Auth.operator,
    ),
    Route(
        "GET",
        "/v1/admin/rollouts",
        list_rollouts,
        "Staged rollouts, newest first, each with its waves and their nodes' reports.",
        Auth.operator,
    ),
    Route(
        "POST",
        "/v1/admin/rollouts",
        start_rollout,
        "Start a staged rollout of a release to the fleet, or of a deployment's new model: "
        "a canary, then waves, each gated on its nodes' health for a soak time.",
        Auth.operator,
        RolloutRequest,
        status=201,
        errors=_CONFLICT,
    ),
    Route(
        "GET",
        "/v1/admin/rollouts/{id}",
        show_rollout,
        "One rollout: state, phase, reason, strategy, and each wave's nodes.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    *(
        Route(
            "POST",
            f"/v1/admin/rollouts/{{id}}/{action}",
            _stepper(action),
            _STEPS[action],
            Auth.operator,
            errors=_CONFLICT,
        )
        for action in STEPS
    ),
)
