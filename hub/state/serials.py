"""The serials kept in the `meta` table: the desired state's, which moves with every change
to what a node should hold, and the node authentication revision, which moves when a node
token stops being good. Every repository whose writes move one is given the one `Serials`
of its store."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hub.state import sql

DESIRED_SERIAL = "desired_serial"  # moves with every change to the fleet's desired state
AUTH_REVISION = "node_auth_revision"  # moves when a node token stops being good


class Serials:
    """The `meta` table's serials."""

    def __init__(self, database: sql.Database) -> None:
        self._db = database

    def current(self) -> tuple[int, int]:
        """(the desired state's serial, the node authentication revision), in one read."""
        values = {
            row[0]: int(row[1])
            for row in self._db.execute(
                "SELECT key, value FROM meta WHERE key IN (?, ?)", [DESIRED_SERIAL, AUTH_REVISION]
            ).fetchall()
        }
        return values.get(DESIRED_SERIAL, 0), values.get(AUTH_REVISION, 0)

    def desired(self) -> int:
        return self.read(DESIRED_SERIAL)

    def read(self, key: str) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
        return 0 if row is None else int(row[0])

    def bump(self, key: str = DESIRED_SERIAL) -> int:
        """Inside a transaction: the next value of a serial (by default the desired
        state's). One UPDATE adds one, so changes made at once by two replicas get two
        serials (the row's lock orders them), never the same one."""
        self._db.execute(
            "INSERT INTO meta (key, value) VALUES (?, '0') ON CONFLICT DO NOTHING", [key]
        )
        self._db.execute(
            "UPDATE meta SET value = CAST(CAST(value AS BIGINT) + 1 AS TEXT) WHERE key = ?", [key]
        )
        return self.read(key)
