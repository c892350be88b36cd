"""The live objectives in heartbeats to a real hub on loopback: while the hub is away the
counts are stored before each heartbeat that fails, and the first heartbeat that goes
through again carries everything, in the same epoch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.app import FLEET
from appliance.gateway.appkeys import STORE
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from tests.conftest import free_port
from tests.fleet import complete, fleet_appliance, provisioning
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient, AiohttpServer

    from appliance.fleet.client import HubClient
    from appliance.state.records import ModelRecord
    from shared import protocol


async def test_a_hub_outage_loses_nothing_the_next_heartbeat_carries_it_all(
    aiohttp_client: AiohttpClient,
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    scripted_model: ModelRecord,
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    hub_server = await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)
    app, client, key = await fleet_appliance(
        aiohttp_client, tmp_path, scripted_model, path, heartbeat_s=1, sync_interval_s=0.5
    )
    link = app[FLEET]
    hub_client: HubClient = await until(link.hub, "enrolled", timeout_s=30)
    # What the hub accepted (a heartbeat the real hub answered; one it refused, or that
    # did not reach it, raises and is not kept here).
    heard: list[protocol.Objectives] = []
    failed: list[Exception] = []
    send = hub_client.heartbeat

    async def heartbeat(
        versions: dict[str, str],
        capacity: protocol.Capacity,
        objectives: protocol.Objectives | None = None,
    ) -> protocol.HeartbeatAnswer:
        try:
            answer = await send(versions, capacity, objectives)
        except Exception as err:
            failed.append(err)
            raise
        assert objectives is not None
        heard.append(objectives)
        return answer

    hub_client.heartbeat = heartbeat  # type: ignore[method-assign]

    def requests() -> int:
        if not heard:
            return 0
        return sum(s.requests for s in heard[-1].series if s.account == "lan-user")

    for _ in range(3):
        await complete(client, key)
    await until(lambda: requests() == 3, "a heartbeat with the first three", timeout_s=30)
    epoch = heard[-1].epoch

    await hub_server.close()
    for _ in range(4):
        await complete(client, key)
    outage = len(failed)
    await until(lambda: len(failed) > outage, "a heartbeat failed", timeout_s=30)
    # Stored before the heartbeat that failed: a restart now would resume from seven.
    store = app[STORE]
    stored = await store.run(store.sync.load_objectives)
    assert sum(s["requests"] for s in stored if s["account"] == "lan-user") == 7
    assert requests() == 3

    await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    await until(lambda: requests() == 7, "a heartbeat with all seven", timeout_s=30)
    last = heard[-1]
    assert last.epoch == epoch
    (series,) = [s for s in last.series if s.account == "lan-user"]
    assert (series.service_class, series.admitted, series.refused) == ("S1", 7, {})
    assert series.met["complete"] == 7
    assert last.objectives_s["S1"]["first_token"] == 10.0
    # Cumulative and never lower, heartbeat after heartbeat.
    counts = [sum(s.requests for s in o.series) for o in heard]
    assert counts == sorted(counts)
