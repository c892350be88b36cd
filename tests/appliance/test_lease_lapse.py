"""Lease trouble, from a node's book to the hub's alert: a real fleet link and its real
lease book (no model: the book is asked as admission control asks it) against a real
hub on loopback. The hub stops, so the lease the node used up cannot be renewed: the
node's heartbeat capacity names the account served without a live lease and the lease
calls failed in a row. The hub comes back: the first heartbeat carries that, and the
hub fires `lease_lapsed`; the next lease call goes through, and the next heartbeat
resolves it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from appliance.fleet.identity import FleetFiles
from appliance.fleet.link import FleetLink
from appliance.observability.metrics import Metrics
from appliance.quotas.leases import LeaseBook
from appliance.state.store import AsyncStore
from hub.alerting import rules
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.planning.quota import Budget
from hub.settings import HubSettings
from hub.state.store import open_store
from shared.errors import RateLimited
from tests.conftest import NoModels, make_settings
from tests.fleet import provisioning
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from hub.state.alerts import AlertRecord


async def test_a_node_reports_the_accounts_it_serves_without_a_lease_and_the_hub_alerts(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    # The alert loop quick, and no grace: the test drives each heartbeat itself.
    hub = settings_for(tmp_path, alerts={"every_s": 0.2, "lease_grace_s": 0})
    store = open_store(hub)
    store.accounts.put("acme", "S1", budget=Budget(100_000, 86_400))
    store.close()
    server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    port = server.port
    assert port is not None
    settings = make_settings(
        tmp_path / "data",
        fleet={
            "provisioning_file": str(provisioning(tmp_path, hub, port)),
            "tunnel": False,
            "heartbeat_s": 3600,  # no schedule runs: the test calls each round
            "sync_interval_s": 3600,
        },
    )
    node = AsyncStore(settings.db_path)
    await node.open()
    book = LeaseBook(lambda klass: 0)  # no safe capacity: refused without a lease
    link = FleetLink(
        settings.fleet, FleetFiles(settings.fleet_dir), node, Metrics(), NoModels(),  # type: ignore[arg-type]
        leases=book,
    )  # fmt: skip
    try:
        await link.tick()  # enrolled, heard
        assert link.connected
        # A request of acme asks for a lease (the link calls the hub at once).
        with pytest.raises(RateLimited, match="waiting for a quota lease"):
            book.take("acme", "S1", "r0", 1, time.time())
        lease = await until(lambda: book.current.get("acme"), "acme's lease granted")
        capacity = await link.capacity()
        assert (capacity.leases_lapsed, capacity.lease_failures) == (0, 0)

        await server.close()  # the hub is gone
        # A request spends the whole lease; its renewal, asked at once, fails.
        assert book.take("acme", "S1", "r1", lease.granted, time.time()) == lease.id
        book.settle(lease.id, "r1", lease.granted)
        await until(lambda: book.failures == 1, "the lease call failed")
        capacity = await link.capacity()
        assert (capacity.leases_lapsed, capacity.lease_failures) == (1, 1)
        with pytest.raises(RateLimited, match="no safe capacity"):
            book.take("acme", "S1", "r2", 1, time.time())
        await link.tick()  # the heartbeat fails too; only lease calls count
        assert link.error is not None
        await link.renew_leases()
        capacity = await link.capacity()
        assert (capacity.leases_lapsed, capacity.lease_failures) == (1, 2)

        # The hub is back (its port, its data): the first heartbeat says what lapsed, and
        # the hub's alert fires.
        server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub), port=port)
        await link.tick()
        assert link.connected
        firing = await until(lambda: _alerts(hub, "firing"), "lease_lapsed fired")
        assert [(a.labels["node"], a.value) for a in firing] == [("lab-server", 1.0)]
        assert "2 lease calls failed in a row" in firing[0].summary
        # The next lease call goes through (a restarted hub may be learning: it answers
        # all the same), and the next heartbeat says nothing lapsed: resolved.
        await link.renew_leases()
        assert (book.failures, book.lapsed(time.time())) == (0, [])
        await link.tick()
        await until(lambda: _alerts(hub, "resolved"), "lease_lapsed resolved")
        assert _alerts(hub, "firing") == []
    finally:
        await link.close()
        await node.close()


def _alerts(hub: HubSettings, state: str) -> list[AlertRecord]:
    store = open_store(hub)
    try:
        return [a for a in store.alerts.all(state) if a.rule == rules.LEASE_LAPSED]
    finally:
        store.close()
