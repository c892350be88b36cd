"""The fleet link's heartbeat and sync both start by enrolling: run together, the node
enrolls once (one use of a two-use token, one node at the hub)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from appliance.fleet.identity import FleetFiles
from appliance.fleet.link import FleetLink
from appliance.observability.metrics import Metrics
from appliance.state.store import AsyncStore
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.state.store import open_store
from tests.conftest import NoModels, make_settings
from tests.fleet import provisioning
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer


async def test_concurrent_starts_enroll_once(aiohttp_server: AiohttpServer, tmp_path: Path) -> None:
    hub = settings_for(tmp_path)
    server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert server.port is not None
    path = provisioning(tmp_path, hub, server.port, uses=2)
    settings = make_settings(
        tmp_path / "data",
        embeddings={"enabled": False},
        fleet={"provisioning_file": str(path), "tunnel": False},
    )
    store = AsyncStore(settings.db_path)
    await store.open()
    link = FleetLink(settings.fleet, FleetFiles(settings.fleet_dir), store, Metrics(), NoModels())  # type: ignore[arg-type]
    try:
        clients = await asyncio.gather(*(link._ensure() for _ in range(4)))
        assert all(c is clients[0] for c in clients)
        assert clients[0] is not None
    finally:
        await link.close()
        await store.close()
    hub_store = open_store(hub)
    try:
        assert len(hub_store.nodes.all()) == 1
        assert [t.uses_left for t in hub_store.tokens.all()] == [1]
    finally:
        hub_store.close()
