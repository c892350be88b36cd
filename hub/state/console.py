"""The console's own tables: its users and their sessions, and the node samples its charts
draw (hub/console/ decides what is sampled and when). `"user"` is quoted, as PostgreSQL
reserves it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hub.state.errors import ConflictError, NotFoundError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from hub.state import sql


@dataclass(frozen=True)
class User:
    name: str
    created_at: float
    disabled: bool


@dataclass(frozen=True)
class Session:
    user: str
    csrf: str
    expires_at: float


@dataclass(frozen=True)
class Sample:
    at: float
    cpu_percent: float
    memory_used_mib: int
    memory_total_mib: int
    queue_waiting: int
    outbox_lag: int
    models: int


class Console:
    """The `console_users`, `console_sessions` and `node_samples` tables."""

    def __init__(self, database: sql.Database) -> None:
        self._db = database

    # -- users --------------------------------------------------------------------------

    def add_user(self, name: str, password_hash: str, now: float) -> None:
        added = self._db.execute(
            "INSERT INTO console_users (name, hash, created_at, disabled) VALUES (?, ?, ?, 0)"
            " ON CONFLICT DO NOTHING",
            [name, password_hash, now],
        ).rowcount
        if added == 0:
            raise ConflictError(f"console user {name!r} exists already")

    def users(self) -> list[User]:
        rows = self._db.execute(
            "SELECT name, created_at, disabled FROM console_users ORDER BY name"
        ).fetchall()
        return [User(r[0], float(r[1]), bool(r[2])) for r in rows]

    def password_hash(self, name: str) -> str | None:
        """The argon2 hash of an enabled user's password; None for anyone else."""
        row = self._db.execute(
            "SELECT hash FROM console_users WHERE name = ? AND disabled = 0", [name]
        ).fetchone()
        return None if row is None else str(row[0])

    def set_password_hash(self, name: str, new_hash: str, *, end_sessions: bool) -> None:
        """Store a user's new hash; with `end_sessions`, every login of theirs ends."""
        with self._db.transaction():
            done = self._db.execute(
                "UPDATE console_users SET hash = ? WHERE name = ?", [new_hash, name]
            )
            if done.rowcount == 0:
                raise NotFoundError(f"no console user {name!r}")
            if end_sessions:
                self._db.execute('DELETE FROM console_sessions WHERE "user" = ?', [name])

    def delete_user(self, name: str) -> None:
        """Remove a user and end their sessions."""
        with self._db.transaction():
            self._db.execute('DELETE FROM console_sessions WHERE "user" = ?', [name])
            done = self._db.execute("DELETE FROM console_users WHERE name = ?", [name])
            if done.rowcount == 0:
                raise NotFoundError(f"no console user {name!r}")

    # -- sessions -----------------------------------------------------------------------

    def add_session(
        self, id_hash: str, user: str, csrf: str, *, now: float, expires_at: float
    ) -> None:
        self._db.execute(
            'INSERT INTO console_sessions (id_hash, "user", csrf, created_at, expires_at)'
            " VALUES (?, ?, ?, ?, ?)",
            [id_hash, user, csrf, now, expires_at],
        )

    def session(self, id_hash: str, now: float) -> Session | None:
        """The live session of that hash: unexpired, its user present and enabled."""
        row = self._db.execute(
            'SELECT s."user", s.csrf, s.expires_at FROM console_sessions s'
            ' JOIN console_users u ON u.name = s."user"'
            " WHERE s.id_hash = ? AND s.expires_at > ? AND u.disabled = 0",
            [id_hash, now],
        ).fetchone()
        return None if row is None else Session(str(row[0]), str(row[1]), float(row[2]))

    def delete_session(self, id_hash: str) -> None:
        self._db.execute("DELETE FROM console_sessions WHERE id_hash = ?", [id_hash])

    # -- node samples -------------------------------------------------------------------

    def record_samples(self, samples: Iterable[tuple[str, Sample]]) -> None:
        """Store (node id, sample) pairs; a sample already stored is kept once."""
        with self._db.transaction():
            self._db.executemany(
                "INSERT INTO node_samples (node_id, at, cpu_percent, memory_used_mib,"
                " memory_total_mib, queue_waiting, outbox_lag, models)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [(node_id, s.at, s.cpu_percent, s.memory_used_mib, s.memory_total_mib,
                  s.queue_waiting, s.outbox_lag, s.models) for node_id, s in samples],
            )  # fmt: skip

    def samples(self, node_id: str, since: float) -> list[Sample]:
        rows = self._db.execute(
            "SELECT at, cpu_percent, memory_used_mib, memory_total_mib, queue_waiting,"
            " outbox_lag, models FROM node_samples WHERE node_id = ? AND at >= ? ORDER BY at",
            [node_id, since],
        ).fetchall()
        return [Sample(*r) for r in rows]

    def prune(self, *, now: float, samples_before: float) -> None:
        """Delete expired sessions and samples older than `samples_before`."""
        with self._db.transaction():
            self._db.execute("DELETE FROM console_sessions WHERE expires_at <= ?", [now])
            self._db.execute("DELETE FROM node_samples WHERE at < ?", [samples_before])
