"""The objective book without a model: the protocol's counting rules, the bound on series,
its store (one transaction, the epoch kept), its /metrics families, and the heartbeat that
carries it (the body a real loopback server reads as `protocol.HeartbeatRequest`)."""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING, Any

from aiohttp import web

from appliance.fleet.client import HubClient
from appliance.fleet.link import VERSIONS, FleetLink
from appliance.observability.metrics import Metrics
from appliance.observability.objectives import OTHER, ClassObjectives, ObjectiveBook
from appliance.settings import FleetLinkSettings
from appliance.state.store import AsyncStore, Store
from shared import protocol
from tests.conftest import NoModels

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

TARGETS = {k: ClassObjectives(1.0, 2.0, 10.0) for k in ("S0", "S1", "S2", "S3", "S4")}


def one(book: ObjectiveBook, klass: str = "S1", account: str = "a") -> protocol.ObjectiveSeries:
    return next(s for s in book.snapshot() if (s.service_class, s.account) == (klass, account))


def test_each_ending_counts_once_by_the_protocols_rules() -> None:
    book = ObjectiveBook(TARGETS)
    # Served within every objective, and one past each.
    book.ticket("S1", "a").serve(queue_s=0.5, ttft_s=1.5, duration_s=9.0, cancelled=False)
    book.ticket("S1", "a").serve(queue_s=1.5, ttft_s=2.5, duration_s=11.0, cancelled=False)
    # Refused at the door: misses all three; a quota refusal counts for none.
    refused = book.ticket("S1", "a")
    refused.refuse("first_token")
    refused.refuse("error")  # a ticket ends once: this changes nothing
    refused.close()
    book.ticket("S1", "a").refuse("quota")
    # Cancelled after its first token: admit and first token measured, complete neither.
    book.ticket("S1", "a").serve(queue_s=0.1, ttft_s=0.2, duration_s=30.0, cancelled=True)
    # Cancelled before its first token, past that objective: missed; before it: neither.
    book.ticket("S1", "a").serve(queue_s=0.1, ttft_s=None, duration_s=3.0, cancelled=True)
    book.ticket("S1", "a").serve(queue_s=None, ttft_s=None, duration_s=0.5, cancelled=True)
    # Past the door, then its client went away with no timings; a bad request (never at
    # the door) counts nowhere.
    gone = book.ticket("S1", "a")
    gone.at_door = True
    gone.close()
    book.ticket("S1", "a").close()
    s = one(book)
    assert s.requests == 8
    assert s.admitted == 6
    assert s.refused == {"first_token": 1, "quota": 1}
    assert s.admitted + sum(s.refused.values()) == s.requests
    assert s.met == {"admit": 3, "first_token": 2, "complete": 1}
    assert s.missed == {"admit": 2, "first_token": 3, "complete": 2}
    assert s.ttft.count == 3
    assert s.ttft.sum_s == 1.5 + 2.5 + 0.2
    # 1.5 s lies in (1, 2], 2.5 in (2, 2.5], 0.2 in (0.1, 0.25].
    bounds = protocol.LATENCY_BOUNDS_S
    assert s.ttft.counts[bounds.index(2.0)] == 1
    assert s.ttft.counts[bounds.index(2.5)] == 1
    assert s.ttft.counts[bounds.index(0.25)] == 1
    assert s.completion.count == 2  # the cancelled ones are not completions
    assert s.completion.counts[bounds.index(10.0)] == 1
    assert s.completion.counts[bounds.index(15.0)] == 1


def test_series_past_the_bound_fold_into_other_per_class_and_stay_there() -> None:
    book = ObjectiveBook(TARGETS)
    for i in range(protocol.MAX_OBJECTIVE_SERIES + 40):
        book.refused("S1" if i % 2 else "S2", f"account-{i}", "quota")
    early = book.series("S1", "account-1")
    series = book.snapshot()
    assert len(series) <= protocol.MAX_OBJECTIVE_SERIES
    # Valid as a heartbeat carries it (the protocol's own bound and uniqueness checks).
    protocol.Objectives(epoch="e", series=series)
    others = {s.service_class: s for s in series if s.account == OTHER}
    assert set(others) == {"S1", "S2"}
    assert sum(s.requests for s in series) == protocol.MAX_OBJECTIVE_SERIES + 40
    # A pair counted on its own stays on its own; a folded one keeps going to "(other)".
    book.refused("S1", "account-1", "quota")
    assert early.requests == 2
    late = f"account-{protocol.MAX_OBJECTIVE_SERIES + 39}"
    before = others["S1"].requests
    book.refused("S1", late, "quota")
    assert one(book, "S1", OTHER).requests == before + 1


def test_an_account_name_the_protocol_cannot_carry_is_counted_as_other() -> None:
    book = ObjectiveBook(TARGETS)
    book.refused("S1", "x" * 201, "quota")
    book.refused("S1", "nul\x00", "quota")
    protocol.Objectives(epoch="e", series=book.snapshot())
    assert one(book, "S1", OTHER).requests == 2


def test_the_store_keeps_the_series_and_the_epoch_until_a_new_database(tmp_path: Path) -> None:
    book = ObjectiveBook(TARGETS)
    book.ticket("S2", "a").serve(queue_s=0.2, ttft_s=0.7, duration_s=4.0, cancelled=False)
    book.refused("S2", "b", "shed")
    store = Store(tmp_path / "a.db")
    epoch, restarts = store.save_objectives(book.take_dirty())
    assert restarts == 0
    assert book.take_dirty() == []  # stored: nothing new to store
    store.record_worker_restart("m@1", "exited", "boom", 1)
    store.close()

    again = Store(tmp_path / "a.db")
    resumed = ObjectiveBook(TARGETS)
    resumed.load(again.load_objectives())
    assert resumed.snapshot() == book.snapshot()
    resumed.refused("S2", "a", "error")
    assert again.save_objectives(resumed.take_dirty()) == (epoch, 1)
    reloaded = ObjectiveBook(TARGETS)
    reloaded.load(again.load_objectives())
    assert one(reloaded, "S2", "a").requests == 2
    again.close()
    fresh = Store(tmp_path / "b.db")
    assert fresh.objectives_epoch() != epoch
    fresh.close()


def test_metrics_sum_the_accounts_per_class_and_pass_promtool() -> None:
    book = ObjectiveBook(TARGETS)
    book.ticket("S1", "a").serve(queue_s=0.1, ttft_s=0.3, duration_s=1.0, cancelled=False)
    book.refused("S1", "b", "admit")
    book.refused("S0", "c", "quota")
    metrics = Metrics()
    metrics.watch_objectives(book)
    text, _ = metrics.render("text/plain")
    lines = text.decode().splitlines()
    for line in (
        'kvl_slo_events_total{class="S1",objective="first_token",outcome="met"} 1.0',
        'kvl_slo_events_total{class="S1",objective="first_token",outcome="missed"} 1.0',
        'kvl_requests_by_outcome_total{class="S1",outcome="admitted"} 1.0',
        'kvl_requests_by_outcome_total{class="S1",outcome="admit"} 1.0',
        'kvl_requests_by_outcome_total{class="S0",outcome="quota"} 1.0',
        'kvl_slo_events_total{class="S0",objective="complete",outcome="missed"} 0.0',
    ):
        assert line in lines, line
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, check=False
    )
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, b"")


async def test_the_heartbeat_body_is_a_protocol_heartbeat_stored_before_it_is_sent(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    bodies: list[protocol.HeartbeatRequest] = []
    saved: list[int] = []
    store = AsyncStore(tmp_path / "a.db")
    await store.open()

    async def heartbeat(request: web.Request) -> web.Response:
        body = protocol.HeartbeatRequest.model_validate_json(await request.read())
        bodies.append(body)
        # The node stored what it sends before it sent it.
        stored = await store.run(store.sync.load_objectives)
        saved.append(sum(s["requests"] for s in stored))
        answer = protocol.HeartbeatAnswer(node_id="n", received_at=1.0, desired_serial=0)
        return web.json_response(answer.model_dump(mode="json"))

    hub = web.Application()
    hub.router.add_post("/v1/node/heartbeat", heartbeat)
    server = await aiohttp_server(hub)
    book = ObjectiveBook(TARGETS)
    link = FleetLink(
        FleetLinkSettings(),
        _NoFiles(),  # type: ignore[arg-type]
        store,
        Metrics(),
        NoModels(),  # type: ignore[arg-type]
        objectives=book,
    )
    try:
        async with HubClient(f"http://127.0.0.1:{server.port}", _plain()) as client:
            for n in range(1, 3):
                book.ticket("S1", "a").serve(
                    queue_s=0.1, ttft_s=0.2, duration_s=0.9, cancelled=False
                )
                await client.heartbeat(VERSIONS, protocol.Capacity(), await link.objectives())
                assert saved[-1] == n
    finally:
        await store.close()
    sent = [b.objectives for b in bodies]
    assert all(o is not None for o in sent)
    first, second = (o for o in sent if o is not None)
    assert first.epoch == second.epoch
    assert (first.series[0].requests, second.series[0].requests) == (1, 2)
    assert second.objectives_s["S1"] == {"admit": 1.0, "first_token": 2.0, "complete": 10.0}
    assert second.worker_restarts == 0


class _NoFiles:
    """No fleet files: the link here only builds its heartbeats."""

    certificate = None

    def identity(self) -> None:
        return None


def _plain() -> Any:
    # Plain HTTP on loopback: the call's TLS is not what this test is about.
    import ssl  # noqa: PLC0415

    return ssl.create_default_context()
