"""Backups that run themselves, the hub's and the appliance's alike: on a crontab schedule
(apscheduler's cron trigger, in a time zone the settings name), into a folder that keeps
the newest N, sealed with age when the settings say so (shared/sealing.py).

The folder is the record: an archive is renamed into it only once whole, named by the
moment it was taken (`kvl-appliance-20261207T023000Z.tar.age`), so the last good backup
is the newest name there, after a restart too. A failure is remembered until the next
good one, and logged. What the schedule promises is `overdue_at`: when the scheduled run
after the last good backup (or after the schedule started, with none yet) should have
ended, `grace_s` after it began; past it, the hub alerts (`backup_overdue`), for each node
from its heartbeat (`protocol.BackupReport`) and for itself.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared import protocol, sealing
from shared.backup_archive import BackupError, Kind

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from shared.backup_archive import Made
    from shared.backup_settings import ScheduleSettings

log = logging.getLogger(__name__)

FOLDER = "backups"  # under the data directory, unless the settings name another
_STAMP = "%Y%m%dT%H%M%SZ"
_NAME = re.compile(r"^kvl-(hub|appliance)-(\d{8}T\d{6}Z)(\.tar|\.tar\.age|\.age\.tar)$")
# The clock is read again at least this often while a run is awaited: it may be set (by
# NTP after a boot without a clock, say), and a run is due by the clock, not by a timer.
RECHECK_S = 60.0


@dataclass(frozen=True)
class Kept:
    """A backup in the folder."""

    path: Path
    created_at: float
    size: int


class Shelf:
    """The folder the scheduled backups of one kind are kept in."""

    def __init__(self, folder: Path, kind: Kind) -> None:
        self.folder = folder
        self.kind = kind

    def kept(self) -> list[Kept]:
        """Its backups, oldest first (names another program wrote are left alone)."""
        if not self.folder.is_dir():
            return []
        found = []
        for path in self.folder.iterdir():
            match = _NAME.match(path.name)
            if match is None or match.group(1) != self.kind or not path.is_file():
                continue
            taken = datetime.datetime.strptime(match.group(2), _STAMP).replace(tzinfo=datetime.UTC)
            found.append(Kept(path, taken.timestamp(), path.stat().st_size))
        return sorted(found, key=lambda k: (k.created_at, k.path.name))

    def name(self, created_at: float, suffix: str) -> Path:
        stamp = time.strftime(_STAMP, time.gmtime(created_at))
        return self.folder / f"kvl-{self.kind}-{stamp}{suffix}"

    def prune(self, keep: int) -> list[Path]:
        """The oldest removed, `keep` left; those removed."""
        kept = self.kept()
        removed = [k.path for k in kept[: max(0, len(kept) - keep)]]
        for path in removed:
            path.unlink(missing_ok=True)
        return removed


class Scheduled:
    """A side's scheduled backups: `take()` one now (what the schedule runs), `report()`
    how they go, `run()` the schedule (a task: cancel it to stop)."""

    def __init__(
        self,
        settings: ScheduleSettings,
        data_dir: Path,
        kind: Kind,
        make: Callable[[Path], Made],
        *,
        lock: asyncio.Lock | None = None,
        clock: Callable[[], float] = time.time,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self.settings = settings
        self._recheck_s = recheck_s
        self.shelf = Shelf(settings.folder or data_dir / FOLDER, kind)
        self._make = make
        self._lock = lock or asyncio.Lock()
        self._clock = clock
        self._trigger = settings.trigger()
        self.since = clock()  # when the schedule started: a first backup is due after it
        self.last_error: str | None = None
        self.last_failed_at: float | None = None

    @property
    def scheduled(self) -> bool:
        return self._trigger is not None

    def next_run(self, after: float) -> float | None:
        """When the schedule runs next after `after` (unix seconds)."""
        if self._trigger is None:
            return None
        # Strictly after: the trigger gives the first run at or after a moment, rounded up
        # to its second (a run at `after` itself is the one that was).
        moment = datetime.datetime.fromtimestamp(after + 0.001, datetime.UTC)
        fire = self._trigger.get_next_fire_time(None, moment)
        return None if fire is None else fire.timestamp()

    def report(self) -> protocol.BackupReport | None:
        """How the scheduled backups go; None without a schedule."""
        if self._trigger is None:
            return None
        kept = self.shelf.kept()
        last = kept[-1] if kept else None
        base = max(last.created_at if last else 0.0, self.since)
        due = self.next_run(base)
        return protocol.BackupReport(
            schedule=self.settings.schedule or "",
            timezone=self.settings.timezone,
            kept=len(kept),
            last_good_at=last.created_at if last else None,
            last_size=last.size if last else 0,
            last_error=self.last_error,
            last_failed_at=self.last_failed_at,
            overdue_at=(due if due is not None else base) + self.settings.grace_s,
        )

    async def take(self) -> Kept:
        """A backup now, into the folder, the oldest beyond `keep` removed; a failure is
        remembered (and raised) until the next good one."""
        async with self._lock:
            try:
                kept = await asyncio.to_thread(self._take)
            except (BackupError, OSError) as err:
                self.last_error = str(err)[:1000]
                self.last_failed_at = self._clock()
                log.warning("the scheduled %s backup failed: %s", self.shelf.kind, err)
                raise
        self.last_error = self.last_failed_at = None
        return kept

    def _take(self) -> Kept:
        self.shelf.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        seal = self.settings.sealing()
        created = float(int(self._clock()))  # to the second, as its name keeps it
        out = self.shelf.name(created, seal.suffix if seal else ".tar")
        sealing.write_sealed(out, seal, self._make)
        for path in self.shelf.prune(self.settings.keep):
            log.info("removed %s (backups.keep: %d)", path, self.settings.keep)
        return Kept(out, created, out.stat().st_size)

    async def run(self) -> None:
        """The schedule, until cancelled: each run at its time (a run missed while the
        process was down is not made up: the next one is due, and the report says so)."""
        at = self.next_run(self._clock())
        while at is not None:
            left = at - self._clock()
            if left > 0:
                await asyncio.sleep(min(left, self._recheck_s))
                continue
            try:
                made = await self.take()
            except (BackupError, OSError):
                pass  # remembered and logged; the next run is due
            except Exception as err:  # a bug: said, remembered, and the schedule goes on
                log.exception("the scheduled %s backup failed", self.shelf.kind)
                self.last_error, self.last_failed_at = repr(err)[:1000], self._clock()
            else:
                log.info("scheduled backup %s (%d bytes)", made.path, made.size)
            at = self.next_run(max(at, self._clock()))
