"""The console's rollouts page over real HTTPS on loopback: each rollout with each wave's
nodes, its live stream following what the nodes report, and the operator's steps (CSRF
checked; a step the rollout cannot take is a 409 page that changes nothing)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from hub.planning.rollout import Strategy
from hub.rollouts import begin
from hub.state.store import open_store
from tests.console import (
    add_user,
    console_settings,
    csrf_of,
    enroll,
    heartbeat,
    open_console,
    start,
    stream_event,
)
from tests.releases import speak_releases
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings
    from tests.hub.conftest import HubDatabase


async def test_the_rollouts_page_shows_each_wave_live_and_takes_the_operators_steps(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = console_settings(tmp_path, hub_database)
    # Nodes offline only past ten minutes: a rollback waits on them here (never by itself
    # over while the page is read).
    fleet = {"rollout_every_s": 0.05, "offline_after_s": 600.0}
    hub = hub.model_copy(update={"fleet": hub.fleet.model_copy(update=fleet)})
    add_user(hub)
    server = await start(aiohttp_server, hub)
    async with open_console(server, hub) as console:
        assert await console.login() == 303
        tokens = {name: await enroll(console, hub, name) for name in ("edge-a", "edge-b")}
        image = {"version": "1.0", "slot": "rootfs.0", "state": "good"}
        for token in tokens.values():
            await heartbeat(console, token, image=image)
        await until(lambda: speak_releases(hub), "both nodes heard")
        # What they run is what an abort gives back: stored before the rollout starts.
        await until(lambda: _images(hub) == {"edge-a": "1.0", "edge-b": "1.0"}, "1.0 stored")
        store = open_store(hub)
        store.rollouts.add_release("1.0", "", "0" * 64, 10)  # what the nodes had: an abort's target
        store.rollouts.add_release("1.1", "faster boot", "a" * 64, 10)
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
                    data: dict[str, Any] = await stream_event(stream, "rollouts")
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
        finish = f'action="/console/rollouts/{rollout.id}/finish"'
        assert finish not in page  # a rollout finishes only a rollback
        status, _, _ = await console.post(f"/console/rollouts/{rollout.id}/abort", {})
        assert status == 303
        # edge-a never says it runs 1.0 again: the rollback waits, and the page offers
        # Finish (and no step the rollback cannot take).
        status, page, _ = await console.get("/console/rollouts")
        assert "aborted by ops" in page
        assert 'data-state="rolling-back"' in page
        assert finish in page
        assert f'action="/console/rollouts/{rollout.id}/pause"' not in page
        status, _, response = await console.post(f"/console/rollouts/{rollout.id}/finish", {})
        assert (status, response.headers["Location"]) == (
            303, "/console/rollouts?notice=rollout-finished")  # fmt: skip
        status, page, _ = await console.get("/console/rollouts?notice=rollout-finished")
        assert "The rollback is finished" in page
        assert "aborted by ops; rollback finished by ops; never confirmed: edge-a" in page
        assert "never confirmed: the rollback was finished by ops" in page
        assert finish not in page
        status, page, _ = await console.post(f"/console/rollouts/{rollout.id}/finish", {})
        assert status == 409
        assert "only a rolling-back rollout can be finished" in page


def _images(hub: HubSettings) -> dict[str, str | None]:
    """The version each node's last heartbeat, as stored, said it runs."""
    store = open_store(hub)
    try:
        return {
            n.name: None if n.capacity.image is None else n.capacity.image.version
            for n in store.nodes.all()
        }
    finally:
        store.close()
