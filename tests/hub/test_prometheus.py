"""A real Prometheus (Debian's, installed by `just setup-system`) on loopback scrapes a real
hub's /metrics with an operator token and evaluates the hub's rules file, its windows
scaled down (an hour is a minute, five minutes five seconds; `kvl hub alerts rules
--scale`). A node breaks its S1 first-token objective through the real node API (its
heartbeats' objectives count misses: no model needed), and the burn-rate alert fires in
Prometheus and in the hub's own alert loop, whose webhook a receiver in the test verifies
with shared/webhooks.py; then the node meets its objective again, and both resolve, the
hub's resolution delivered too.

The same with a real appliance, its model and its fleet link, instead of heartbeats made
by the test: tests/appliance/test_prometheus_fleet.py."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from hub.alerting.prometheus import rules_yaml, scaled
from hub.app import create_app
from hub.state.store import open_store
from shared import protocol
from tests.alerts import SECRET, Receiver
from tests.hub.nodes import enroll_node
from tests.hub.objective_series import objectives, series
from tests.hubs import settings_for
from tests.prometheus import SCALE, WINDOW, prometheus
from tests.waiting import until

T = TypeVar("T")

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

DEADLINE_S = 90.0


async def test_prometheus_and_the_hub_fire_and_resolve_a_burn_rate_alert(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    receiver = Receiver()
    hook = await aiohttp_server(receiver.app)
    settings = scaled(
        settings_for(
            tmp_path,
            alerts={
                "every_s": 0.5,
                "webhooks": [{"url": f"http://127.0.0.1:{hook.port}/hook", "secret": SECRET}],
                "backoff_initial_s": 0.1,
                "backoff_max_s": 0.5,
            },
        ),
        SCALE,
    )
    assert settings.alerts.burn[0].long_s == 60
    store = open_store(settings)
    store.accounts.put("acme", "S1")
    _, node_token = enroll_node(store, "n1")
    operator = store.operators.create("prometheus").plaintext
    store.close()
    hub = await aiohttp_server(create_app(settings))
    assert hub.port is not None
    hub_url = f"http://127.0.0.1:{hub.port}"
    node = {"Authorization": f"Bearer {node_token}", **protocol.HEADERS}
    ops = {"Authorization": f"Bearer {operator}"}
    counts = {"requests": 0, "met": 0, "missed": 0}
    step = {"met": 0, "missed": 2}  # a breach: every first token late

    async def beat(session: aiohttp.ClientSession) -> None:
        """One heartbeat of the node, its cumulative counters grown by `step`."""
        for outcome in ("met", "missed"):
            counts[outcome] += step[outcome]
            counts["requests"] += step[outcome]
        body = {
            "objectives": objectives(
                "epoch-1",
                series(requests=counts["requests"], met=counts["met"], missed=counts["missed"]),
            )
        }
        async with session.post(f"{hub_url}/v1/node/heartbeat", json=body, headers=node) as r:
            assert r.status == 200, await r.text()

    def burning(alert: dict[str, Any]) -> bool:
        labels = alert["labels"]
        return bool(
            labels.get("alertname") == "KvlSloBurnRate"
            and labels.get("class") == "S1"
            and labels.get("objective") == "first_token"
            and labels.get("window") == WINDOW
        )

    rules = rules_yaml(settings)
    assert f"window: {WINDOW}" in rules
    with prometheus(tmp_path, hub.port, operator, rules) as prom:
        async with aiohttp.ClientSession() as session:

            async def prom_alerts() -> list[dict[str, Any]]:
                try:
                    async with session.get(f"{prom}/api/v1/alerts") as r:
                        if r.status != 200:
                            return []
                        return [a for a in (await r.json())["data"]["alerts"] if burning(a)]
                except aiohttp.ClientConnectionError:
                    return []  # not listening yet

            async def hub_alerts(state: str) -> list[dict[str, Any]]:
                async with session.get(
                    f"{hub_url}/v1/admin/alerts?state={state}", headers=ops
                ) as r:
                    data = (await r.json())["data"]
                return [a for a in data if a["rule"] == "slo_burn" and a["labels"] == {
                    "class": "S1", "objective": "first_token", "window": WINDOW}]  # fmt: skip

            async def target_up() -> bool:
                try:
                    async with session.get(f"{prom}/api/v1/targets") as r:
                        if r.status != 200:  # 503 while it starts
                            return False
                        targets = (await r.json())["data"]["activeTargets"]
                except (aiohttp.ClientConnectionError, json.JSONDecodeError, KeyError):
                    return False
                return any(t["health"] == "up" for t in targets)

            await until(target_up, "Prometheus scraping the hub with the operator token", 60)

            def beating(check: Callable[[], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
                """`check`, after a heartbeat: the node keeps reporting while the test
                waits, one heartbeat per look (every 0.5 s, as `until` polls)."""

                async def beat_then_check() -> T:
                    await beat(session)
                    return await check()

                return beat_then_check

            firing = await until(
                beating(lambda: _firing(prom_alerts())),
                "the burn-rate alert firing in Prometheus", DEADLINE_S, every_s=0.5,
            )  # fmt: skip
            assert firing[0]["labels"]["severity"] == "page"
            (recorded,) = await until(
                beating(lambda: hub_alerts("firing")), "the hub's own loop recording it",
                DEADLINE_S, every_s=0.5,
            )  # fmt: skip
            assert recorded["severity"] == "page"
            await until(
                lambda: _delivered(receiver, "alert.firing"), "its signed webhook", DEADLINE_S
            )
            # The breach ends: the node meets its objective again, many times over (the
            # hub sums whole 5-minute buckets, so the misses must be outweighed).
            step.update(met=400, missed=0)
            await until(
                beating(lambda: _none(prom_alerts())), "the alert resolved in Prometheus",
                DEADLINE_S, every_s=0.5,
            )  # fmt: skip
            resolved = await until(
                beating(lambda: hub_alerts("resolved")), "the hub recording the resolution",
                DEADLINE_S, every_s=0.5,
            )  # fmt: skip
            assert resolved[0]["id"] == recorded["id"]
            assert resolved[0]["resolved_at"] is not None
            await until(
                lambda: _delivered(receiver, "alert.resolved"), "the resolved webhook", DEADLINE_S
            )
    await hub.close()


async def test_prometheus_fires_lease_lapsed_after_its_grace_for_a_node_heard_from(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    """`KvlLeaseLapsed` over the hub's per-node gauge: pending through its `for:` (the
    grace, 5 s scaled), firing while the node's heartbeats say it serves accounts without
    a live lease, and gone once the node is stale (its last word is old), as the hub's own
    rule."""
    settings = scaled(settings_for(tmp_path, fleet={"stale_after_s": 3}), SCALE)
    assert settings.alerts.lease_grace_s == 5
    store = open_store(settings)
    _, node_token = enroll_node(store, "n1")
    operator = store.operators.create("prometheus").plaintext
    store.close()
    hub = await aiohttp_server(create_app(settings))
    assert hub.port is not None
    hub_url = f"http://127.0.0.1:{hub.port}"
    node = {"Authorization": f"Bearer {node_token}", **protocol.HEADERS}
    lapsed = {"capacity": {"leases_lapsed": 2, "lease_failures": 3}}
    states: list[str] = []
    with prometheus(tmp_path, hub.port, operator, rules_yaml(settings)) as prom:
        async with aiohttp.ClientSession() as session:

            async def lease_alerts() -> list[dict[str, Any]]:
                try:
                    async with session.get(f"{prom}/api/v1/alerts") as r:
                        if r.status != 200:
                            return []
                        found = (await r.json())["data"]["alerts"]
                except aiohttp.ClientConnectionError:
                    return []  # not listening yet
                return [a for a in found if a["labels"].get("alertname") == "KvlLeaseLapsed"]

            async def beat_then_firing() -> list[dict[str, Any]] | None:
                async with session.post(
                    f"{hub_url}/v1/node/heartbeat", json=lapsed, headers=node
                ) as r:
                    assert r.status == 200, await r.text()
                found = await lease_alerts()
                states.extend(a["state"] for a in found)
                return [a for a in found if a["state"] == "firing"] or None

            (firing,) = await until(
                beat_then_firing, "KvlLeaseLapsed firing", DEADLINE_S, every_s=0.5
            )
            assert "pending" in states  # held through its grace first
            assert firing["labels"]["node"] == "n1"
            assert firing["labels"]["severity"] == "ticket"
            assert firing["labels"]["rule"] == "lease_lapsed"
            assert float(firing["value"]) == 2
            # The node falls silent, its gauge still 2: stale, the alert ends.
            await until(lambda: _none(lease_alerts()), "KvlLeaseLapsed gone", DEADLINE_S)
    await hub.close()


async def _firing(found: Any) -> list[dict[str, Any]] | None:
    alerts = [a for a in await found if a["state"] == "firing"]
    return alerts or None


async def _none(found: Any) -> bool:
    return not [a for a in await found if a["state"] == "firing"]


def _delivered(receiver: Receiver, event: str) -> bool:
    return any(
        r["event"] == event
        and r["alert"]["rule"] == "slo_burn"
        and r["alert"]["labels"].get("window") == WINDOW
        for r in receiver.received
    )
