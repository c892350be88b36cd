"""The hub's /metrics: every family of the contract after real traffic (a real hub on
loopback, a node enrolled in its store calling its node API, an operator its operator
API), in a form `promtool check metrics` passes; behind an operator token on the hub API,
open on the `metrics.listen` listener only; routes labelled by their pattern."""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from hub.app import create_app
from hub.observability.metrics import HubMetrics
from hub.state.store import open_store
from shared import __version__, protocol
from shared.errors import ErrorCode
from tests.conftest import free_port
from tests.hub.objective_series import objectives, series
from tests.hubs import PREFIX, new_key, settings_for
from tests.prometheus import promtool
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase

FAMILIES = (
    "kvl_hub_http_requests",
    "kvl_hub_http_errors",
    "kvl_hub_http_request_duration_seconds",
    "kvl_hub_heartbeat_flush_lag_seconds",
    "kvl_hub_heartbeat_flush_batch",
    "kvl_hub_ledger_events",
    "kvl_hub_reconcile_duration_seconds",
    "kvl_hub_placement_duration_seconds",
    "kvl_hub_nodes",
    "kvl_hub_background_failures",
    "kvl_hub_db_duration_seconds",
    "kvl_hub_build",
    "kvl_fleet_requests",
    "kvl_fleet_slo_events",
    "kvl_fleet_worker_restarts",
    "kvl_fleet_node_last_seen_timestamp_seconds",
    "kvl_fleet_node_outbox_alarm",
    "kvl_fleet_node_leases_lapsed",
    "kvl_fleet_node_certificate_expiry_timestamp_seconds",
)


def samples(text: str, name: str) -> dict[str, float]:
    """The samples of a family (`name{labels}` -> value) in an exposition."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    }


async def test_every_family_after_real_traffic_behind_an_operator_token(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    settings.metrics.listen = f"127.0.0.1:{free_port()}"
    store = open_store(settings)
    token = store.tokens.create("lab", uses=1, expires_in_s=60).plaintext
    enrolled = store.nodes.enroll(
        token, name="n1", wg_public_key=new_key(), overlay_prefix=PREFIX, labels={}, versions={}
    )
    operator = store.operators.create("ops").plaintext
    store.close()
    app = create_app(settings)
    server = await aiohttp_server(app)
    base = f"http://127.0.0.1:{server.port}"
    node = {"Authorization": f"Bearer {enrolled.node_token}", **protocol.HEADERS}
    ops = {"Authorization": f"Bearer {operator}"}
    async with aiohttp.ClientSession() as client:
        capacity = protocol.Capacity(
            outbox_alarm=True, outbox_lag=7, leases_lapsed=2, lease_failures=5
        )
        beat = protocol.HeartbeatRequest(capacity=capacity).model_dump(mode="json")
        # Its objectives: 5 requests, 3 first tokens in time, 2 late, none refused.
        beat["objectives"] = objectives("e1", series(requests=5, met=3, missed=2), restarts=2)
        async with client.post(f"{base}/v1/node/heartbeat", json=beat, headers=node) as r:
            assert r.status == 200
        removed = {"id": "p", "version": "1"}
        events = {"events": [{"id": "e1", "kind": "package_removed", "body": removed}]}
        for _ in range(2):  # the second is a resend: a duplicate
            async with client.post(f"{base}/v1/node/events", json=events, headers=node) as r:
                assert r.status == 200, await r.text()
        async with client.post(f"{base}/v1/admin/nodes/n1/drain", json={}, headers=ops) as r:
            assert r.status == 200
        async with client.post(f"{base}/v1/admin/nodes/nobody/drain", json={}, headers=ops) as r:
            assert r.status == 404

        async with client.get(f"{base}/metrics") as r:
            assert r.status == 401
            body = await r.json()
            assert body["error"]["code"] == ErrorCode.invalid_operator_token.value
        async with client.get(f"{base}/metrics", headers={"Authorization": "Bearer kvlo_x"}) as r:
            assert r.status == 401

        async def scraped() -> str:
            async with client.get(f"{base}/metrics", headers={**ops, "Accept": "text/plain"}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain")
                return await r.text()

        text = await until(
            # The listener runs after the flush's commit: its counters mean the row is written too.
            lambda: _has(scraped(), 'kvl_fleet_worker_restarts_total{node="n1",site="lab"} 2.0'),
            "the heartbeat written and counted",
        )
        for family in FAMILIES:
            assert f"# TYPE {family}" in text, family
        requests = samples(text, "kvl_hub_http_requests_total")
        assert any('route="/v1/admin/nodes/{node}/drain"' in k for k in requests), requests
        assert not any("nobody" in k or "/n1/" in k for k in requests), requests
        errors = samples(text, "kvl_hub_http_errors_total")
        assert (
            errors[
                'kvl_hub_http_errors_total{code="not_found",route="/v1/admin/nodes/{node}/drain"}'
            ]
            == 1
        )
        assert samples(text, "kvl_hub_nodes")['kvl_hub_nodes{status="online"}'] == 1
        slo = samples(text, "kvl_fleet_slo_events_total")
        late = 'kvl_fleet_slo_events_total{class="S1",objective="first_token",outcome="missed"}'
        assert slo[late] == 2
        restarts = samples(text, "kvl_fleet_worker_restarts_total")
        assert restarts == {'kvl_fleet_worker_restarts_total{node="n1",site="lab"}': 2}
        alarm = samples(text, "kvl_fleet_node_outbox_alarm")
        assert alarm == {'kvl_fleet_node_outbox_alarm{node="n1",site="lab"}': 1.0}
        lapsed = samples(text, "kvl_fleet_node_leases_lapsed")
        assert lapsed == {'kvl_fleet_node_leases_lapsed{node="n1",site="lab"}': 2.0}
        seen = samples(text, "kvl_fleet_node_last_seen_timestamp_seconds")
        assert list(seen) == ['kvl_fleet_node_last_seen_timestamp_seconds{node="n1",site="lab"}']
        ops_ = samples(text, "kvl_hub_db_duration_seconds_count")
        assert any('operation="HubStore.heartbeats"' in k for k in ops_), ops_
        ledger = samples(text, "kvl_hub_ledger_events_total")
        assert ledger == {
            'kvl_hub_ledger_events_total{kind="package_removed",outcome="new"}': 1,
            'kvl_hub_ledger_events_total{kind="package_removed",outcome="duplicate"}': 1,
        }
        build = samples(text, "kvl_hub_build_info")
        labels = f'protocol="{protocol.PROTOCOL_VERSION}",version="{__version__}"'
        assert build == {f"kvl_hub_build_info{{{labels}}}": 1}
        checked = await asyncio.to_thread(check_metrics, text)
        assert checked == (0, "", "")

        # OpenMetrics by default (as Prometheus asks for it), ending as the format says.
        async with client.get(f"{base}/metrics", headers=ops) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert (await r.text()).endswith("# EOF\n")
        # The listener of `metrics.listen`: /metrics alone, no token.
        listen = f"http://{settings.metrics.listen}"
        async with client.get(f"{listen}/metrics") as r:
            assert r.status == 200
            assert "kvl_hub_nodes" in await r.text()
        async with client.get(f"{listen}/v1/admin/nodes") as r:
            assert r.status == 404


async def _has(text: Any, needle: str) -> str | None:
    found = await text
    return found if needle in found else None


def check_metrics(text: str) -> tuple[int, str, str]:
    """`promtool check metrics` of an exposition: its status, stdout and stderr."""
    done = subprocess.run(
        [promtool(), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


@dataclass(frozen=True)
class _Delta:
    service_class: str
    admitted: int
    refused: dict[str, int] = field(default_factory=dict)
    met: dict[str, int] = field(default_factory=dict)
    missed: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Ingested:
    series: list[_Delta]
    worker_restarts: list[tuple[str, str, str, int]]


def test_the_objectives_listener_counts_what_a_flush_added() -> None:
    metrics = HubMetrics()
    metrics.objectives(
        _Ingested(
            [
                _Delta("S1", 5, {"first_token": 2, "quota": 1}, {"first_token": 5},
                       {"first_token": 2}),
                _Delta("S1", 1, {}, {"admit": 1}),
            ],
            [("id1", "n1", "lab", 3), ("id2", "n2", "lab", 0)],
        )
    )  # fmt: skip
    value = metrics.registry.get_sample_value
    assert value("kvl_fleet_requests_total", {"class": "S1", "outcome": "admitted"}) == 6
    assert value("kvl_fleet_requests_total", {"class": "S1", "outcome": "first_token"}) == 2
    assert value("kvl_fleet_requests_total", {"class": "S1", "outcome": "quota"}) == 1
    slo = "kvl_fleet_slo_events_total"
    assert value(slo, {"class": "S1", "objective": "first_token", "outcome": "met"}) == 5
    assert value(slo, {"class": "S1", "objective": "first_token", "outcome": "missed"}) == 2
    assert value(slo, {"class": "S1", "objective": "admit", "outcome": "met"}) == 1
    assert value("kvl_fleet_worker_restarts_total", {"node": "n1", "site": "lab"}) == 3
    assert value("kvl_fleet_worker_restarts_total", {"node": "n2", "site": "lab"}) is None


@pytest.mark.parametrize("seconds", [0.0005, 59.0, 600.0, 3599.0])
def test_latency_buckets_cover_every_objective(seconds: float) -> None:
    metrics = HubMetrics()
    metrics.request_seconds.labels("/x").observe(seconds)
    inf = metrics.registry.get_sample_value(
        "kvl_hub_http_request_duration_seconds_bucket", {"route": "/x", "le": "3600.0"}
    )
    assert inf == 1  # below the last finite bound: never only in +Inf
