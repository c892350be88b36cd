"""The placement reconciler's view of the fleet (hub/reconciler.py): read from the real
store every round, each node built again only when its row changed, on either store."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hub.reconciler import FleetSnapshots
from hub.state.nodes import Heartbeat
from hub.state.store import open_store
from shared import protocol
from tests.hubs import PREFIX, new_key, settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from tests.hub.conftest import HubDatabase


def test_fleet_snapshots_rebuild_only_the_nodes_that_changed(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    store = open_store(settings_for(tmp_path, hub_database))
    try:
        token = store.tokens.create("lab", uses=3, expires_in_s=60).plaintext
        ids = [
            store.nodes.enroll(
                token, name=f"n{i}", wg_public_key=new_key(), overlay_prefix=PREFIX,
                labels={"region": "eu"}, versions={},
            ).node.id
            for i in range(3)
        ]  # fmt: skip
        now = time.time()
        store.heartbeats(
            [
                Heartbeat(i, now, {}, protocol.Capacity(memory_total_mib=8000)) for i in ids
            ]  # 6000 for models
        )
        fleet = FleetSnapshots()
        first = {n.id: n for n in fleet.read(store)}
        assert {n.memory_mib for n in first.values()} == {6000}
        assert {n.region for n in first.values()} == {"eu"}

        # Nothing changed: the very same snapshots, none built again.
        again = {n.id: n for n in fleet.read(store)}
        assert all(again[i] is first[i] for i in ids)

        # A heartbeat with new capacity, a drain, a revocation: those three rebuilt.
        store.heartbeats(
            [Heartbeat(ids[0], now + 15, {}, protocol.Capacity(model_memory_mib=12_000))]
        )
        store.nodes.set_draining(ids[1], draining=True)
        store.nodes.revoke(ids[2])
        changed = {n.id: n for n in fleet.read(store)}
        assert changed[ids[0]] is not first[ids[0]]
        assert (changed[ids[0]].memory_mib, changed[ids[0]].last_seen) == (12_000, now + 15)
        assert changed[ids[1]].draining
        assert changed[ids[2]].revoked
        # And what it keeps is what a fresh read builds.
        assert sorted(FleetSnapshots().read(store), key=lambda n: n.id) == sorted(
            changed.values(), key=lambda n: n.id
        )
    finally:
        store.close()
