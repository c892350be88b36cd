"""Packages across the fleet, end to end: a real hub and two real appliances on loopback.
A package made on node A reaches the hub with its lineage through A's outbox; its archive,
exported by A and kept by the hub (`kvl hub packages add --seed`), is seeded to node B,
which fetches it, checks it, pins it and serves the very same files on its LAN; unseeded,
B unpins it. The nodes serve a scripted model that answers each item's request with a
valid item (test_packages.package_model): the fleet is the subject, not the model."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import aiohttp

from appliance.gateway.packages import PACKAGES
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.state.store import open_store
from tests.appliance.fleet_nodes import join, placement_hub
from tests.conftest import kvl
from tests.packages import package_model
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings

ASK = {"topic": "volcanoes", "level": "beginner", "wait": True,
       "spec": {"items": 2, "item_types": ["true_false"], "narration": False}}  # fmt: skip


def _nodes_holding(hub: HubSettings, package_id: str) -> list[str]:
    store = open_store(hub)
    try:
        names = {n.id: n.name for n in store.nodes.all()}
        found = [p for p in store.packages.find(package_id) if p.id == package_id]
        return sorted(names[n] for n in found[0].nodes) if found else []
    finally:
        store.close()


async def test_a_package_made_on_one_node_is_reported_and_seeded_to_another(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    served = package_model(tmp_path)
    hub = placement_hub(tmp_path)
    data = str(hub.data_dir)
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    # A scripted model's token is a byte: an item's prompt is some 1,450 of them.
    model = {"n_ctx": 2048, "n_slots": 1}
    a = await join(aiohttp_server, tmp_path, served, hub, hub_server.port, name="node-a",
                   model=model)  # fmt: skip
    auth = {"Authorization": f"Bearer {a.key}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{a.base_url}/v1/packages", json=ASK, headers=auth) as response:
            made = await response.json()
            assert response.status == 200, made
        package_id, version = made["id"], made["version"]

        async def reported() -> bool:
            return _nodes_holding(hub, package_id) == ["node-a"]

        await until(reported, "node A's package at the hub", timeout_s=60)
        store = open_store(hub)
        [record] = store.packages.find(package_id)
        store.close()
        assert record.lineage["model"]["sha256"] == served.sha256
        assert record.lineage["appliance_id"] == made["manifest"]["lineage"]["appliance_id"]
        assert record.bundle_sha256 is None  # reported, not held

        async with session.get(f"{a.base_url}/v1/packages/{package_id}/exports/oci",
                               headers=auth) as response:  # fmt: skip
            assert response.status == 200
            archive = await response.read()
        (tmp_path / "package.oci.tar").write_bytes(archive)
        kvl("hub", "packages", "add", str(tmp_path / "package.oci.tar"), "--seed",
            "--data-dir", data)  # fmt: skip

        b = await join(aiohttp_server, tmp_path, served, hub, hub_server.port,
                       name="node-b", model=model)  # fmt: skip
        cache_b = b.app[PACKAGES].cache

        async def seeded() -> bool:
            held = [p for p in cache_b.list() if p.id == package_id]
            return bool(held) and held[0].pinned

        await until(seeded, "the package seeded to node B", timeout_s=60)
        for entry in made["manifest"]["files"]:
            url = f"{b.base_url}/v1/packages/{package_id}/files/{entry['path']}"
            async with session.get(url, headers={"Authorization": f"Bearer {b.key}"}) as got:
                body = await got.read()
                assert got.status == 200
                assert hashlib.sha256(body).hexdigest() == entry["sha256"]

        async def both() -> bool:
            return _nodes_holding(hub, package_id) == ["node-a", "node-b"]

        await until(both, "node B's copy reported to the hub", timeout_s=60)

        kvl("hub", "packages", "unseed", package_id, "--data-dir", data)

        async def unpinned() -> bool:
            return not cache_b.get(package_id, version).pinned

        await until(unpinned, "node B unpinning it", timeout_s=60)
