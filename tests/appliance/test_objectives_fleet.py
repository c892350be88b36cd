"""End to end: a real hub and a real appliance (its model, its fleet link) on loopback. A
few requests, a hub outage, an appliance restart, more requests: the hub's roll-up
(`slo_totals`) is what the clients saw, each request once."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from appliance.app import FLEET, create_app
from appliance.gateway.appkeys import REGISTRY, STORE
from appliance.state.store import Store
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.state.store import open_store
from shared.classes import ServiceClass
from tests.conftest import SCRIPTED, free_port, make_settings
from tests.fleet import provisioning
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp import web
    from pytest_aiohttp import AiohttpClient, AiohttpServer

    from appliance.state.records import ModelRecord
    from hub.planning.slo import SloTotals
    from hub.settings import HubSettings
    from tests.conftest import Client

BODY = {"model": SCRIPTED, "prompt": "Hi", "max_tokens": 2}


def totals(hub: HubSettings) -> dict[str, SloTotals]:
    store = open_store(hub)
    try:
        now = time.time()
        return {t.group: t for t in store.objectives.totals(now - 3600, now + 3600, "account")}
    finally:
        store.close()


async def test_the_hubs_roll_up_is_what_the_clients_saw_across_an_outage_and_a_restart(
    aiohttp_client: AiohttpClient,
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    scripted_model: ModelRecord,
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    hub_server = await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)
    store = open_store(hub)
    try:
        store.accounts.put("limited", "S3")
    finally:
        store.close()
    settings = make_settings(
        tmp_path / "data",
        embeddings={"enabled": False},
        fleet={
            "provisioning_file": str(path),
            "tunnel": False,
            "heartbeat_s": 1,
            "sync_interval_s": 0.5,
        },
        classes={"s3": {"requests_per_minute": 1}},
    )
    local = Store(settings.db_path)
    try:
        local.add_model(scripted_model)
        keys = {
            "lan-user": local.create_key("lan-user").plaintext,
            "limited": local.create_key("limited", ServiceClass.S3).plaintext,
        }
    finally:
        local.close()

    async def start() -> tuple[web.Application, Client]:
        app = create_app(settings)
        client = await aiohttp_client(app)
        await app[REGISTRY].wait_loaded()
        return app, client

    # What the clients saw, per account: each status.
    seen: dict[str, Counter[int]] = {name: Counter() for name in keys}

    async def send(client: Client, account: str, n: int) -> None:
        for _ in range(n):
            response = await client.post(
                "/v1/completions",
                headers={"Authorization": f"Bearer {keys[account]}"},
                json=BODY,
            )
            await response.read()
            seen[account][response.status] += 1

    app, client = await start()
    await until(lambda: app[FLEET].connected, "enrolled", timeout_s=30)
    await send(client, "lan-user", 3)
    await send(client, "limited", 2)  # one a minute: the second is refused
    assert seen["limited"] == Counter({200: 1, 429: 1})
    await until(
        lambda: totals(hub).get("lan-user") is not None and totals(hub)["lan-user"].requests == 3,
        "the first heartbeats counted",
        timeout_s=30,
    )

    # The hub goes away; the node serves on, then restarts while the hub is still away.
    await hub_server.close()
    await send(client, "lan-user", 2)
    link = app[FLEET]
    await until(lambda: link.error is not None, "a heartbeat failed", timeout_s=30)
    await client.close()
    app, client = await start()
    await send(client, "lan-user", 2)
    await send(client, "limited", 2)
    await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))

    def rolled_up() -> bool:
        got = totals(hub)
        return all(name in got and got[name].requests == sum(seen[name].values()) for name in seen)

    await until(rolled_up, "every request at the hub", timeout_s=60)
    # A few more heartbeats, each carrying the same cumulative counts: nothing more counted.
    node = app[STORE]
    for _ in range(3):
        before = await node.run(node.sync.meta, "last_heartbeat_at")

        async def later(before: str | None = before) -> bool:
            now = await node.run(node.sync.meta, "last_heartbeat_at")
            return now is not None and now != before

        await until(later, "another heartbeat went through", timeout_s=30)
    got = totals(hub)
    for name, statuses in seen.items():
        t = got[name]
        assert t.requests == sum(statuses.values()), name
        assert t.admitted == statuses[200], name
        refused = {reason: n for reason, n in t.refused.items() if n}
        assert refused == ({"quota": statuses[429]} if statuses[429] else {}), name
        # Served whole: each met or missed its objectives; a quota refusal counts for none.
        assert t.met.get("complete", 0) + t.missed.get("complete", 0) == statuses[200], name
    assert seen["lan-user"] == Counter({200: 7})
