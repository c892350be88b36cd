"""The fleet's objectives: a real hub (SQLite and PostgreSQL) takes nodes' cumulative
counters from their heartbeats through the node API and counts each value once (a resent
heartbeat adds nothing, a new epoch counts whole, a reset counts whole, accounts it does
not know are "(other)"), refuses what is out of bounds without changing anything, and
sums the buckets over windows; error budgets and burn rates against hand-computed
numbers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from pydantic import ValidationError

from hub.app import create_app
from hub.appkeys import BEATS, STORE
from hub.fleet import budgets
from hub.fleet.heartbeats import COUNTS_A_TURN, Heartbeats
from hub.planning.slo import OTHER_ACCOUNT, Grouping, Ingested, SloTotals, quantile
from hub.settings import HubSettings
from hub.state.nodes import Heartbeat
from hub.state.objectives import FIVE_MINUTES, HOUR, KEPT_S, SloFilters
from hub.state.store import HubStore, open_store
from shared import protocol
from tests.hub.nodes import assert_refused, enroll_node, node_call
from tests.hub.objective_series import BUCKETS, objectives, series
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from aiohttp import web
    from aiohttp.test_utils import TestClient
    from pytest_aiohttp import AiohttpClient

    from tests.hub.conftest import HubDatabase
    from tests.postgres import Cluster

T = TypeVar("T")


@pytest.fixture
def fleet(tmp_path: Path, hub_database: HubDatabase) -> tuple[HubSettings, dict[str, str]]:
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    try:
        store.accounts.put("acme", "S1")
        store.accounts.put("globex", "S2")
        node_id, token = enroll_node(store, "n1")
        other_id, other_token = enroll_node(store, "n2")
    finally:
        store.close()
    return settings, {"id": node_id, "token": token, "other_id": other_id, "other": other_token}


def _read(settings: HubSettings, fn: Callable[[HubStore], T]) -> T:
    store = open_store(settings)
    try:
        return fn(store)
    finally:
        store.close()


def _totals(settings: HubSettings, by: Grouping = "account") -> dict[tuple[str, str], SloTotals]:
    now = time.time()
    rows = _read(settings, lambda s: s.objectives.totals(now - 3600, now + 1, by))
    return {(t.service_class, t.group): t for t in rows}


class Beats:
    """Heartbeats through the node API, each one's flush waited for: the flusher writes
    them behind, then calls the objectives' listeners, then the heartbeats' listeners,
    where a beat's cpu_percent marks it."""

    def __init__(self, client: TestClient[Any, Any], app: web.Application) -> None:
        self.client = client
        self.marker = 0.0
        self.flushed: set[float] = set()
        app[BEATS].listeners.append(self._flushed)

    async def _flushed(self, beats: list[Heartbeat]) -> None:
        self.flushed.update(b.capacity.cpu_percent for b in beats)

    async def send(self, token: str, body: dict[str, Any] | None) -> None:
        self.marker += 1
        beat: dict[str, Any] = {"capacity": {"cpu_percent": self.marker}}
        if body is not None:
            beat["objectives"] = body
        status, answer = await node_call(self.client, "POST", "/v1/node/heartbeat", token,
                                     json.dumps(beat))  # fmt: skip
        assert status == 200, answer
        marker = self.marker
        await until(lambda: marker in self.flushed, "the heartbeat flushed", timeout_s=15)


async def test_heartbeats_count_each_value_once(
    aiohttp_client: AiohttpClient, fleet: tuple[HubSettings, dict[str, str]]
) -> None:
    settings, ids = fleet
    app = create_app(settings)
    client = await aiohttp_client(app)
    ingested: list[Ingested] = []
    failed: list[int] = []

    def boom(added: Ingested) -> None:
        failed.append(len(added.series))
        if len(failed) == 1:
            raise RuntimeError("a listener's bug")

    # A listener that raises takes neither the flush nor the listeners after it down.
    app[BEATS].objective_listeners += [boom, ingested.append]
    beats = Beats(client, app)
    token, node = ids["token"], ids["id"]

    # The first heartbeat of an epoch counts whole.
    first = objectives("e1", series(requests=10, met=8, missed=2, ttft={2: 8}), restarts=1)
    await beats.send(token, first)
    acme = _totals(settings)[("S1", "acme")]
    assert (acme.requests, acme.admitted, acme.met["first_token"], acme.missed["first_token"]) == (
        10, 10, 8, 2,
    )  # fmt: skip
    [added] = ingested
    assert [
        (d.node, d.site, d.account, d.requests, d.met["first_token"]) for d in added.series
    ] == [("n1", "site", "acme", 10, 8)]
    assert added.worker_restarts == [(node, "n1", "site", 1)]

    # Sent again (its answer lost): nothing counted twice, nothing handed to listeners.
    await beats.send(token, first)
    assert _totals(settings)[("S1", "acme")].requests == 10
    assert len(ingested) == 1

    # Grown: the difference. An account the hub does not know: "(other)", summed with a
    # second unknown one.
    grown = objectives(
        "e1",
        series(requests=15, met=12, missed=3, ttft={2: 12}),
        series("ghost", requests=4, met=4),
        series("spectre", requests=1, missed=1),
        restarts=3,
    )
    await beats.send(token, grown)
    totals = _totals(settings)
    assert (totals[("S1", "acme")].requests, totals[("S1", "acme")].missed["first_token"]) == (
        15,
        3,
    )
    other = totals[("S1", OTHER_ACCOUNT)]
    assert (other.requests, other.met["first_token"], other.missed["first_token"]) == (5, 4, 1)
    assert not {k for k in totals if k[1] in {"ghost", "spectre"}}
    assert ingested[-1].worker_restarts == [(node, "n1", "site", 2)]
    now = time.time()
    assert _read(settings, lambda s: s.objectives.worker_restarts_since(now - 600)) == {node: 3}

    # A heartbeat of an older node, without objectives: served, nothing counted.
    await beats.send(token, None)
    assert _totals(settings)[("S1", "acme")].requests == 15

    # A reset within the epoch (a value lower than before): the new values count whole.
    await beats.send(token, objectives("e1", series(requests=2, met=2), restarts=3))
    assert _totals(settings)[("S1", "acme")].requests == 17
    # A new epoch (a new database on the node): counted whole, though higher than before.
    await beats.send(token, objectives("e2", series(requests=20, met=20), restarts=0))
    totals = _totals(settings)
    assert totals[("S1", "acme")].requests == 37
    assert totals[("S1", "acme")].met["first_token"] == 34
    # By class, site and node, the same sums.
    by_class = _totals(settings, "class")
    assert by_class[("S1", "")].requests == 42
    assert _totals(settings, "site")[("S1", "site")].requests == 42
    assert _totals(settings, "node")[("S1", "n1")].requests == 42

    # Another node's series are its own: same account, its own cursor.
    await beats.send(ids["other"], objectives("e1", series(requests=3, met=3)))
    assert _totals(settings)[("S1", "acme")].requests == 40
    assert _totals(settings, "node")[("S1", "n2")].requests == 3
    # Only the listener's bug was counted, once.
    failures = (await (await client.get("/healthz")).json())["loop_failures"]
    assert failures == {"heartbeats.boom": 1}
    assert len(failed) == len(ingested)


def test_a_nodes_objectives_are_counted_once_a_period_the_newest_waiting() -> None:
    """`objectives.count_every_s`: a node's first heartbeat is counted after its random
    share of the period (none here, then half), the ones within its period wait (the
    newest replacing the older, whose values it holds), and the newest is counted when
    the period ends, heartbeat or not; the last flush counts every one waiting.
    Heartbeats without objectives are written, never counted."""
    clock = Clock(1000.0)
    beats = Heartbeats(60.0, clock=clock, spread=lambda: 0.0)

    def beat(node: str, requests: int) -> Heartbeat:
        return _beat(node, clock.now, "e", series(requests=requests, met=requests))

    def take(*, last: bool = False) -> tuple[list[str], list[tuple[str, int]]]:
        written, counted = beats.take(last=last)
        return [b.node_id for b in written], [
            (b.node_id, b.objectives.series[0].requests if b.objectives else -1) for b in counted
        ]

    beats.add(beat("a", 1))
    beats.add(beat("b", 1))
    assert take() == (["a", "b"], [("a", 1), ("b", 1)])
    clock.now += 15
    beats.add(beat("a", 2))
    beats.add(Heartbeat("c", clock.now, {}, protocol.Capacity()))  # an older node's
    assert take() == (["a", "c"], [])
    clock.now += 15
    beats.add(beat("a", 3))  # replaces a's 2, which it holds
    beats.add(beat("b", 3))
    assert take() == (["a", "b"], [])
    clock.now += 29
    assert take() == ([], [])
    clock.now += 1  # a's and b's periods end: their newest counted, no heartbeat needed
    assert take() == ([], [("a", 3), ("b", 3)])
    clock.now += 1
    beats.add(beat("a", 4))
    assert take() == (["a"], [])
    # The last flush (the hub stopping) counts what waits.
    assert take(last=True) == ([], [("a", 4)])
    assert take(last=True) == ([], [])
    # A node first heard: counted after its share of the period (half: 30 s), the newest.
    halfway = Heartbeats(60.0, clock=clock, spread=lambda: 0.5)
    halfway.add(beat("d", 1))
    assert halfway.take()[1] == []
    clock.now += 29
    halfway.add(beat("d", 2))
    assert halfway.take()[1] == []
    clock.now += 1
    assert [(b.node_id, b.at) for b in halfway.take()[1]] == [("d", clock.now - 1)]
    # Every heartbeat counted with a period of 0.
    every = Heartbeats(0.0, clock=clock)
    for requests in (1, 2):
        every.add(beat("a", requests))
        assert [b.node_id for b in every.take()[1]] == ["a"]


async def test_a_stopping_hub_counts_the_objectives_still_waiting(
    aiohttp_client: AiohttpClient, fleet: tuple[HubSettings, dict[str, str]]
) -> None:
    """With the default period the heartbeats within it wait (the first, its random share
    of the period); the hub's last flush, as it stops, counts the newest: nothing waiting
    is lost to a clean stop."""
    settings, ids = fleet
    settings = settings.model_copy(
        update={"objectives": settings.objectives.model_copy(update={"count_every_s": 60.0})}
    )
    app = create_app(settings)
    client = await aiohttp_client(app)
    beats = Beats(client, app)
    await beats.send(ids["token"], objectives("e1", series(requests=10, met=10)))
    await beats.send(ids["token"], objectives("e1", series(requests=25, met=25)))
    # Each waits its node's random share of the period: none counted yet, or on a slow host
    # (its share was shorter than the host took) the first or both, never a sum.
    counted = _totals(settings).get(("S1", "acme"))
    assert (counted.requests if counted else 0) in (0, 10, 25)
    await client.close()  # the hub stops: its last flush
    assert _totals(settings)[("S1", "acme")].requests == 25


async def test_a_flush_is_written_in_turns_that_let_queued_calls_go_between(
    aiohttp_client: AiohttpClient, fleet: tuple[HubSettings, dict[str, str]]
) -> None:
    """Many nodes' objectives due in one flush are counted a few nodes a turn of the store's
    writer, each turn its own transaction: a call queued on the writer meanwhile (a sync's
    group commit) runs between turns instead of after the whole flush. Every count lands."""
    settings, _ = fleet
    nodes = 2 * COUNTS_A_TURN + 5
    store = open_store(settings)
    try:
        ids = [enroll_node(store, f"t{i}")[0] for i in range(nodes)]
    finally:
        store.close()
    app = create_app(settings)
    await aiohttp_client(app)
    writer = app[STORE]
    order: list[str] = []
    turns: list[tuple[int, int]] = []
    write = writer.sync.heartbeats
    loop = asyncio.get_running_loop()
    queued: list[concurrent.futures.Future[None]] = []
    submitted = threading.Event()

    async def queued_call() -> None:
        call = asyncio.ensure_future(writer.run(order.append, "queued"))
        await asyncio.sleep(0)  # the call's first step ran: it waits on the writer
        submitted.set()
        await call

    def recording(rows: list[Heartbeat], counts: list[Heartbeat]) -> Ingested:
        order.append("turn")
        turns.append((len(rows), len(counts)))
        if counts and not queued:  # the first counting turn: a call comes in meanwhile
            queued.append(asyncio.run_coroutine_threadsafe(queued_call(), loop))
            assert submitted.wait(5.0)
        return write(rows, counts)

    app[STORE].sync.heartbeats = recording  # type: ignore[method-assign,assignment]
    now = time.time()
    for node_id in ids:
        app[BEATS].add(_beat(node_id, now, "e", series(requests=3, met=3)))

    def all_counted() -> bool:
        return _totals(settings).get(("S1", "acme")) is not None and (
            _totals(settings)[("S1", "acme")].requests == 3 * nodes
        )

    await until(all_counted, "every node's objectives counted", timeout_s=10.0)
    counting = [counts for _, counts in turns if counts]
    assert sum(counting) == nodes
    assert max(counting) <= COUNTS_A_TURN
    assert len(counting) >= 3
    assert all(not (rows and counts) for rows, counts in turns)
    # The call queued during the first counting turn ran before the last turn.
    assert "queued" in order
    assert order.index("queued") < len(order) - 1, order


def _hostile_objectives() -> list[str]:
    good = series(requests=5, met=5)
    histogram = {"counts": [0] * BUCKETS, "sum_s": 0.0}
    bodies: list[Any] = [
        objectives("e1", {**good, "requests": -1}),
        objectives("e1", {**good, "requests": (1 << 53) + 1}),
        objectives("e1", {**good, "admitted": 6}),  # more admitted than requests
        objectives("e1", {**good, "met": {"first_token": 9}}),  # more met than requests
        objectives("e1", good, good),  # a series twice
        objectives("e1", *(series(f"a{i}", requests=1) for i in range(257))),
        objectives("e1", {**good, "service_class": "S9"}),
        objectives("e1", {**good, "refused": {"bored": 1}}),
        objectives("e1", {**good, "ttft": {"counts": [0] * 3, "sum_s": 0.0}}),
        objectives("e1", {**good, "ttft": {**histogram, "sum_s": -1.0}}),
        objectives("e1", {**good, "ttft": {"counts": [6] + [0] * (BUCKETS - 1), "sum_s": 0}}),
        objectives("", good),
        objectives("e1", {**good, "account": ""}),
        {"epoch": "e1", "series": [], "worker_restarts": -3},
        {"epoch": "e1", "series": [], "surprise": 1},
    ]
    texts = [json.dumps({"objectives": b}) for b in bodies]
    texts.append('{"objectives": {"epoch": "e1", "series": [], "worker_restarts": NaN}}')
    texts.append(
        '{"objectives": {"epoch": "e1", "series": [{"service_class": "S1", "account": "acme",'
        ' "ttft": {"counts": [' + ", ".join(["0"] * BUCKETS) + '], "sum_s": Infinity}}]}}'
    )
    return texts


async def test_out_of_bounds_objectives_are_refused_and_change_nothing(
    aiohttp_client: AiohttpClient, fleet: tuple[HubSettings, dict[str, str]]
) -> None:
    settings, ids = fleet
    app = create_app(settings)
    client = await aiohttp_client(app)
    beats = Beats(client, app)
    await beats.send(ids["token"], objectives("e1", series(requests=5, met=5)))
    before = _totals(settings)
    for body in _hostile_objectives():
        status, answer = await node_call(client, "POST", "/v1/node/heartbeat", ids["token"], body)
        assert_refused(status, answer, body[:120])
    # A beat after them lands, and nothing they carried was counted.
    await beats.send(ids["token"], objectives("e1", series(requests=5, met=5)))
    assert _totals(settings) == before
    assert _read(settings, lambda s: s.objectives.worker_restarts_since(time.time() - 600)) == {}


# -- the store: windows, buckets, pruning, replicas ------------------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _beat(
    node_id: str, at: float, epoch: str, *many: dict[str, Any], restarts: int = 0
) -> Heartbeat:
    body = protocol.Objectives.model_validate(objectives(epoch, *many, restarts=restarts))
    return Heartbeat(node_id, at, {}, protocol.Capacity(), objectives=body)


def test_windows_buckets_and_pruning(tmp_path: Path, hub_database: HubDatabase) -> None:
    settings = settings_for(tmp_path, hub_database)
    t0 = 1_800_000_000.0  # a multiple of an hour
    assert t0 % HOUR == 0
    clock = Clock(t0)
    store = open_store(settings, clock=clock)
    try:
        store.accounts.put("acme", "S1")
        node, _ = enroll_node(store, "n1")
        # 10 requests at t0 + 1 s, 10 more at t0 + 7 min (the next five minutes), 10 more
        # 3 days later (the old five-minute buckets then pruned).
        store.heartbeats([_beat(node, t0 + 1, "e", series(requests=10, met=9, missed=1))])
        clock.now = t0 + 420
        store.heartbeats([_beat(node, t0 + 420, "e", series(requests=20, met=18, missed=2))])

        def requests(since: float, until: float) -> int:
            return sum(t.requests for t in store.objectives.totals(since, until, "class"))

        # Five-minute buckets: [t0, t0+300) holds 10, [t0+300, t0+600) holds 10.
        assert requests(t0, t0 + 300) == 10
        assert requests(t0 + 300, t0 + 600) == 20 - 10
        assert requests(t0 + 299, t0 + 301) == 20  # both overlap the window
        assert requests(t0 + 600, t0 + 900) == 0
        assert requests(t0 - 300, t0) == 0  # the bucket before ends where the first begins
        # A day: the hourly buckets.
        assert requests(t0 - 86_400 + 420, t0 + 420) == 20
        # Filters.
        assert (
            sum(
                t.requests
                for t in store.objectives.totals(t0, t0 + 600, "class", SloFilters(node="n1"))
            )
            == 20
        )
        assert store.objectives.totals(t0, t0 + 600, "class", SloFilters(account="globex")) == []

        # The series for charts: one point per five minutes.
        step, points = store.objectives.series(t0, t0 + 600, 300)
        assert step == FIVE_MINUTES
        assert [(p.start, p.counters["requests"]) for p in points] == [(t0, 10.0), (t0 + 300, 10.0)]

        clock.now = t0 + 3 * 86_400
        store.heartbeats(
            [_beat(node, clock.now, "e", series(requests=30, met=27, missed=3), restarts=2)]
        )
        # The pruning ran with the flush: the first five-minute buckets are gone, the
        # hourly ones kept.
        count = store.db.execute(
            "SELECT COUNT(*) FROM slo_buckets WHERE width = ? AND start < ?",
            [FIVE_MINUTES, clock.now - KEPT_S[FIVE_MINUTES]],
        ).fetchone()[0]
        assert count == 0
        assert requests(t0, t0 + 3600) == 20  # read from the hourly buckets
        assert requests(clock.now - 3600, clock.now + 1) == 10
        assert store.objectives.worker_restarts_since(clock.now - 600) == {node: 2}
        clock.now = t0 + 40 * 86_400
        assert store.objectives.prune(clock.now) > 0
        assert store.objectives.totals(t0 - HOUR, clock.now, "class") == []
    finally:
        store.close()


def test_a_second_replica_counts_from_the_same_cursors(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    """The cursors are in the database: a restarted hub, or another replica, takes the
    next delta from the values the first counted; a beat older than those is late and
    adds nothing."""
    settings = settings_for(tmp_path, hub_database)
    now = time.time()
    one, two = open_store(settings), open_store(settings)
    try:
        one.accounts.put("acme", "S1")
        node, _ = enroll_node(one, "n1")
        one.heartbeats([_beat(node, now, "e", series(requests=10, met=10))])
        added = two.heartbeats([_beat(node, now + 1, "e", series(requests=12, met=12))])
        assert [d.requests for d in added.series] == [2]
        late = one.heartbeats([_beat(node, now + 0.5, "e", series(requests=11, met=11))])
        assert not late
        assert sum(t.requests for t in two.objectives.totals(now - 60, now + 60, "class")) == 12
    finally:
        one.close()
        two.close()


def test_hostile_nodes_resetting_on_purpose_cannot_overflow_the_sums(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    """Up and down between 1 and the largest value, each beat counts whole, for 256
    accounts the hub does not know at once (summed as "(other)"), on five nodes: the
    buckets stop at 2**53 and the sums stay readable; the honest node's rows are
    untouched, and the flush never fails."""
    settings = settings_for(tmp_path, hub_database)
    now = time.time() // FIVE_MINUTES * FIVE_MINUTES  # every beat in one bucket
    store = open_store(settings)
    try:
        store.accounts.put("acme", "S1")
        hostile = [enroll_node(store, f"hostile{i}")[0] for i in range(5)]
        honest, _ = enroll_node(store, "honest")
        top = 1 << 53
        for i in range(4):
            value = top if i % 2 == 0 else 1
            many = [series(f"x{j}", requests=value, met=value) for j in range(256)]
            store.heartbeats(
                [
                    *(_beat(node, now + i, "e", *many) for node in hostile),
                    _beat(honest, now + i, "e", series(requests=i + 1, met=i + 1)),
                ]
            )
        rows = {t.group: t for t in store.objectives.totals(now - 60, now + 60, "node")}
        assert all(rows[f"hostile{i}"].requests == top for i in range(5))  # capped
        assert rows["honest"].requests == 4
        [fleet] = store.objectives.totals(now - 60, now + 60, "class")
        assert fleet.requests == top + 4  # the fleet's (other) row capped too, never wrapped
        by_account = {
            t.group: t.requests for t in store.objectives.totals(now - 60, now + 60, "account")
        }
        assert by_account == {"acme": 4, OTHER_ACCOUNT: top}
    finally:
        store.close()


# -- error budgets ---------------------------------------------------------------------------


def test_budget_math_against_hand_computed_numbers() -> None:
    # 99 % target, 1000 requests: a budget of 10 misses.
    assert budgets.burn_rate(5, 1000, 0.99) == pytest.approx(0.5)
    assert budgets.budget_left(5, 1000, 0.99) == pytest.approx(0.5)
    assert budgets.burn_rate(20, 1000, 0.99) == pytest.approx(2.0)
    assert budgets.budget_left(20, 1000, 0.99) == pytest.approx(-1.0)  # overspent
    assert budgets.burn_rate(0, 0, 0.99) == 0.0
    assert budgets.budget_left(0, 0, 0.99) == 1.0
    # 99.9 %: one miss in 1000 spends it exactly (burn 1 = the budget over the period).
    assert budgets.burn_rate(1, 1000, 0.999) == pytest.approx(1.0)
    assert budgets.budget_left(1, 1000, 0.999) == pytest.approx(0.0)
    assert budgets.attainment(99, 1) == pytest.approx(0.99)
    assert budgets.attainment(0, 0) is None
    assert math.isinf(budgets.burn_rate(1, 10, 1.0))

    window = [
        SloTotals("S1", "acme", 100, 96, met={"first_token": 98}, missed={"first_token": 2}),
        SloTotals("S2", "globex", 10, 10, met={"admit": 10}, missed={}),
    ]
    period = [
        SloTotals("S1", "acme", 4000, 4000, met={"first_token": 3990}, missed={"first_token": 10})
    ]
    rows = budgets.report(window, HubSettings().objectives.target, period)
    assert [(r.service_class, r.objective, r.group) for r in rows] == [
        ("S1", "first_token", "acme"),
        ("S2", "admit", "globex"),
    ]
    acme, globex = rows
    assert (acme.good, acme.bad, acme.target) == (98, 2, 0.99)
    assert acme.attainment == pytest.approx(0.98)
    assert acme.burn_rate == pytest.approx(2.0)  # 2 % missed where 1 % is allowed
    assert acme.budget_left == pytest.approx(0.75)  # 10 of 40 allowed in the period
    assert (globex.target, globex.burn_rate, globex.budget_left) == (0.999, 0.0, 1.0)


def test_quantiles_of_the_histograms() -> None:
    counts = [0] * BUCKETS
    counts[1] = 50  # (0.05, 0.1]
    counts[3] = 50  # (0.25, 0.5]
    assert quantile(counts, 0.5) == pytest.approx(0.1)
    assert quantile(counts, 0.75) == pytest.approx(0.375)
    assert quantile([0] * BUCKETS, 0.5) is None
    counts = [0] * BUCKETS
    counts[-1] = 3  # above the last bound
    assert quantile(counts, 0.99) == protocol.LATENCY_BOUNDS_S[-1]


def test_objective_settings() -> None:
    objectives_settings = HubSettings().objectives
    assert objectives_settings.windows == ["1h", "1d", "30d"]
    assert objectives_settings.budget_period_s == 30 * 86_400
    target = objectives_settings.target
    assert (target("S1", "admit"), target("S1", "first_token"), target("S1", "complete")) == (
        0.99, 0.99, 0.95,
    )  # fmt: skip
    assert target("S2", "first_token") == 0.999
    assert target("S0", "first_token") < target("S1", "first_token")
    mine = HubSettings.model_validate({"objectives": {"targets": {"S1": {"complete": 0.9}}}})
    assert mine.objectives.target("S1", "complete") == 0.9
    assert mine.objectives.target("S1", "first_token") == 0.99  # the default kept
    assert mine.objectives.target("S2", "admit") == 0.999
    bad: dict[str, Any]
    for bad in (
        {"targets": {"S1": {"admit": 1.0}}},
        {"targets": {"S1": {"admit": 0}}},
        {"targets": {"S9": {"admit": 0.5}}},
        {"windows": ["2y"]},
        {"windows": ["40d"]},
        {"windows": []},
        {"budget_period": "0d"},
    ):
        with pytest.raises(ValidationError):
            HubSettings.model_validate({"objectives": bad})


@pytest.mark.postgres
def test_two_replicas_flushing_the_same_nodes_at_once_count_each_value_once(
    tmp_path: Path, postgres: Cluster
) -> None:
    """Two stores on one PostgreSQL database (two replicas' flushers), each flushing beats
    of the same nodes in threads of their own at once, odd beats on one, even on the
    other: the cursors' locks make each value counted once, whichever commits first (a
    beat older than one counted adds nothing)."""
    settings = settings_for(tmp_path, {"database_url": postgres.create()})
    setup = open_store(settings)
    try:
        setup.accounts.put("acme", "S1")
        nodes = [enroll_node(setup, f"n{i}")[0] for i in range(40)]
    finally:
        setup.close()
    t0 = time.time()
    rounds = 30
    barrier = threading.Barrier(2)
    failed: list[BaseException] = []

    def flusher(first: int) -> None:
        store = open_store(settings)
        try:
            for k in range(first, rounds + 1, 2):
                barrier.wait(timeout=30)
                store.heartbeats(
                    [_beat(n, t0 + k, "e", series(requests=10 * k, met=9 * k, missed=k))
                     for n in nodes]
                )  # fmt: skip
        except BaseException as err:  # noqa: BLE001 - reported below
            failed.append(err)
            barrier.abort()
        finally:
            store.close()

    threads = [threading.Thread(target=flusher, args=(first,)) for first in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failed == []
    store = open_store(settings)
    try:
        rows = store.objectives.totals(t0 - 600, t0 + 600, "node")
    finally:
        store.close()
    assert {t.group: (t.requests, t.missed["first_token"]) for t in rows} == {
        f"n{i}": (10 * rounds, rounds) for i in range(40)
    }
