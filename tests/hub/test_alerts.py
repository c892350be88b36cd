"""The hub's alerts: the rules against hand-made fleets, the store recording each change
once (two replicas evaluating together too), silences, the operator API and the CLI, and
a real hub whose alert loop fires and resolves on what its nodes report through the node
API, delivering signed webhooks to a receiver on loopback, retried until it answers,
across a restart of the hub; what the operators see of a failed delivery."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from hub.alerting import rules
from hub.alerting.delivery import AlertSender
from hub.alerting.prometheus import rules_yaml, scaled
from hub.app import create_app
from hub.fleet.budgets import burn_rate
from hub.settings import HubSettings
from hub.state.alerts import Firing
from hub.state.certificates import IssuedCertificate
from hub.state.nodes import Heartbeat, Node
from hub.state.store import AsyncHubStore, open_store
from shared import protocol
from shared.errors import ErrorCode
from tests.alerts import SECRET, Receiver
from tests.conftest import REPO, kvl
from tests.hub.nodes import enroll_node
from tests.hubs import settings_for
from tests.prometheus import promtool
from tests.waiting import until

if TYPE_CHECKING:
    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase

RULES_FILE = REPO / "docs" / "prometheus" / "kvl-hub.rules.yml"


def _node(name: str, last_seen: float | None, **capacity: Any) -> Node:
    return Node(
        id=f"id-{name}", name=name, site="lab", wg_public_key="k", overlay_address="a",
        enrolled_at=0.0, last_seen=last_seen, revoked_at=None,
        capacity=protocol.Capacity(**capacity),
    )  # fmt: skip


def test_the_alert_loop_reads_every_nodes_health_in_chunks(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    """`node_health`, a chunk at a time, reads every node once with what its heartbeat
    said (the rules judge the same as on a whole `Node`), and a capacity stored by an
    older hub, free-form, as defaults."""
    store = open_store(settings_for(tmp_path, hub_database))
    try:
        ids = [enroll_node(store, f"n{i}")[0] for i in range(7)]
        now = time.time()
        lapsed = protocol.Capacity(outbox_alarm=True, outbox_lag=40, leases_lapsed=2,
                                   lease_failures=3)  # fmt: skip
        store.heartbeats(
            [Heartbeat(ids[0], now, {}, lapsed)]
            + [Heartbeat(i, now, {}, protocol.Capacity()) for i in ids[1:]]
        )
        store.db.execute(
            "UPDATE nodes SET capacity = ? WHERE id = ?",
            ['{"outbox_alarm": "yes", "outbox_lag": -4, "free": {"form": 1}}', ids[1]],
        )
        read: list[Any] = []
        while len(chunk := store.nodes.health(read[-1].id if read else "", limit=3)) == 3:
            read += chunk
        read += chunk
        assert sorted(h.id for h in read) == sorted(ids)
        health = {h.id: h for h in read}
        assert health[ids[0]].capacity.leases_lapsed == 2
        assert (health[ids[0]].capacity.outbox_alarm, health[ids[0]].capacity.outbox_lag) == (
            True, 40,
        )  # fmt: skip
        assert health[ids[1]].capacity == health[ids[2]].capacity  # defaults
        whole = {n.id: n for n in store.nodes.all()}
        settings = HubSettings()
        assert _fired(rules.node_alerts(now, read, {}, None, settings)) == _fired(
            rules.node_alerts(now, [whole[i] for i in ids[::-1] if i != ids[1]], {}, None,
                              settings)
        ) | _fired(rules.node_alerts(now, [health[ids[1]]], {}, None, settings))  # fmt: skip
    finally:
        store.close()


def _certificate(node: str, ca: str, issued_at: float, not_after: float) -> IssuedCertificate:
    return IssuedCertificate("s", f"id-{node}", ca, [], issued_at, not_after)


def _fired(found: list[Firing]) -> set[tuple[str, str]]:
    return {(f.rule, f.labels["node"]) for f in found}


def test_node_rules() -> None:
    settings = HubSettings()  # stale after 45 s, offline after 120 s, certificates 1 d
    now = 1_000_000.0
    nodes = [
        _node("fine", now - 1),
        _node("stale", now - 45),  # at the window's end exactly: stale, as node_status says
        _node("offline", now - 500),
        _node("never", None),  # never heard from: no heartbeat to miss yet
        _node("alarmed", now - 1, outbox_alarm=True, outbox_lag=9),
        _node("expiring", now - 1),
        _node("unrenewed", now - 1),
    ]
    certificates = {
        "id-fine": _certificate("fine", "new", now - 10, now + 5 * 86_400),
        "id-expiring": _certificate("expiring", "new", now - 10, now + 3600),
        "id-unrenewed": _certificate("unrenewed", "old", now - 10, now + 5 * 86_400),
        "id-offline": _certificate("offline", "old", now - 10, now + 5 * 86_400),  # not heard
    }
    found = rules.node_alerts(now, nodes, certificates, "new", settings)
    assert _fired(found) == {
        (rules.NODE_STALE, "stale"),
        (rules.NODE_OFFLINE, "offline"),
        (rules.OUTBOX_ALARM, "alarmed"),
        (rules.CERTIFICATE_EXPIRY, "expiring"),
        (rules.CERTIFICATE_RENEWAL, "unrenewed"),
    }
    by_rule = {f.rule: f for f in found}
    assert by_rule[rules.NODE_OFFLINE].value == 500
    assert by_rule[rules.NODE_OFFLINE].severity == "page"
    assert "9 events" in by_rule[rules.OUTBOX_ALARM].summary
    assert rules.held(settings.alerts) == {
        rules.CERTIFICATE_RENEWAL: 600.0,
        rules.LEASE_LAPSED: 300.0,
    }


def test_lease_lapsed_fires_for_a_node_heard_from_once_it_has_held_its_grace() -> None:
    """A node that serves accounts without a live lease fires `lease_lapsed` only after
    `alerts.lease_grace_s` of saying so, fires on while it does, and stops when it reports
    none (the loop then resolves it); a stale node's old word fires nothing."""
    settings = HubSettings()  # stale after 45 s; lease_lapsed held 300 s
    grace = settings.alerts.lease_grace_s
    start = 1_000_000.0

    def lapsing(now: float, lapsed: int) -> list[Firing]:
        nodes = [
            _node("lapsed", now - 1, leases_lapsed=lapsed, lease_failures=7),
            _node("quiet", now - 1),
            _node("stale", now - 45, leases_lapsed=3, lease_failures=9),  # its last word
        ]
        found = rules.node_alerts(now, nodes, {}, None, settings)
        return [f for f in found if f.rule == rules.LEASE_LAPSED]

    def evaluate(
        now: float, lapsed: int, holding: dict[rules.Key, float], already: set[rules.Key]
    ) -> tuple[list[Firing], dict[rules.Key, float]]:
        return rules.hold(lapsing(now, lapsed), already, holding, now, settings.alerts)

    (found,) = lapsing(start, 2)  # the stale node is not among them
    assert found.labels == {"node": "lapsed", "site": "lab"}
    assert (found.severity, found.value) == ("ticket", 2.0)
    assert "serves 2 accounts without a live quota lease" in found.summary
    assert "7 lease calls failed in a row" in found.summary

    kept, holding = evaluate(start, 2, {}, set())
    assert kept == []  # held back: its grace has just begun
    kept, holding = evaluate(start + grace - 1, 2, holding, set())
    assert kept == []
    kept, holding = evaluate(start + grace, 2, holding, set())
    assert [f.labels["node"] for f in kept] == ["lapsed"]
    # Recorded as firing, it fires on; reported gone, it no longer fires (resolved).
    kept, holding = evaluate(start + grace + 15, 1, holding, {found.key})
    assert [f.value for f in kept] == [1.0]
    assert lapsing(start + grace + 30, 0) == []
    kept, holding = evaluate(start + grace + 30, 0, holding, set())
    assert (kept, holding) == ([], {})
    # A lapse that comes back waits out its grace again, from its return.
    again = start + 2 * grace
    kept, holding = evaluate(again, 1, holding, set())
    kept, holding = evaluate(again + grace - 1, 1, holding, set())
    assert kept == []


def test_restart_rule() -> None:
    settings = HubSettings()  # more than 3 in 15 min
    nodes = [_node("a", 1.0), _node("b", 1.0)]
    found = rules.restart_alerts({"id-a": 4, "id-b": 3, "id-gone": 9}, nodes, settings.alerts)
    assert _fired(found) == {(rules.WORKER_RESTARTS, "a")}
    assert "4 times in 15m" in found[0].summary


@dataclass(frozen=True)
class _Totals:
    service_class: str
    met: dict[str, int] = field(default_factory=dict)
    missed: dict[str, int] = field(default_factory=dict)


def test_burn_rule_needs_both_windows() -> None:
    settings = HubSettings()  # S1 first_token 0.99: 14.4x is a miss ratio above 0.144
    pairs = rules.burn_pairs(settings.alerts)[:1]  # 1h and 5m at 14.4x

    def window(missed: int) -> list[_Totals]:
        return [_Totals("S1", {"first_token": 100 - missed}, {"first_token": missed})]

    def burning(long_missed: int, short_missed: int) -> list[Firing]:
        totals = {3600.0: window(long_missed), 300.0: window(short_missed)}
        return rules.burn_alerts(pairs, totals, settings.objectives.target, burn_rate)

    assert burning(15, 14) == []  # the short window is below
    assert burning(14, 50) == []  # the long one is
    (fired,) = burning(15, 50)
    assert fired.labels == {"class": "S1", "objective": "first_token", "window": "1h/5m"}
    assert fired.severity == "page"
    assert fired.value == pytest.approx(15.0)


def test_the_store_records_each_change_once_and_silences_hold_deliveries_back(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    one, two = open_store(settings), open_store(settings)  # two replicas
    try:
        a = Firing("node_offline", {"node": "a", "site": "lab"}, "page", 130.0, "a is down")
        b = Firing("node_offline", {"node": "b", "site": "lab"}, "page", 140.0, "b is down")
        one.alerts.create_silence(
            {"rule": "node_offline", "node": "b"}, time.time() + 60, "ops", ""
        )
        urls = ["http://127.0.0.1:9/hook"]
        made = one.alerts.record([a, b], ["node_offline"], urls)
        assert sorted((x.labels["node"], event, x.silenced) for x, event in made) == [
            ("a", "firing", False),
            ("b", "firing", True),
        ]
        assert two.alerts.record([a, b], ["node_offline"], urls) == []  # already firing
        assert len(one.alerts.all("firing")) == 2
        # Only a's change is delivered; b's is recorded, silenced.
        assert [d["event"] for d in one.alerts.deliveries()] == ["firing"]
        # A rule not evaluated this round resolves nothing.
        assert one.alerts.record([], ["worker_restarts"], urls) == []
        made = two.alerts.record([b], ["node_offline"], urls)
        assert [(x.labels["node"], event) for x, event in made] == [("a", "resolved")]
        assert one.alerts.record([b], ["node_offline"], urls) == []  # resolved once
        (resolved,) = one.alerts.all("resolved")
        assert resolved.resolved_at is not None
        assert [d["event"] for d in one.alerts.deliveries()] == ["firing", "resolved"]
        payload = json.loads(one.alerts.due_deliveries(time.time() + 1)[0].payload)
        assert payload["event"] == "alert.firing"
        assert payload["alert"]["labels"] == {"node": "a", "site": "lab"}
    finally:
        one.close()
        two.close()


def alert_settings(
    tmp_path: Path, database: dict[str, Any], url: str, **alerts: Any
) -> HubSettings:
    """A loopback hub's settings, its alert loop quick and its retries short."""
    every = {"every_s": 0.2, "webhooks": [{"url": url, "secret": SECRET}],
             "backoff_initial_s": 0.1, "backoff_max_s": 0.2, **alerts}  # fmt: skip
    return settings_for(tmp_path, database, alerts=every)


async def test_a_real_hub_fires_resolves_and_delivers_signed_webhooks_across_a_restart(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    receiver = Receiver()
    hook = await aiohttp_server(receiver.app)
    settings = alert_settings(tmp_path, hub_database, f"http://127.0.0.1:{hook.port}/hook")
    store = open_store(settings)
    _, token = enroll_node(store, "n1")
    _, quiet_token = enroll_node(store, "n2")
    operator = store.operators.create("ops").plaintext
    store.close()
    server = await aiohttp_server(create_app(settings))

    node = {"Authorization": f"Bearer {token}", **protocol.HEADERS}
    quiet = {"Authorization": f"Bearer {quiet_token}", **protocol.HEADERS}
    ops = {"Authorization": f"Bearer {operator}"}
    base = f"http://127.0.0.1:{server.port}"

    async def beat(session: aiohttp.ClientSession, headers: dict[str, str], alarm: bool) -> None:
        body = {"capacity": {"outbox_alarm": alarm, "outbox_lag": 5 if alarm else 0}}
        async with session.post(f"{base}/v1/node/heartbeat", json=body, headers=headers) as r:
            assert r.status == 200

    async with aiohttp.ClientSession() as session:
        # n2's alarm is silenced: recorded, not delivered.
        silence = {"matchers": {"rule": "outbox_alarm", "node": "n2"}, "duration_s": 600,
                   "comment": "known"}  # fmt: skip
        async with session.post(f"{base}/v1/admin/silences", json=silence, headers=ops) as r:
            assert r.status == 201
            made = await r.json()
            assert made["created_by"] == "ops"
            assert made["active"]
        await beat(session, node, alarm=True)
        await beat(session, quiet, alarm=True)
        await until(lambda: receiver.events() == [("alert.firing", "n1")], "n1's alarm delivered")

        async def listed(state: str) -> list[dict[str, Any]]:
            async with session.get(f"{base}/v1/admin/alerts?state={state}", headers=ops) as r:
                assert r.status == 200
                return list((await r.json())["data"])

        firing = await until(lambda: _two(listed("firing")), "both alarms recorded")
        assert {(a["labels"]["node"], a["silenced"]) for a in firing} == {
            ("n1", False),
            ("n2", True),
        }
        # The receiver goes down; the alarm ends; the hub keeps retrying.
        receiver.status = 503
        await beat(session, node, alarm=False)
        await until(lambda: receiver.refused >= 2, "the resolution retried")
    await server.close()  # the hub stops with the delivery still owed

    receiver.status = 200
    server = await aiohttp_server(create_app(settings))  # the same data directory
    await until(
        lambda: receiver.events() == [("alert.firing", "n1"), ("alert.resolved", "n1")],
        "the owed resolution delivered by the restarted hub",
    )
    first, second = receiver.received
    assert first["id"] != second["id"]
    assert second["alert"]["state"] == "resolved"
    assert second["alert"]["resolved_at"] is not None
    await server.close()


async def test_a_failed_alert_webhook_shows_its_host_never_its_urls_credentials(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    hub_database: HubDatabase,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The log and the delivery's last error (both the operators') name the receiver that
    failed, without the userinfo, query or fragment a credential may be kept in."""
    caplog.set_level(logging.INFO, logger="hub.alerting.delivery")
    receiver = Receiver()
    receiver.status = 500
    hook = await aiohttp_server(receiver.app)
    secrets = ("hook-user", "pass-word-1", "token-2", "frag-3")
    userinfo = f"{secrets[0]}:{secrets[1]}@"
    failing = f"http://{userinfo}127.0.0.1:{hook.port}/hook?t={secrets[2]}#{secrets[3]}"
    hostless = f"http://{userinfo}/hook?t={secrets[2]}"  # the HTTP client's error names it
    webhooks = [{"url": url, "secret": SECRET} for url in (failing, hostless)]
    settings = alert_settings(tmp_path, hub_database, failing, webhooks=webhooks)
    store = AsyncHubStore(settings)
    await store.open()
    sender = AlertSender(store, settings.alerts)
    try:
        down = Firing("node_offline", {"node": "a", "site": "lab"}, "page", 130.0, "a is down")
        await store.run(store.sync.alerts.record, [down], ["node_offline"], [failing, hostless])
        assert await sender.round() == 2
        rows = {row["url"]: row for row in await store.run(store.sync.alerts.deliveries)}
    finally:
        await sender.close()
        await store.close()
    assert receiver.refused == 1
    assert rows[failing]["last_error"] == "the receiver answered HTTP 500"
    assert f"to http://***@127.0.0.1:{hook.port}/hook?***#*** failed" in caplog.text
    recorded = rows[hostless]["last_error"]
    assert "no connection" in recorded
    assert "http://***@/hook?***" in recorded
    for shown in (caplog.text, recorded):
        for secret in secrets:
            assert secret not in shown, (secret, shown)


async def test_a_real_hub_alerts_on_lapsed_leases_and_serves_version_4_nodes(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    """Through the node API: a node's heartbeats saying it serves accounts without a live
    lease fire `lease_lapsed` once its grace has passed, and one saying none resolves it.
    Beside it a node of protocol 4, which knows nothing of lease trouble, is served: its
    heartbeat lands, and its answer holds only what version 4 knows."""
    receiver = Receiver()
    hook = await aiohttp_server(receiver.app)
    url = f"http://127.0.0.1:{hook.port}/hook"
    settings = alert_settings(tmp_path, hub_database, url, lease_grace_s=0.5)
    store = open_store(settings)
    _, token = enroll_node(store, "n1")
    older_id, older_token = enroll_node(store, "n4")
    store.close()
    server = await aiohttp_server(create_app(settings))
    base = f"http://127.0.0.1:{server.port}"
    node = {"Authorization": f"Bearer {token}", **protocol.HEADERS}
    older = {"Authorization": f"Bearer {older_token}", protocol.PROTOCOL_HEADER: "4"}

    async with aiohttp.ClientSession() as session:

        async def beat(headers: dict[str, str], capacity: dict[str, Any]) -> dict[str, Any]:
            body = {"capacity": capacity}
            async with session.post(f"{base}/v1/node/heartbeat", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                answer: dict[str, Any] = await r.json()
                return answer

        # What a version-4 node sends: the capacity of version 4, no lease trouble.
        answer = await beat(older, {"memory_total_mib": 100, "outbox_lag": 0})
        assert set(answer) == {
            "node_id", "received_at", "desired_serial", "trust_digest", "renew_certificate",
        }  # fmt: skip
        lapsed_at = time.monotonic()
        await beat(node, {"leases_lapsed": 2, "lease_failures": 4})
        await until(lambda: receiver.events() == [("alert.firing", "n1")], "lease_lapsed fired")
        assert time.monotonic() - lapsed_at >= 0.5  # not before its grace
        (fired,) = receiver.received
        assert fired["alert"]["rule"] == rules.LEASE_LAPSED
        assert fired["alert"]["labels"] == {"node": "n1", "site": "site"}
        assert fired["alert"]["value"] == 2
        await beat(node, {"leases_lapsed": 0})
        await until(
            lambda: receiver.events() == [("alert.firing", "n1"), ("alert.resolved", "n1")],
            "lease_lapsed resolved",
        )
    await server.close()
    store = open_store(settings)
    try:
        assert store.nodes.get(older_id).capacity.memory_total_mib == 100  # its heartbeat landed
        assert store.nodes.get(older_id).capacity.leases_lapsed == 0
    finally:
        store.close()


async def _two(listed: Any) -> list[dict[str, Any]] | None:
    found = await listed
    return found if len(found) == 2 else None


async def test_the_operator_api_of_alerts_and_silences(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    operator = store.operators.create("ops").plaintext
    store.close()
    server = await aiohttp_server(create_app(settings))
    base = f"http://127.0.0.1:{server.port}"
    ops = {"Authorization": f"Bearer {operator}"}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/v1/admin/alerts") as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == ErrorCode.invalid_operator_token.value
        async with session.get(f"{base}/v1/admin/alerts?state=lost", headers=ops) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "state"
        async with session.post(f"{base}/v1/admin/silences", json={}, headers=ops) as r:
            assert r.status == 400  # matchers are required
        bad = {"matchers": {"rule": "x"}, "duration_s": -1}
        async with session.post(f"{base}/v1/admin/silences", json=bad, headers=ops) as r:
            assert r.status == 400
        good = {"matchers": {"rule": "node_offline"}, "duration_s": 60}
        async with session.post(f"{base}/v1/admin/silences", json=good, headers=ops) as r:
            assert r.status == 201
            silence_id = (await r.json())["id"]
        async with session.get(f"{base}/v1/admin/silences", headers=ops) as r:
            assert [s["id"] for s in (await r.json())["data"]] == [silence_id]
        async with session.delete(f"{base}/v1/admin/silences/{silence_id}", headers=ops) as r:
            assert r.status == 200
        async with session.delete(f"{base}/v1/admin/silences/{silence_id}", headers=ops) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == ErrorCode.not_found.value
    await server.close()


def test_the_committed_rules_file_is_the_generators_and_promtool_passes_it(
    tmp_path: Path,
) -> None:
    assert RULES_FILE.read_text() == rules_yaml(HubSettings()), (
        "regenerate with `kvl hub alerts rules > docs/prometheus/kvl-hub.rules.yml`"
    )
    printed = kvl("hub", "alerts", "rules", "--data-dir", str(tmp_path)).stdout
    assert printed == RULES_FILE.read_text()
    short = kvl("hub", "alerts", "rules", "--scale", str(1 / 60), "--data-dir", str(tmp_path))
    assert short.stdout == rules_yaml(scaled(HubSettings(), 1 / 60))
    assert "kvl:slo_error_ratio:rate5s" in short.stdout
    assert "[1m]" in short.stdout
    assert "window: 1m/5s" in short.stdout
    scaled_file = tmp_path / "scaled.rules.yml"
    scaled_file.write_text(short.stdout)
    for path in (RULES_FILE, scaled_file):
        check = subprocess.run(
            [promtool(), "check", "rules", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert "SUCCESS" in check.stdout


def test_the_cli_silences_and_lists(tmp_path: Path, hub_database: HubDatabase) -> None:
    data = str(tmp_path / "hub")
    store = open_store(settings_for(tmp_path, hub_database))
    store.alerts.record(
        [Firing("node_offline", {"node": "a", "site": "lab"}, "page", 130.0, "a is down")],
        ["node_offline"],
        [],
    )
    store.close()
    listed = kvl("hub", "alerts", "list", "--data-dir", data).stdout
    assert "node_offline" in listed
    assert "node=a,site=lab" in listed
    assert kvl("hub", "alerts", "--data-dir", data).stdout == listed
    made = kvl("hub", "alerts", "silence", "--match", "rule=node_offline", "--match",
               "node=a", "--for", "2h", "--comment", "planned", "--data-dir", data
               ).stdout.strip()  # fmt: skip
    assert made.startswith("sil_")
    (row,) = [json.loads(line) for line in kvl("hub", "alerts", "silences", "--json",
                                               "--data-dir", data).stdout.splitlines()]  # fmt: skip
    assert row["matchers"] == {"node": "a", "rule": "node_offline"}
    assert row["active"]
    assert (
        kvl("hub", "alerts", "unsilence", made, "--data-dir", data).stdout.strip()
        == f"ended {made}"
    )
    gone = kvl("hub", "alerts", "unsilence", made, "--data-dir", data, check=False)
    assert gone.returncode == 1
    assert "no silence" in gone.stderr
    bad = kvl("hub", "alerts", "silence", "--match", "nolabel", "--data-dir", data, check=False)
    assert bad.returncode == 2
