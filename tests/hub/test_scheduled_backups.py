"""Backups that run themselves (shared/backup_schedule.py): a real hub's backups taken on a
crontab schedule into a folder that keeps the newest N (sealed when asked), what a run
that fails leaves, when the next one is overdue; and a real hub that hears a node's report
in its heartbeat and knows its own: the `backup_overdue` alert fires for both, the
console's fleet page and alerts page show them, and /metrics has their gauges."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pyrage import x25519

from hub import backup as hub_backup
from hub.alerting import rules
from hub.api.metrics import metrics_app
from hub.app import create_app
from hub.appkeys import SCHEDULED
from hub.identity import ssl_context
from hub.state.nodes import Node
from hub.state.store import open_store
from shared import protocol, sealing
from shared.backup_archive import BackupError
from shared.backup_schedule import Scheduled
from shared.backup_settings import ScheduleSettings
from tests.console import add_user, enroll, heartbeat, open_console
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings

DAY = 86_400.0


def _at(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _scheduled(hub: HubSettings, clock: Clock, **backups: Any) -> Scheduled:
    settings = ScheduleSettings.model_validate({"schedule": "30 2 * * *", **backups})
    return Scheduled(
        settings, hub.data_dir, "hub", lambda out: hub_backup.backup(hub, out), clock=clock
    )


def _hub(tmp_path: Path) -> HubSettings:
    hub = settings_for(tmp_path)
    open_store(hub).close()
    return hub


async def test_scheduled_backups_keep_the_newest_and_say_when_one_is_overdue(
    tmp_path: Path,
) -> None:
    hub = _hub(tmp_path)
    clock = Clock(_at("2026-12-07T02:29:00+00:00"))
    scheduled = _scheduled(hub, clock, keep=2, grace_s=3600)
    # No backup yet: the first run, at 02:30, is due by 03:30.
    report = scheduled.report()
    assert report is not None
    assert (report.last_good_at, report.kept) == (None, 0)
    assert report.overdue_at == _at("2026-12-07T03:30:00+00:00")
    folder = hub.data_dir / "backups"
    for day in range(3):
        clock.now = _at("2026-12-07T02:30:00+00:00") + day * DAY
        made = await scheduled.take()
        assert made.path.name == f"kvl-hub-202612{7 + day:02d}T023000Z.tar"
        if day == 0:
            stranger = folder / "kvl-hub-notes.txt"  # not one of its names: left alone
            stranger.write_text("mine")
    kept = [k.path.name for k in scheduled.shelf.kept()]
    assert kept == ["kvl-hub-20261208T023000Z.tar", "kvl-hub-20261209T023000Z.tar"]
    assert stranger.read_text() == "mine"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / kept[-1]).stat().st_mode & 0o777 == 0o600
    report = scheduled.report()
    assert report is not None
    assert (report.kept, report.last_good_at) == (2, _at("2026-12-09T02:30:00+00:00"))
    assert report.overdue_at == _at("2026-12-10T03:30:00+00:00")
    assert rules.backup_alerts(report.overdue_at, [], report) == []
    late = rules.backup_alerts(report.overdue_at + 60, [], report)
    assert [(f.rule, f.labels, f.value) for f in late] == [
        (rules.BACKUP_OVERDUE, rules.OWN_BACKUP, 60.0)
    ]
    assert "no good backup since 2026-12-09 02:30 UTC" in late[0].summary

    # A run that fails is remembered until the next good one; the last good one stands.
    disk = {"gone": True}

    def make(out: Path) -> Any:
        if disk["gone"]:
            raise BackupError("the disk is gone")
        return hub_backup.backup(hub, out)

    broken = Scheduled(scheduled.settings, hub.data_dir, "hub", make, clock=clock)
    clock.now += DAY
    with pytest.raises(BackupError, match="the disk is gone"):
        await broken.take()
    report = broken.report()
    assert report is not None
    assert report.last_error == "the disk is gone"
    assert report.last_good_at == _at("2026-12-09T02:30:00+00:00")
    clock.now += 60
    disk["gone"] = False
    await broken.take()
    report = broken.report()
    assert report is not None
    assert (report.last_error, report.last_failed_at) == (None, None)


async def test_a_schedule_in_a_time_zone_seals_each_backup_to_its_recipient(
    tmp_path: Path,
) -> None:
    hub = _hub(tmp_path)
    identity = x25519.Identity.generate()
    clock = Clock(_at("2026-12-07T00:00:00+00:00"))
    scheduled = _scheduled(
        hub, clock, timezone="Europe/Paris", recipients=[str(identity.to_public())]
    )
    # 02:30 in Paris in December is 01:30 UTC.
    assert scheduled.next_run(clock.now) == _at("2026-12-07T01:30:00+00:00")
    clock.now = _at("2026-12-07T01:30:00+00:00")
    made = await scheduled.take()
    assert made.path.name == "kvl-hub-20261207T013000Z.tar.age"
    assert sealing.sealed_as(made.path) == "recipients"
    opened = tmp_path / "opened.tar"
    sealing.unseal(made.path, opened, identity=[str(identity)])
    restored = hub_backup.restore(settings_for(tmp_path / "elsewhere"), opened)
    assert restored.manifest.kind == "hub"


def test_backup_settings_refuse_what_is_not_a_schedule() -> None:
    for bad, said in (
        ({"schedule": "61 * * * *"}, "not a crontab line"),
        ({"schedule": "every day"}, "not a crontab line"),
        ({"timezone": "Mars/Olympus"}, "not an IANA time zone"),
        ({"recipients": ["age1nope"]}, "not an age X25519 recipient"),
        ({"recipients": ["age1" + "q" * 58], "passphrase_file": "/x"}, "recipient"),
        ({"keep": 0}, "greater than or equal to 1"),
    ):
        with pytest.raises(ValueError, match=said):
            ScheduleSettings.model_validate(bad)


async def test_the_schedule_runs_at_its_time_and_goes_on_after_a_failure(
    tmp_path: Path,
) -> None:
    """`run()`, on a clock a moment before a minute's start, with `* * * * *`: the first
    run fails (remembered); the clock is set forward to just before the next minute (as
    NTP sets one), and that minute's run succeeds."""
    hub = _hub(tmp_path)
    offset = 60 - time.time() % 60 - 0.3  # the next minute begins 0.3 s from now
    calls: list[float] = []

    def make(out: Path) -> Any:
        calls.append(time.time())
        if len(calls) == 1:
            raise BackupError("not this time")
        return hub_backup.backup(hub, out)

    settings = ScheduleSettings(schedule="* * * * *")
    scheduled = Scheduled(
        settings, hub.data_dir, "hub", make, clock=lambda: time.time() + offset, recheck_s=0.1
    )
    task = asyncio.create_task(scheduled.run())
    try:
        await until(lambda: scheduled.last_error == "not this time", "a failed run", 30)
        # The second run, a minute of this clock later: jump it there.
        offset += 60 - (time.time() + offset) % 60 - 0.2
        await until(
            lambda: len(scheduled.shelf.kept()) == 1 and scheduled.last_error is None,
            "a good run",
            30,
        )
    finally:
        task.cancel()
    assert len(calls) == 2


def _report(overdue_at: float, last_good_at: float | None) -> dict[str, Any]:
    return {
        "schedule": "30 2 * * *",
        "kept": 3,
        "last_good_at": last_good_at,
        "last_size": 1234,
        "overdue_at": overdue_at,
    }


def test_the_rule_fires_for_each_node_whose_backups_are_overdue() -> None:
    now = 1_000_000.0

    def node(name: str, backup: dict[str, Any] | None, revoked: float | None = None) -> Node:
        return Node(
            id=name, name=name, site="lab", wg_public_key="k", overlay_address="a",
            enrolled_at=0.0, last_seen=now, revoked_at=revoked,
            capacity=protocol.Capacity(
                backup=protocol.BackupReport(**backup) if backup is not None else None
            ),
        )  # fmt: skip

    nodes = [
        node("fine", _report(now + 10, now - 100)),
        node("late", _report(now - 10, now - 2 * DAY)),
        node("never", _report(now - 5, None)),
        node("unscheduled", None),
        node("gone", _report(now - 10, None), revoked=now),
    ]
    fired = {f.labels["node"]: f for f in rules.backup_alerts(now, nodes, None)}
    assert sorted(fired) == ["late", "never"]
    assert fired["late"].value == 10.0
    assert "no good backup yet" in fired["never"].summary


async def test_a_hub_alerts_on_a_nodes_overdue_backups_and_its_own_and_shows_them(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(
        tmp_path,
        alerts={"every_s": 0.2},
        backups={"schedule": "30 2 * * *", "grace_s": 60},
    )
    add_user(hub)
    app = create_app(hub)
    # The hub's own schedule, started two days ago (as if): its first run is long over.
    app[SCHEDULED].since = time.time() - 2 * DAY
    server = await aiohttp_server(app, ssl=ssl_context(hub))
    now = time.time()
    async with open_console(server, hub) as console:
        assert await console.login() == 303
        late = await enroll(console, hub, "late-1")
        fine = await enroll(console, hub, "fine-1")
        await heartbeat(console, late, backup=_report(now - 30, now - 3 * DAY))
        await heartbeat(console, fine, backup=_report(now + DAY, now - 600))

        store = open_store(hub)
        try:

            def firing() -> set[str]:
                return {
                    "=".join(next(iter(a.labels.items())))
                    for a in store.alerts.all("firing")
                    if a.rule == rules.BACKUP_OVERDUE
                }

            await until(lambda: firing() == {"node=late-1", "hub=this hub"}, "both alerts", 30)
        finally:
            store.close()

        status, page, _ = await console.get("/console/nodes")
        assert status == 200
        row = page.split('data-node="late-1"', 1)[1].split("</tr>", 1)[0]
        assert "3 d ago (overdue)" in row
        row = page.split('data-node="fine-1"', 1)[1].split("</tr>", 1)[0]
        assert "10 min ago" in row
        assert "overdue" not in row
        status, page, _ = await console.get("/console/alerts")
        own = page.split('id="own-backup"', 1)[1].split("</p>", 1)[0]
        assert "<code>30 2 * * *</code>" in own
        assert "none yet" in own
        assert "overdue" in own
    metrics = await _scrape(app)
    assert 'kvl_fleet_node_backup_overdue_timestamp_seconds{node="late-1",site="lab"}' in metrics
    assert 'kvl_fleet_node_backup_last_good_timestamp_seconds{node="fine-1",site="lab"}' in metrics
    assert 'kvl_hub_backup_overdue_timestamp_seconds{hub="this hub"}' in metrics


async def _scrape(app: web.Application) -> str:
    """The hub's /metrics, as the `metrics.listen` listener serves it."""
    async with TestClient(TestServer(metrics_app(app))) as client:
        response = await client.get("/metrics", headers={"Accept": "text/plain"})
        return await response.text()
