"""The appliance's store in a backup and after a restore (appliance/backup.py has the
rest): a consistent copy of `appliance.db` while the appliance serves, and what a restored
store changes before it serves again, so that nothing the hub counts is counted twice.

- The outbox stays as it was: every event after its checkpoints is sent again, and the
  hub's ledger is unique on the event id, so one the hub holds already is acknowledged
  and not stored twice.
- The live objectives start a new epoch from zero. A restored node's cumulative counters
  are back at the backup's values, lower than what the hub last counted in the same
  epoch: the hub would take that for a reset and count them whole, a second time. In a
  new epoch the hub counts what the node counts from now on, once; worker restarts are
  counted from the restore on for the same reason.
- Quota leases are dropped, not resumed: the spend the node would sum for them lacks what
  it served after the backup, so it could overrun them. It asks for new ones; the hub
  keeps the old ones outstanding until they expire, which never lets the fleet overspend.
- The desired-state serial is forgotten: the next heartbeat pulls the hub's state whole.
"""

from __future__ import annotations

import datetime
import sqlite3
import uuid
from typing import TYPE_CHECKING

from appliance.state.migrations import migrations
from appliance.state.store import RESTARTS_COUNTED_AFTER
from shared import db

if TYPE_CHECKING:
    from pathlib import Path

    from appliance.state.store import Store

# The serials and checkpoints a backup records (what a restore starts from).
RECORDED = ("desired_serial", "sync_checkpoint", "events_checkpoint")
# Each stream of the outbox: its table, and the key of its checkpoint in `meta`.
_CHECKPOINTS = (("usage_events", "sync_checkpoint"), ("outbox_events", "events_checkpoint"))


def known_migrations() -> list[str]:
    return db.known_migrations(migrations)


def sqlite_migrations(path: Path) -> list[str]:
    return db.applied_migrations(path, migrations)


def snapshot(source: Path, target: Path) -> tuple[list[str], dict[str, int]]:
    """A consistent copy of the appliance's database, taken while it serves; the copy's
    schema migrations, serial and outbox checkpoints."""
    db.snapshot(source, target)
    conn = sqlite3.connect(f"{target.resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT key, value FROM meta WHERE key IN (?, ?, ?)", list(RECORDED)
        ).fetchall()
    finally:
        conn.close()
    return sqlite_migrations(target), {str(k): int(v) for k, v in rows}


def after_restore(store: Store) -> str:
    """The restored store made ready to serve (the module's note says why); the new
    objectives epoch."""
    epoch = uuid.uuid4().hex
    with db.transaction(store.db):
        store.db.execute("UPDATE meta SET value = ? WHERE key = 'objectives_epoch'", [epoch])
        store.db.execute("DELETE FROM objectives")
        store.db.execute(
            "INSERT INTO meta (key, value)"
            " VALUES (?, (SELECT CAST(COALESCE(MAX(id), 0) AS TEXT) FROM worker_restarts))"
            " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            [RESTARTS_COUNTED_AFTER],
        )
        store.db.execute("DELETE FROM leases")
        store.db.execute("DELETE FROM meta WHERE key = 'desired_serial'")
    return epoch


def resend_since(store: Store, since: datetime.datetime) -> int:
    """Move the outbox's checkpoints back before the first event recorded at `since` or
    later, so the link sends every one of them again (the hub stores those it lacks, once:
    its ledger is unique on the event id); never forward. How many events the outbox now
    holds."""
    at = since.astimezone(datetime.UTC).isoformat(timespec="microseconds")
    with db.transaction(store.db):
        for table, key in _CHECKPOINTS:
            store.db.execute(
                "INSERT INTO meta (key, value) VALUES (?, '0') ON CONFLICT(key) DO NOTHING", [key]
            )
            store.db.execute(
                # The table is one of the two above, never input.
                f"UPDATE meta SET value = CAST(MIN(CAST(value AS INTEGER),"  # noqa: S608
                f" (SELECT COALESCE(MAX(rowid), 0) FROM {table} WHERE created_at < ?)) AS TEXT)"
                " WHERE key = ?",
                [at, key],
            )
    return store.outbox_lag()
