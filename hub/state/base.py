"""What every aggregate of the hub's store works on: the database connection (hub.state.sql:
SQLite or PostgreSQL), the clock, the serials kept in the `meta` table, and the errors
that any aggregate raises."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from hub.state import sql

# Serials kept in the `meta` table.
DESIRED_SERIAL = "desired_serial"  # moves with every change to the fleet's desired state
AUTH_REVISION = "node_auth_revision"  # moves when a node token stops being good


class ConflictError(ValueError):
    """The thing exists already."""


class NotFoundError(LookupError):
    """Nothing by that name or id. `param`: the field of the caller's request that named
    it, where one did (the model of a deployment, the account of a key)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StoreBase:
    """The connection, and the clock every write that records a time reads (tests may
    give another: no sleeping to make time pass)."""

    def __init__(self, database: sql.Database, *, clock: Callable[[], float] = time.time) -> None:
        self.db = database
        self.clock = clock

    def close(self) -> None:
        self.db.close()

    def serials(self) -> tuple[int, int]:
        """(the desired state's serial, the node authentication revision), in one read."""
        values = {
            row[0]: int(row[1])
            for row in self.db.execute(
                "SELECT key, value FROM meta WHERE key IN (?, ?)", [DESIRED_SERIAL, AUTH_REVISION]
            ).fetchall()
        }
        return values.get(DESIRED_SERIAL, 0), values.get(AUTH_REVISION, 0)

    def desired_serial(self) -> int:
        return self._serial(DESIRED_SERIAL)

    def _serial(self, key: str) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
        return 0 if row is None else int(row[0])

    def _bump(self, key: str = DESIRED_SERIAL) -> int:
        """Inside a transaction: the next value of a serial (by default the desired
        state's). One UPDATE adds one, so changes made at once by two replicas get two
        serials (the row's lock orders them), never the same one."""
        self.db.execute(
            "INSERT INTO meta (key, value) VALUES (?, '0') ON CONFLICT DO NOTHING", [key]
        )
        self.db.execute(
            "UPDATE meta SET value = CAST(CAST(value AS BIGINT) + 1 AS TEXT) WHERE key = ?", [key]
        )
        return self._serial(key)

    def _revoke(self, table: str, prefix: str, what: str) -> None:
        """Inside a transaction: revoke the active row of `prefix` (NotFoundError if none)."""
        done = self.db.execute(
            # The table name is one of the store's, never input.
            f"UPDATE {table} SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL",  # noqa: S608
            [self.clock(), prefix],
        )
        if done.rowcount == 0:
            raise NotFoundError(f"no active {what} {prefix!r}")
