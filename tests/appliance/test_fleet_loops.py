"""The fleet link's loops (heartbeat, sync, leases, placement) survive their own
exceptions: a round that raises is logged and counted in kvl_background_failures_total,
and the scheduler's next round does the work."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import pytest

from appliance.fleet.identity import FleetFiles
from appliance.fleet.link import FleetLink
from appliance.fleet.placement import Converger
from appliance.observability.metrics import Metrics
from appliance.state.store import AsyncStore, UsageEvent
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.state.store import open_store
from tests.conftest import NoModels, make_settings
from tests.fleet import fleet_account, provisioning
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from appliance.state.store import Account
    from hub.settings import HubSettings


async def _linked(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> tuple[HubSettings, AsyncStore, Account, FleetLink, Metrics]:
    """A hub on loopback and a fleet link to it (not started), with its store and an
    account of the fleet's."""
    hub = settings_for(tmp_path)
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    settings = make_settings(
        tmp_path / "data",
        embeddings={"enabled": False},
        fleet={"provisioning_file": str(provisioning(tmp_path, hub, hub_server.port)),
               "tunnel": False, "heartbeat_s": 1, "sync_interval_s": 0.5},
    )  # fmt: skip
    store = AsyncStore(settings.db_path)
    await store.open()
    account = await fleet_account(store)
    metrics = Metrics()
    link = FleetLink(settings.fleet, FleetFiles(settings.fleet_dir), store, metrics, NoModels())  # type: ignore[arg-type]
    return hub, store, account, link, metrics


async def test_each_link_loop_fails_once_and_goes_on(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub, store, account, link, metrics = await _linked(aiohttp_server, tmp_path)
    await store.run(
        store.sync.record_usage,
        UsageEvent(account.id, "kvl", "/v1/completions", "m", 1, 1, None, 1.0, 200, "stop"),
    )

    # The first round of each loop raises (a bug, a disk error: anything), once.
    broken = {"capacity": 1, "_usage_batch": 1}
    for name in broken:
        real = getattr(link, name)

        async def once(*args: Any, _real: Any = real, _name: str = name) -> Any:
            if broken[_name]:
                broken[_name] -= 1
                raise RuntimeError(f"{_name} broke")
            return await _real(*args)

        monkeypatch.setattr(link, name, once)

    def ledger() -> int:
        hub_store = open_store(hub)
        try:
            return hub_store.ledger.count()
        finally:
            hub_store.close()

    def heard() -> bool:
        hub_store = open_store(hub)
        try:
            return any(n.last_seen is not None for n in hub_store.nodes.all())
        finally:
            hub_store.close()

    link.start()
    try:
        await until(lambda: ledger() == 1, "the next sync round", timeout_s=20)
        await until(heard, "the next heartbeat round", timeout_s=20)
    finally:
        await link.close()
        await store.close()
    assert broken == {"capacity": 0, "_usage_batch": 0}
    assert metrics.failures.count("fleet.heartbeat") == 1
    assert metrics.failures.count("fleet.sync") == 1
    assert metrics.background_failures.labels("fleet.sync")._value.get() == 1
    assert "background loop fleet.sync failed" in caplog.text
    assert "RuntimeError: _usage_batch broke" in caplog.text  # with its traceback


async def test_a_placement_round_that_raises_is_counted_and_the_next_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AsyncStore(tmp_path / "appliance.db")
    await store.open()
    metrics = Metrics()
    converger = Converger(store, NoModels(), tmp_path / "models", failures=metrics.failures)  # type: ignore[arg-type]
    rounds: list[str] = []

    async def converge(client: Any) -> None:
        rounds.append("ran")
        if len(rounds) == 1:
            raise RuntimeError("the disk went away")

    monkeypatch.setattr(converger, "converge", converge)
    try:
        for _ in range(2):  # two heartbeats, each kicking a round
            converger.kick(None)  # type: ignore[arg-type]
            await until(
                lambda: converger._task is not None and converger._task.done(),
                "a round",
                timeout_s=20,
            )
        assert converger._task is not None
        assert converger._task.exception() is None  # the failure stayed inside its round
    finally:
        await converger.close()
        await store.close()
    assert rounds == ["ran", "ran"]
    assert metrics.failures.count("fleet.placement") == 1


async def test_a_round_in_flight_when_the_link_closes_ends_without_a_failure(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sync waiting on the hub when the process stops: the link's close ends it before it
    closes its client, and neither the scheduler nor the loop's guard reports a failure (a
    traceback on the operator's terminal at every stop, before)."""
    _, store, _, link, metrics = await _linked(aiohttp_server, tmp_path)
    waiting = asyncio.Event()

    async def hangs(*args: Any) -> Any:
        waiting.set()
        await asyncio.Event().wait()  # the hub never answers

    monkeypatch.setattr(link, "_usage_batch", hangs)
    link.start()
    try:
        await until(waiting.is_set, "a sync round waiting", timeout_s=20)
    finally:
        async with asyncio.timeout(20):
            await link.close()
        await store.close()
    assert metrics.failures.count("fleet.sync") == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], caplog.text
