"""The console's rollouts page over real HTTPS on loopback: each rollout with each wave's
nodes, its live stream following what the nodes report, and the operator's steps (CSRF
checked; a step the rollout cannot take is a 409 page that changes nothing)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from hub.planning.rollout import Strategy
from hub.rollouts import begin
from hub.state.store import open_store
from tests.hub.test_console import (
    _event,
    add_user,
    csrf_of,
    enroll,
    heartbeat,
    open_console,
    settings_for,
    start,
)
from tests.hub.test_rollouts import speak_releases
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase


async def test_the_rollouts_page_shows_each_wave_live_and_takes_the_operators_steps(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = settings_for(tmp_path, hub_database)
    hub = hub.model_copy(update={"fleet": hub.fleet.model_copy(update={"rollout_every_s": 0.05})})
    add_user(hub)
    server = await start(aiohttp_server, hub)
    async with open_console(server, hub) as console:
        assert await console.login() == 303
        tokens = {name: await enroll(console, hub, name) for name in ("edge-a", "edge-b")}
        image = {"version": "1.0", "slot": "rootfs.0", "state": "good"}
        for token in tokens.values():
            await heartbeat(console, token, image=image)
        await until(lambda: speak_releases(hub), "both nodes heard")
        store = open_store(hub)
        store.add_release("1.1", "faster boot", "a" * 64, 10)
        rollout = begin(store, "release", {"release": "1.1"}, Strategy(soak_s=0.0,
                        max_burn_rate=None), "ops")  # fmt: skip
        store.close()

        status, page, _ = await console.get("/console/rollouts")
        assert status == 200
        assert f'data-rollout="{rollout.id}"' in page
        assert "edge-a" in page
        assert "edge-b" in page
        assert 'href="/console/rollouts" aria-current="page"' in page

        async with console.session.get(console.base + "/console/rollouts/stream") as stream:
            assert stream.headers["Content-Type"] == "text/event-stream"

            async def node_state(name: str, wanted: str) -> dict[str, Any]:
                while True:
                    data: dict[str, Any] = await _event(stream, "rollouts")
                    views: list[dict[str, Any]] = data["rollouts"]
                    view = views[0]
                    nodes = {n["name"]: n for w in view["waves"] for n in w["nodes"]}
                    if nodes[name]["state"] == wanted:
                        return view

            view = await asyncio.wait_for(node_state("edge-a", "targeted"), 20)
            assert view["phase"] == "canary"
            await heartbeat(console, tokens["edge-a"], image={**image, "version": "1.1"})
            view = await asyncio.wait_for(node_state("edge-a", "updated"), 20)
            assert view["phase"] == "wave 1"

        status, page, _ = await console.get("/console/rollouts")
        console.csrf = csrf_of(page)
        status, _, response = await console.post(f"/console/rollouts/{rollout.id}/pause", {})
        assert (status, response.headers["Location"]) == (
            303, "/console/rollouts?notice=rollout-paused")  # fmt: skip
        status, page, _ = await console.post(f"/console/rollouts/{rollout.id}/pause", {})
        assert status == 409
        assert "cannot be paused" in page
        # Without the form's CSRF token: refused, and the rollout stays paused.
        status, _, _ = await console.post(
            f"/console/rollouts/{rollout.id}/resume", {}, with_csrf=False
        )
        assert status == 403
        status, page, _ = await console.get("/console/rollouts")
        assert "paused at wave 1" in page
        status, _, _ = await console.post(f"/console/rollouts/{rollout.id}/abort", {})
        assert status == 303
        status, page, _ = await console.get("/console/rollouts")
        assert "aborted by ops" in page
