"""The hub's background loops are supervised (hub/loops.py, shared.supervise): a round
that raises is logged with its traceback and counted under the loop's name, and the loop
does its next round. Each loop here runs in a real hub (real aiohttp server, real
SQLite) with the function it calls each round made to raise once; the WireGuard peer
reconciler, which needs an interface, runs on its own with its round's function
replaced."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

import hub.fleet.heartbeats
import hub.fleet.peers
import hub.reconciler
from hub.app import create_app
from hub.appkeys import BEATS, LOOPS, STORE
from hub.console.samples import sample_of
from hub.fleet.peers import reconcile_peers
from hub.reconciler import FleetSnapshots
from hub.state.console import Console, Sample
from hub.state.deployments import DeploymentRecord, ModelArtifact
from hub.state.nodes import capacity_of
from hub.state.store import AsyncHubStore, open_store
from shared import protocol
from shared.supervise import Failures
from shared.wireguard import InterfaceConfig, Tunnel, WireGuardError, generate_keypair
from tests.hubs import PREFIX, new_key, settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp.test_utils import TestServer
    from pytest_aiohttp import AiohttpServer

    from hub.planning.slo import Ingested
    from hub.settings import HubSettings
    from hub.state.nodes import Heartbeat

DEADLINE_S = 10.0
NODE_HEADERS = {protocol.PROTOCOL_HEADER: str(protocol.PROTOCOL_VERSION)}
CAPACITY = {"cpu_percent": 12.5, "memory_total_mib": 8000, "memory_available_mib": 4000}


def settings(tmp_path: Path, **more: Any) -> HubSettings:
    base = settings_for(tmp_path, {})
    return base.model_validate({**base.model_dump(), **more})


def enroll(hub_settings: HubSettings) -> tuple[str, str, str]:
    """A node (its id and token) and an operator token, straight into the store."""
    store = open_store(hub_settings)
    try:
        token = store.tokens.create("lab", uses=1, expires_in_s=60).plaintext
        node = store.nodes.enroll(
            token, name="node-a", wg_public_key=new_key(), overlay_prefix=PREFIX,
            labels={}, versions={},
        )  # fmt: skip
        operator = store.operators.create("ops").plaintext
    finally:
        store.close()
    return node.node.id, node.node_token, operator


async def heartbeat(server: TestServer, node_token: str, cpu: float = 12.5) -> None:
    async with aiohttp.ClientSession() as client:
        sent = await client.post(
            server.make_url("/v1/node/heartbeat"),
            json={"versions": {"kvl": "0.1.0"}, "capacity": {**CAPACITY, "cpu_percent": cpu}},
            headers={**NODE_HEADERS, "Authorization": f"Bearer {node_token}"},
        )
        assert sent.status == 200, await sent.text()


def logged(caplog: pytest.LogCaptureFixture, loop: str) -> list[logging.LogRecord]:
    """The records of `loop`'s failed rounds that carry their traceback."""
    return [
        r
        for r in caplog.records
        if r.name == "shared.supervise" and r.args == (loop,) and r.exc_info is not None
    ]


async def test_the_heartbeat_flusher_survives_its_write_and_its_listeners_failing(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="shared.supervise")
    monkeypatch.setattr(hub.fleet.heartbeats, "HEARTBEATS_EVERY_S", 0.05)
    hub_settings = settings(tmp_path, console={"sample_every_s": 0.5})
    node_id, node_token, operator = enroll(hub_settings)
    server = await aiohttp_server(create_app(hub_settings))
    app = server.app
    failures, store = app[LOOPS], app[STORE]

    # The write fails once: that second's heartbeats are lost, not the flusher.
    write = store.sync.heartbeats
    writes: list[int] = []

    def failing_write(beats: list[Heartbeat], counted: list[Heartbeat]) -> Ingested:
        writes.append(len(beats))
        if len(writes) == 1:
            raise RuntimeError("the disk is on fire")
        return write(beats, counted)

    monkeypatch.setattr(store.sync, "heartbeats", failing_write)

    # A listener ahead of the console's raises once (OverflowError, as a hostile number
    # once did in the sampler); the one after it and the console's still get each group.
    boomed: list[int] = []
    after: list[float] = []

    async def boom(beats: list[Heartbeat]) -> None:
        boomed.append(len(beats))
        if len(boomed) == 1:
            raise OverflowError("cannot convert float infinity to integer")

    async def later(beats: list[Heartbeat]) -> None:
        after.extend(b.at for b in beats)

    app[BEATS].listeners.insert(0, boom)
    app[BEATS].listeners.append(later)

    async def last_seen() -> float | None:
        (node,) = await store.nodes()
        return node.last_seen

    await heartbeat(server, node_token)

    async def write_failed() -> bool:
        return failures.count("heartbeats") == 1

    await until(write_failed, "the failed write counted", timeout_s=DEADLINE_S)
    assert await last_seen() is None  # lost with its round
    assert len(logged(caplog, "heartbeats")) == 1

    await heartbeat(server, node_token, cpu=50.0)

    async def written() -> bool:
        return await last_seen() is not None and len(after) == 1

    await until(
        written, "a later heartbeat written, and the last listener called", timeout_s=DEADLINE_S
    )
    assert failures.count("heartbeats.boom") == 1
    assert len(logged(caplog, "heartbeats.boom")) == 1

    # The console's listener, after the one that raised, took its sample.
    async def sampled() -> bool:
        taken = await store.run(store.sync.console.samples, node_id, 0.0)
        return [s.cpu_percent for s in taken] == [50.0]

    await until(sampled, "the console's sample of the written heartbeat", timeout_s=DEADLINE_S)

    # And the rounds go on: the next heartbeat is written, every listener called.
    first = await last_seen()
    await heartbeat(server, node_token, cpu=60.0)

    async def again() -> bool:
        return await last_seen() != first and len(after) == 2

    await until(again, "the next heartbeat written", timeout_s=DEADLINE_S)
    assert (len(writes), boomed[-1], failures.count("heartbeats")) == (3, 1, 1)

    # The operator API shows the loops and their failures.
    async with aiohttp.ClientSession() as client:
        refused = await client.get(server.make_url("/v1/admin/loops"))
        assert refused.status == 401
        answer = await client.get(
            server.make_url("/v1/admin/loops"), headers={"Authorization": f"Bearer {operator}"}
        )
        assert answer.status == 200
        report = await answer.json()
    assert {"heartbeats", "placement", "console.prune"} <= set(report["running"])
    assert report["stopped"] == []
    assert report["failures"]["heartbeats"]["failures"] == 1
    assert report["failures"]["heartbeats"]["last_error"] == "RuntimeError: the disk is on fire"
    assert report["failures"]["heartbeats.boom"]["last_error"].startswith("OverflowError")


def test_a_stored_capacity_the_protocol_refuses_is_sampled_as_empty() -> None:
    """1e400 is valid JSON and parses as infinity, which int() refuses. The protocol
    refuses such a heartbeat; a row an older hub stored with one reads as an empty
    capacity, and the sampler's listener does not fail on it."""
    stored = '{"memory_total_mib": 1e400, "cpu_percent": NaN, "queue_waiting": -3}'
    sample = sample_of(1.0, capacity_of(stored))
    assert sample == Sample(1.0, 0.0, 0, 0, 0, 0, 0)


async def test_the_placement_reconciler_places_after_a_failed_round(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="shared.supervise")
    monkeypatch.setattr(hub.fleet.heartbeats, "HEARTBEATS_EVERY_S", 0.05)
    hub_settings = settings(tmp_path, fleet={"placement_every_s": 0.1})
    node_id, node_token, _ = enroll(hub_settings)
    store = open_store(hub_settings)
    try:
        store.deployments.add_model(ModelArtifact("m", "1", "ab" * 32, 10, "gguf", 600))
        store.deployments.add(DeploymentRecord("d1", "m@1", 1, "S1", "I1", {}))
    finally:
        store.close()

    plan = hub.reconciler.plan_once
    rounds: list[float] = []

    def failing_plan(*args: Any, **kwargs: Any) -> Any:
        rounds.append(time.monotonic())
        if len(rounds) == 1:
            raise RuntimeError("a bug in the planner")
        return plan(*args, **kwargs)

    monkeypatch.setattr(hub.reconciler, "plan_once", failing_plan)
    server = await aiohttp_server(create_app(hub_settings))
    failures, running = server.app[LOOPS], server.app[STORE]

    async def failed() -> bool:
        return failures.count("placement") == 1

    await until(
        failed, "the failed round counted", timeout_s=DEADLINE_S
    )  # the first round runs at start
    assert len(logged(caplog, "placement")) == 1
    await heartbeat(server, node_token)  # the node is seen: now it can be given the model

    async def placed() -> bool:
        return await running.run(running.sync.deployments.placements) == [("d1", node_id, None)]

    await until(placed, "the deployment placed by a later round", timeout_s=DEADLINE_S)
    assert failures.count("placement") == 1
    assert len(rounds) >= 2


async def test_the_console_pruner_prunes_after_a_failed_round(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="shared.supervise")
    hub_settings = settings(tmp_path, console={"sample_every_s": 0.5, "samples_kept_s": 60})
    node_id, _, _ = enroll(hub_settings)
    store = open_store(hub_settings)
    try:  # a sample from long ago, for the pruner to delete
        store.console.record_samples([(node_id, Sample(1.0, 1, 1, 1, 1, 1, 1))])
    finally:
        store.close()

    prune = Console.prune
    calls: list[float] = []

    def failing_prune(console: Console, *, now: float, samples_before: float) -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("the samples table is locked")
        prune(console, now=now, samples_before=samples_before)

    monkeypatch.setattr(Console, "prune", failing_prune)
    server = await aiohttp_server(create_app(hub_settings))
    failures, running = server.app[LOOPS], server.app[STORE]

    async def pruned() -> bool:
        return await running.run(running.sync.console.samples, node_id, 0.0) == []

    await until(pruned, "the old sample deleted by a later round", timeout_s=DEADLINE_S)
    assert failures.count("console.prune") == 1
    assert len(logged(caplog, "console.prune")) == 1
    assert len(calls) >= 2


async def test_the_peer_reconciler_goes_on_after_a_failed_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(hub.fleet.peers, "PEERS_EVERY_S", 0.01)
    store = AsyncHubStore(settings(tmp_path))
    await store.open()
    # Never brought up: its rounds are replaced below (the netns tests run real ones).
    tunnel = Tunnel(
        InterfaceConfig(
            "kvl-loops", generate_keypair().private_key, (ipaddress.ip_interface("10.9.0.1/24"),)
        )
    )
    rounds: list[object] = []
    third = asyncio.Event()

    async def sync_peers(given_store: AsyncHubStore, given_tunnel: Tunnel) -> None:
        assert (given_store, given_tunnel) == (store, tunnel)
        rounds.append(None)
        if len(rounds) == 1:
            raise RuntimeError("a bug in a round")
        if len(rounds) == 2:
            raise WireGuardError("wireguard-go is restarting")
        third.set()

    monkeypatch.setattr(hub.fleet.peers, "sync_peers", sync_peers)
    failures = Failures()
    task = asyncio.create_task(reconcile_peers(store, tunnel, failures))
    try:
        await asyncio.wait_for(third.wait(), DEADLINE_S)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.close()
    # Both failures counted; the bug with its traceback, the interface's refusal without.
    assert failures.count("peers") == 2
    assert failures.report()["peers"]["last_error"] == "WireGuardError: wireguard-go is restarting"
    assert len(logged(caplog, "peers")) == 1
    assert any("wireguard-go is restarting" in r.getMessage() for r in caplog.records)


def test_one_hostile_row_does_not_fail_the_fleets_placement(tmp_path: Path) -> None:
    """Capacity rows written before the protocol bounded heartbeats may hold anything: a
    negative or infinite memory, a GPU list that is a string. Each counts as nothing, and
    the snapshot of the whole fleet (which a raise would fail for every node) is read."""
    store = open_store(settings(tmp_path))
    try:
        token = store.tokens.create("lab", uses=3, expires_in_s=60).plaintext
        ids = [
            store.nodes.enroll(
                token, name=f"n{i}", wg_public_key=new_key(), overlay_prefix=PREFIX,
                labels={}, versions={},
            ).node.id
            for i in range(3)
        ]  # fmt: skip
        rows = [
            {"memory_total_mib": -5, "gpus": "many"},
            {"model_memory_mib": 1e400, "gpus": [{"name": "g", "memory_total_mib": "lots"}]},
            [1, 2, 3],
        ]
        for node_id, capacity in zip(ids, rows, strict=True):
            store.db.execute(
                "UPDATE nodes SET capacity = ? WHERE id = ?", [json.dumps(capacity), node_id]
            )
        snapshots = {n.id: n for n in FleetSnapshots().read(store)}
    finally:
        store.close()
    assert [snapshots[i].memory_mib for i in ids] == [0, 0, 0]
    assert [len(snapshots[i].gpus) for i in ids] == [0, 0, 0]
