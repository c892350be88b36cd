"""The console's SQL: its users and sessions, the node samples its charts draw, and the
reads of hub tables the pages show. Functions of the hub's store (`store.db`), run on its
one writer thread: `await store.run(users_create, store.sync, ...)`. The SQL is the subset
SQLite and PostgreSQL both run (hub.state.sql); `"user"` is quoted, as PostgreSQL reserves it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hub.state.store import ConflictError, NotFoundError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from hub.state.store import Heartbeat, HubStore, Quota
    from shared import protocol


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


# -- users ------------------------------------------------------------------------------


def create_user(store: HubStore, name: str, password_hash: str, now: float) -> None:
    added = store.db.execute(
        "INSERT INTO console_users (name, hash, created_at, disabled) VALUES (?, ?, ?, 0)"
        " ON CONFLICT DO NOTHING",
        [name, password_hash, now],
    ).rowcount
    if added == 0:
        raise ConflictError(f"console user {name!r} exists already")


def users(store: HubStore) -> list[User]:
    rows = store.db.execute(
        "SELECT name, created_at, disabled FROM console_users ORDER BY name"
    ).fetchall()
    return [User(r[0], float(r[1]), bool(r[2])) for r in rows]


def password_hash(store: HubStore, name: str) -> str | None:
    """The argon2 hash of an enabled user's password; None for anyone else."""
    row = store.db.execute(
        "SELECT hash FROM console_users WHERE name = ? AND disabled = 0", [name]
    ).fetchone()
    return None if row is None else str(row[0])


def set_password_hash(store: HubStore, name: str, new_hash: str, *, end_sessions: bool) -> None:
    """Store a user's new hash; with `end_sessions`, every login of theirs ends."""
    with store.db.transaction():
        done = store.db.execute(
            "UPDATE console_users SET hash = ? WHERE name = ?", [new_hash, name]
        )
        if done.rowcount == 0:
            raise NotFoundError(f"no console user {name!r}")
        if end_sessions:
            store.db.execute('DELETE FROM console_sessions WHERE "user" = ?', [name])


def delete_user(store: HubStore, name: str) -> None:
    """Remove a user and end their sessions."""
    with store.db.transaction():
        store.db.execute('DELETE FROM console_sessions WHERE "user" = ?', [name])
        done = store.db.execute("DELETE FROM console_users WHERE name = ?", [name])
        if done.rowcount == 0:
            raise NotFoundError(f"no console user {name!r}")


# -- sessions ---------------------------------------------------------------------------


def create_session(
    store: HubStore, id_hash: str, user: str, csrf: str, *, now: float, expires_at: float
) -> None:
    store.db.execute(
        'INSERT INTO console_sessions (id_hash, "user", csrf, created_at, expires_at)'
        " VALUES (?, ?, ?, ?, ?)",
        [id_hash, user, csrf, now, expires_at],
    )


def session(store: HubStore, id_hash: str, now: float) -> Session | None:
    """The live session of that hash: unexpired, its user present and enabled."""
    row = store.db.execute(
        'SELECT s."user", s.csrf, s.expires_at FROM console_sessions s'
        ' JOIN console_users u ON u.name = s."user"'
        " WHERE s.id_hash = ? AND s.expires_at > ? AND u.disabled = 0",
        [id_hash, now],
    ).fetchone()
    return None if row is None else Session(str(row[0]), str(row[1]), float(row[2]))


def delete_session(store: HubStore, id_hash: str) -> None:
    store.db.execute("DELETE FROM console_sessions WHERE id_hash = ?", [id_hash])


# -- node samples -----------------------------------------------------------------------


def sample_of(at: float, capacity: protocol.Capacity) -> Sample:
    """A sample from a heartbeat: its time and the capacity it reported (validated when it
    arrived: finite, bounded, non-negative numbers)."""
    return Sample(
        at=at,
        cpu_percent=capacity.cpu_percent,
        memory_used_mib=capacity.memory_total_mib - capacity.memory_available_mib,
        memory_total_mib=capacity.memory_total_mib,
        queue_waiting=capacity.queue_waiting,
        outbox_lag=capacity.outbox_lag,
        models=len(capacity.models),
    )


class Sampler:
    """Which heartbeats become samples: a node's first one here, then one each `every_s`.
    It sees the heartbeats as the flusher writes them (hub/fleet/heartbeats.py), so sampling
    never reads the fleet back; each replica samples the nodes that call it."""

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._last: dict[str, float] = {}  # node id -> the time of its last sample

    def due(self, beats: Iterable[Heartbeat]) -> list[tuple[str, Sample]]:
        taken = []
        for beat in beats:
            last = self._last.get(beat.node_id)
            if last is not None and beat.at - last < self._every_s:
                continue
            self._last[beat.node_id] = beat.at
            taken.append((beat.node_id, sample_of(beat.at, beat.capacity)))
        return taken


def record_samples(store: HubStore, samples: Iterable[tuple[str, Sample]]) -> None:
    """Store (node id, sample) pairs; a sample already stored is kept once."""
    with store.db.transaction():
        store.db.executemany(
            "INSERT INTO node_samples (node_id, at, cpu_percent, memory_used_mib,"
            " memory_total_mib, queue_waiting, outbox_lag, models) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [(node_id, s.at, s.cpu_percent, s.memory_used_mib, s.memory_total_mib,
              s.queue_waiting, s.outbox_lag, s.models) for node_id, s in samples],
        )  # fmt: skip


def samples(store: HubStore, node_id: str, since: float) -> list[Sample]:
    rows = store.db.execute(
        "SELECT at, cpu_percent, memory_used_mib, memory_total_mib, queue_waiting, outbox_lag,"
        " models FROM node_samples WHERE node_id = ? AND at >= ? ORDER BY at",
        [node_id, since],
    ).fetchall()
    return [Sample(*r) for r in rows]


def prune(store: HubStore, *, now: float, samples_before: float) -> None:
    """Delete expired sessions and samples older than `samples_before`."""
    with store.db.transaction():
        store.db.execute("DELETE FROM console_sessions WHERE expires_at <= ?", [now])
        store.db.execute("DELETE FROM node_samples WHERE at < ?", [samples_before])


# -- what the pages read ----------------------------------------------------------------


def node_events(store: HubStore, node_id: str, limit: int) -> list[dict[str, Any]]:
    """The node's latest events in the ledger, newest first."""
    rows = store.db.execute(
        "SELECT event_id, kind, received_at, account, tokens FROM ledger WHERE node_id = ?"
        " ORDER BY received_at DESC LIMIT ?",
        [node_id, limit],
    ).fetchall()
    keys = ("event_id", "kind", "received_at", "account", "tokens")
    return [dict(zip(keys, r, strict=True)) for r in rows]


def api_keys(store: HubStore) -> list[dict[str, Any]]:
    """Every fleet API key (prefix, account, admin, created, revoked), never its hash."""
    rows = store.db.execute(
        "SELECT prefix, account, admin, created_at, revoked_at FROM api_keys"
        " ORDER BY account, created_at"
    ).fetchall()
    return [
        {"prefix": r[0], "account": r[1], "admin": bool(r[2]), "created_at": r[3],
         "revoked_at": r[4]}
        for r in rows
    ]  # fmt: skip


def accounts_with_quota(store: HubStore, now: float) -> list[tuple[dict[str, Any], Quota | None]]:
    """Every account with its budget this period (None: it has none)."""
    return [(account, store.quota(account["name"], now)) for account in store.accounts()]


def packages(store: HubStore, limit: int) -> list[dict[str, Any]]:
    """The packages the fleet reported, newest first, with how many nodes hold each."""
    rows = store.db.execute(
        "SELECT p.id, p.version, p.title, p.topic, p.level, p.items, p.size, p.origin_node,"
        " p.created_at, p.received_at, p.bundle_sha256,"
        " (SELECT COUNT(*) FROM package_copies c"
        "  WHERE c.package_id = p.id AND c.version = p.version)"
        " FROM packages p ORDER BY p.received_at DESC, p.id LIMIT ?",
        [limit],
    ).fetchall()
    keys = ("id", "version", "title", "topic", "level", "items", "size", "origin_node",
            "created_at", "received_at", "bundle_sha256", "copies")  # fmt: skip
    return [dict(zip(keys, r, strict=True)) for r in rows]
