"""The hub's store: enrollment tokens, the node registry and the ledger. The only hub
module that writes SQL (with the console's, hub/console/store.py); one connection on one
writer thread per process (shared.db.AsyncStore).

The same statements run on SQLite (the default: one file, one writer) and on PostgreSQL
(`database_url`: several hub replicas on one database) through shared.sql. What must stay
right when replicas write at once is made so by the database, never by a lock in this
process: a single-use token is spent by a conditional UPDATE whose row count says whether
it was; an overlay address is taken by an INSERT that a UNIQUE index lets win once; a
ledger event is stored by an INSERT … ON CONFLICT DO NOTHING whose row count says whether
it was new; lease grants of an account take its row FOR UPDATE first (on SQLite a
transaction is BEGIN IMMEDIATE, which already lets one writer in at a time)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from hub.planning.quota import Budget, LeaseView, Sizing, grant, remaining
from hub.state import postgres
from hub.state.migrations import migrations
from shared import db, protocol, sql
from shared.keys import (
    ENROLLMENT_TOKEN,
    NODE_TOKEN,
    OPERATOR_TOKEN,
    NewKey,
    generate_key,
    hash_key,
    key_matches,
    parse_prefix,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from hub.settings import HubSettings

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

# Serials kept in the `meta` table.
DESIRED_SERIAL = "desired_serial"  # moves with every change to the fleet's desired state
AUTH_REVISION = "node_auth_revision"  # moves when a node token stops being good


class TokenProblem(StrEnum):
    """Why an enrollment token was refused."""

    unknown = "unknown"
    used = "used"
    expired = "expired"
    revoked = "revoked"


class TokenRefusedError(Exception):
    def __init__(self, problem: TokenProblem, prefix: str | None) -> None:
        what = {
            TokenProblem.unknown: "is not a token this hub issued",
            TokenProblem.used: "was already used",
            TokenProblem.expired: "has expired",
            TokenProblem.revoked: "was revoked",
        }[problem]
        super().__init__(
            f"the enrollment token {prefix or ''} {what}; create a new one with "
            "`kvl hub tokens create --site SITE`".replace("  ", " ")
        )
        self.problem = problem


class ForeignAccountError(Exception):
    """A node reported usage of, or asked a lease for, an account it does not serve."""

    def __init__(self, message: str, account: str) -> None:
        super().__init__(message)
        self.account = account


class ForeignLeaseError(Exception):
    """A node reported a lease the hub granted to another node."""

    def __init__(self, message: str, lease_id: str) -> None:
        super().__init__(message)
        self.lease_id = lease_id


class AddressPoolExhaustedError(Exception):
    pass


class ConflictError(ValueError):
    """The thing exists already."""


class NotFoundError(LookupError):
    pass


@dataclass(frozen=True)
class EnrollmentToken:
    prefix: str
    site: str
    uses_left: int
    expires_at: float
    created_at: float
    revoked_at: float | None

    def state(self, now: float) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.uses_left <= 0:
            return "used"
        if now >= self.expires_at:
            return "expired"
        return "active"


@dataclass(frozen=True)
class Node:
    id: str
    name: str
    site: str
    wg_public_key: str
    overlay_address: str
    enrolled_at: float
    last_seen: float | None
    revoked_at: float | None
    labels: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    capacity: protocol.Capacity = field(default_factory=protocol.Capacity)
    address: str | None = None  # where its heartbeats come from
    draining: bool = False  # the operator drains it: its replicas move away

    @property
    def api_url(self) -> str | None:
        """The node's LAN API as the hub reaches it (its heartbeats name port and TLS)."""
        api = self.capacity.api
        if self.address is None or api is None:
            return None
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{'https' if api.tls else 'http'}://{host}:{api.port}"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class Enrolled:
    node: Node
    node_token: str  # shown once, to the node


class AlreadyEnrolledError(Exception):
    """A node with this WireGuard key is enrolled already, and this is not a retry of
    that enrollment (another token, or too late)."""


# An enrollment whose answer was lost may be sent again, with the same token and key, for
# this long: it gets the same node, with a new node token (the first was never received).
ENROLL_RETRY_S = 600.0


def open_database(settings: HubSettings) -> sql.Database:
    """The hub's database, migrated: PostgreSQL at `database_url` when set, otherwise the
    SQLite file in the data directory."""
    if settings.database_url is not None:
        return sql.PostgresDatabase(settings.database_url, postgres.MIGRATIONS)
    return sql.SQLiteDatabase(settings.db_path, migrations)


def open_store(settings: HubSettings) -> HubStore:
    """The hub's store on the database its settings name."""
    return HubStore(open_database(settings))


class HubStore:
    def __init__(self, database: sql.Database) -> None:
        self.db = database

    def close(self) -> None:
        self.db.close()

    # -- enrollment tokens ---------------------------------------------------------------

    def create_token(self, site: str, *, uses: int, expires_in_s: float) -> NewKey:
        now = time.time()
        new = generate_key(ENROLLMENT_TOKEN)
        self.db.execute(
            "INSERT INTO enrollment_tokens (prefix, hash, site, uses_left, expires_at,"
            " revoked_at, created_at) VALUES (?, ?, ?, ?, ?, NULL, ?)",
            [new.prefix, new.hash, site, uses, now + expires_in_s, now],
        )
        return new

    def tokens(self) -> list[EnrollmentToken]:
        rows = self.db.query("SELECT * FROM enrollment_tokens ORDER BY created_at")
        return [_token(r) for r in rows]

    def revoke_token(self, prefix: str) -> EnrollmentToken:
        self.db.execute(
            "UPDATE enrollment_tokens SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL",
            [time.time(), prefix],
        )
        rows = list(self.db.query("SELECT * FROM enrollment_tokens WHERE prefix = ?", [prefix]))
        if not rows:
            raise NotFoundError(f"no enrollment token {prefix!r}")
        return _token(rows[0])

    # -- nodes ---------------------------------------------------------------------------

    @sql.retrying()
    def enroll(
        self,
        token: str,
        *,
        name: str,
        wg_public_key: str,
        overlay_prefix: str,
        labels: Mapping[str, str],
        versions: Mapping[str, str],
    ) -> Enrolled:
        """Spend one use of ``token`` and register a node with the next free overlay
        address, in one transaction. Raises TokenRefusedError naming the problem."""
        prefix = parse_prefix(token, ENROLLMENT_TOKEN)
        now = time.time()
        with self.db.transaction():
            rows = self.db.query("SELECT * FROM enrollment_tokens WHERE prefix = ?", [prefix])
            if prefix is None or not rows or not key_matches(token, rows[0]["hash"]):
                raise TokenRefusedError(TokenProblem.unknown, prefix)
            record = _token(rows[0])
            state = record.state(now)
            if state == "revoked":
                raise TokenRefusedError(TokenProblem.revoked, prefix)
            # A retry may find its token used up (by itself) or just expired.
            again = self._enrolled_again(record, wg_public_key, name, now)
            if again is not None:
                return again
            if state != "active":
                raise TokenRefusedError(TokenProblem(state), prefix)
            # Spent only while a use is left, checked by the UPDATE itself: of two replicas
            # spending the last use at once, the second updates nothing (PostgreSQL makes
            # it wait for the first, then reads the row again).
            spent = self.db.execute(
                "UPDATE enrollment_tokens SET uses_left = uses_left - 1 WHERE prefix = ?"
                " AND uses_left > 0 AND revoked_at IS NULL AND expires_at > ?",
                [prefix, now],
            ).rowcount
            if spent != 1:
                raise TokenRefusedError(TokenProblem.used, prefix)
            node_token = generate_key(NODE_TOKEN)
            node_id = uuid.uuid4().hex
            tried: set[str] = set()
            while True:
                address = self._next_address(overlay_prefix, tried)
                # The UNIQUE index on overlay_address lets one node have it; a replica that
                # lost the race inserts nothing and tries the next address.
                inserted = self.db.execute(
                    "INSERT INTO nodes (id, name, site, labels, wg_public_key, overlay_address,"
                    " token_prefix, token_hash, enrolled_with, enrolled_at, last_seen, versions,"
                    " capacity, revoked_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, '{}',"
                    " NULL) ON CONFLICT (overlay_address) DO NOTHING",
                    [node_id, name, record.site, json.dumps(dict(labels)), wg_public_key, address,
                     node_token.prefix, node_token.hash, prefix, now, json.dumps(dict(versions))],
                ).rowcount  # fmt: skip
                if inserted == 1:
                    break
                tried.add(address)
        node = Node(
            id=node_id,
            name=name,
            site=record.site,
            wg_public_key=wg_public_key,
            overlay_address=address,
            enrolled_at=now,
            last_seen=None,
            revoked_at=None,
            labels=dict(labels),
            versions=dict(versions),
        )
        return Enrolled(node, node_token.plaintext)

    def _enrolled_again(
        self, token: EnrollmentToken, wg_public_key: str, name: str, now: float
    ) -> Enrolled | None:
        """Inside enroll's transaction: the node this key enrolled, when this is a retry of
        that enrollment (the same token, the same name, within ENROLL_RETRY_S, neither
        revoked), with a new node token in place of the lost one; None when the key is
        new. AlreadyEnrolledError when the key belongs to another enrollment."""
        rows = self.db.query("SELECT * FROM nodes WHERE wg_public_key = ?", [wg_public_key])
        if not rows:
            return None
        row = rows[0]
        node = _node(row)
        if (
            row["enrolled_with"] != token.prefix
            or node.name != name
            or node.revoked
            or token.revoked_at is not None
            or now - node.enrolled_at > ENROLL_RETRY_S
        ):
            raise AlreadyEnrolledError(
                f"a node with this WireGuard key is enrolled already ({node.name}, {node.id});"
                " a node enrolls once: revoke it and enroll with a new key"
            )
        node_token = generate_key(NODE_TOKEN)
        self.db.execute(
            "UPDATE nodes SET token_prefix = ?, token_hash = ? WHERE id = ?",
            [node_token.prefix, node_token.hash, node.id],
        )
        self._bump(AUTH_REVISION)  # the token it replaces is good no more, anywhere
        return Enrolled(node, node_token.plaintext)

    def _next_address(self, overlay_prefix: str, tried: set[str]) -> str:
        """A free host address of the prefix (the first host is the hub's), not one of
        `tried`. Addresses are handed out in order and never reused, so the one after the
        count of nodes is nearly always free: two index lookups. Otherwise (the prefix
        changed, or another replica just took it), the lowest free one."""
        network = ipaddress.ip_network(overlay_prefix)
        count = int(self.db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0])
        if count + 2 < network.num_addresses - 1:
            candidate = str(network[count + 2])  # [0] the network, [1] the hub
            if candidate not in tried:
                taken = self.db.execute(
                    "SELECT 1 FROM nodes WHERE overlay_address = ?", [candidate]
                ).fetchone()
                if taken is None:
                    return candidate
        taken_all = {
            r["overlay_address"] for r in self.db.query("SELECT overlay_address FROM nodes")
        } | tried
        hosts = network.hosts()
        next(hosts)  # the hub
        for address in hosts:
            if str(address) not in taken_all:
                return str(address)
        raise AddressPoolExhaustedError(f"no free address left in {overlay_prefix}")

    def authenticate_node(self, token: str) -> Node | None:
        """The node a node token belongs to (revoked ones included), or None."""
        prefix = parse_prefix(token, NODE_TOKEN)
        if prefix is None:
            return None
        rows = list(self.db.query("SELECT * FROM nodes WHERE token_prefix = ?", [prefix]))
        if not rows or not key_matches(token, rows[0]["token_hash"]):
            return None
        return _node(rows[0])

    def heartbeats(self, beats: Sequence[Heartbeat]) -> None:
        """Record heartbeats (the last of each node), in one transaction. In the order of
        the node ids: two replicas writing the same nodes lock their rows in one order, so
        neither waits on the other in a cycle."""
        with self.db.transaction():
            self.db.executemany(
                "UPDATE nodes SET last_seen = ?, versions = ?, capacity = ?, address = ?"
                " WHERE id = ?",
                [(b.at, json.dumps(b.versions), b.capacity.model_dump_json(), b.address,
                  b.node_id) for b in sorted(beats, key=lambda b: b.node_id)],
            )  # fmt: skip

    def nodes(self) -> list[Node]:
        return [_node(r) for r in self.db.query("SELECT * FROM nodes ORDER BY site, name")]

    def node(self, node_id: str) -> Node:
        rows = self.db.query("SELECT * FROM nodes WHERE id = ? OR name = ?", [node_id] * 2)
        if len(rows) != 1:
            raise NotFoundError(f"no single node {node_id!r}")
        return _node(rows[0])

    def revoke_node(self, node_id: str) -> Node:
        """Revoke a node: its token is refused from then on. The revision of node
        authentication moves in the same transaction, so every replica drops the answers
        it remembers (`AsyncHubStore.authenticate_node`)."""
        node = self.node(node_id)
        with self.db.transaction():
            changed = self.db.execute(
                "UPDATE nodes SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                [time.time(), node.id],
            ).rowcount
            if changed:
                self._bump(AUTH_REVISION)
        return self.node(node.id)

    def serials(self) -> tuple[int, int]:
        """(the desired state's serial, the node authentication revision), in one read."""
        values = {
            row[0]: int(row[1])
            for row in self.db.execute(
                "SELECT key, value FROM meta WHERE key IN (?, ?)", [DESIRED_SERIAL, AUTH_REVISION]
            ).fetchall()
        }
        return values.get(DESIRED_SERIAL, 0), values.get(AUTH_REVISION, 0)

    # -- desired state: accounts and keys, pushed to nodes ---------------------------------

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

    def set_account(
        self,
        name: str,
        service_class: str,
        *,
        requests_per_minute: int | None = None,
        tokens_per_day: int | None = None,
        budget: Budget | None = None,
    ) -> int:
        """Create or change an account; the new serial. `budget`: the account's global
        token budget, spent by nodes through leases (None: no global budget)."""
        with self.db.transaction():
            self.db.execute(
                "INSERT INTO accounts (name, service_class, requests_per_minute, tokens_per_day,"
                " budget_tokens, budget_period_s, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET"
                " service_class = excluded.service_class,"
                " requests_per_minute = excluded.requests_per_minute,"
                " tokens_per_day = excluded.tokens_per_day,"
                " budget_tokens = excluded.budget_tokens,"
                " budget_period_s = excluded.budget_period_s",
                [
                    name,
                    service_class,
                    requests_per_minute,
                    tokens_per_day,
                    None if budget is None else budget.tokens,
                    None if budget is None else budget.period_s,
                    time.time(),
                ],
            )
            return self._bump()

    def budget(self, account: str) -> Budget | None:
        row = self.db.execute(
            "SELECT budget_tokens, budget_period_s FROM accounts WHERE name = ?", [account]
        ).fetchone()
        if row is None or row[0] is None:
            return None
        return Budget(int(row[0]), float(row[1]))

    # -- quota leases --------------------------------------------------------------------

    def consumed(self, account: str, period_start: float, period_end: float) -> int:
        """Tokens of the account's usage in the period that reached the ledger: usage under
        the period's leases (whatever the node's clock said), and usage without a lease
        (a partitioned node's safe capacity) by when it was served."""
        row = self.db.execute(
            "SELECT COALESCE(SUM(tokens), 0) FROM ledger WHERE account = ? AND ("
            " (lease_id IS NULL AND at >= ? AND at < ?)"
            " OR lease_id IN (SELECT id FROM leases WHERE account = ? AND period_start = ?))",
            [account, period_start, period_end, account, period_start],
        ).fetchone()
        return int(row[0])

    def lease_views(self, account: str, period_start: float) -> tuple[LeaseView, ...]:
        rows = self.db.execute(
            "SELECT l.id, l.node_id, l.granted, l.final,"
            " (SELECT COALESCE(SUM(g.tokens), 0) FROM ledger g WHERE g.lease_id = l.id)"
            " FROM leases l WHERE l.account = ? AND l.period_start = ? ORDER BY l.created_at",
            [account, period_start],
        ).fetchall()
        return tuple(
            LeaseView(
                id=r[0],
                node_id=r[1],
                granted=int(r[2]),
                seen=int(r[4]),
                final=None if r[3] is None else int(r[3]),
            )
            for r in rows
        )

    def lease_holders(self, now: float) -> set[str]:
        """Nodes holding a lease that may still be spent (unexpired, no final report)."""
        rows = self.db.execute(
            "SELECT DISTINCT node_id FROM leases WHERE final IS NULL AND expires_at > ?", [now]
        ).fetchall()
        return {r[0] for r in rows}

    @sql.retrying()
    def renew_leases(
        self,
        node_id: str,
        accounts: Sequence[str],
        finals: Mapping[str, int],
        *,
        now: float,
        lease_s: float,
        sizing: Sizing,
        grant_new: bool,
    ) -> list[Lease]:
        """One node's lease call, in one transaction: record the final spend of its leases
        it retired (`finals`: lease id -> tokens), then, with `grant_new`, a new lease for
        each of `accounts` that has a budget, sized by the planner.

        Grants of one account are made one at a time, by any replica: the transaction first
        locks the accounts' rows (in name order, so two replicas never wait on each other
        in a cycle; on SQLite, BEGIN IMMEDIATE already admits one writer). Each later read
        sees every grant committed before, so the leases never sum past the budget. The
        lease views are read before what was consumed: usage ingested in between is then
        counted twice (a smaller grant), never missed."""
        granted: list[Lease] = []
        with self.db.transaction():
            if grant_new and accounts:
                for account in sorted(set(accounts)):
                    self.db.execute(
                        f"SELECT name FROM accounts WHERE name = ?{self.db.for_update}",  # noqa: S608 - a constant
                        [account],
                    ).fetchall()
            foreign = {
                lease for lease, owner in self.lease_owners(finals).items() if owner != node_id
            }
            if foreign:
                raise ForeignLeaseError(
                    f"lease {min(foreign)} was not granted to this node", min(foreign)
                )
            for lease_id, spent in finals.items():
                self.db.execute(
                    "UPDATE leases SET final = ? WHERE id = ? AND node_id = ? AND final IS NULL",
                    [max(0, int(spent)), lease_id, node_id],
                )
            if not grant_new:
                return granted
            for account in accounts:
                budget = self.budget(account)
                if budget is None:
                    continue
                start, end = budget.period(now)
                views = self.lease_views(account, start)
                consumed = self.consumed(account, start, end)
                spenders = {v.node_id for v in views if v.outstanding > 0} | {node_id}
                tokens = grant(budget, consumed, views, spenders=len(spenders), sizing=sizing)
                lease = Lease(
                    id=uuid.uuid4().hex,
                    account=account,
                    node_id=node_id,
                    granted=tokens,
                    expires_at=min(now + lease_s, end),
                    period_ends_at=end,
                )
                if tokens > 0:  # a lease of nothing reserves nothing: not stored
                    self.db.execute(
                        "INSERT INTO leases (id, account, node_id, period_start, granted, final,"
                        " expires_at, created_at) VALUES (?, ?, ?, ?, ?, NULL, ?, ?)",
                        [lease.id, account, node_id, start, tokens, lease.expires_at, now],
                    )
                granted.append(lease)
        return granted

    def quota(self, account: str, now: float) -> Quota | None:
        """An account's budget in the current period: consumed, leased per node, left."""
        budget = self.budget(account)
        if budget is None:
            return None
        start, end = budget.period(now)
        views = self.lease_views(account, start)
        consumed = self.consumed(account, start, end)
        per_node: dict[str, int] = {}
        for view in views:
            if view.outstanding:
                per_node[view.node_id] = per_node.get(view.node_id, 0) + view.outstanding
        return Quota(
            account=account,
            budget=budget,
            period_start=start,
            period_end=end,
            consumed=consumed,
            leased=per_node,
            remaining=remaining(budget, consumed, views),
        )

    def create_key(self, account: str, *, admin: bool = False) -> NewKey:
        new = generate_key()
        with self.db.transaction():
            if not self.db.query("SELECT 1 FROM accounts WHERE name = ?", [account]):
                raise NotFoundError(
                    f"no account {account!r}; create it with `kvl hub accounts set {account}`"
                )
            self.db.execute(
                "INSERT INTO api_keys (prefix, hash, account, admin, created_at, revoked_at)"
                " VALUES (?, ?, ?, ?, ?, NULL)",
                [new.prefix, new.hash, account, int(admin), time.time()],
            )
            self._bump()
        return new

    def revoke_key(self, prefix: str) -> int:
        with self.db.transaction():
            self._revoke("api_keys", prefix, "key")
            return self._bump()

    def _revoke(self, table: str, prefix: str, what: str) -> None:
        """Inside a transaction: revoke the active row of `prefix` (NotFoundError if none)."""
        done = self.db.execute(
            # The table name is one of this module's, never input.
            f"UPDATE {table} SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL",  # noqa: S608
            [time.time(), prefix],
        )
        if done.rowcount == 0:
            raise NotFoundError(f"no active {what} {prefix!r}")

    def accounts(self) -> list[dict[str, Any]]:
        return list(self.db.query("SELECT * FROM accounts ORDER BY name"))

    def desired_state(self, node: Node) -> protocol.DesiredState:
        """What ``node`` should hold, with the serial it is at. Only the node's own.

        One transaction, and the serial read first: a change committed while this reads
        (on PostgreSQL each statement sees the latest commit) can then only give the node
        newer accounts and keys under an older serial, which it pulls again at its next
        heartbeat; never an older state under the newer serial, which it would keep."""
        with self.db.transaction():
            serial = self.desired_serial()
            names = self.node_accounts(node)
            accounts = [
                protocol.AccountState(
                    name=r["name"],
                    service_class=r["service_class"],
                    requests_per_minute=r["requests_per_minute"],
                    tokens_per_day=r["tokens_per_day"],
                    # Spent through leases (POST /v1/node/leases) when set.
                    budget_tokens=r["budget_tokens"],
                )
                for r in self.db.query("SELECT * FROM accounts ORDER BY name")
                if r["name"] in names
            ]
            keys = [
                protocol.KeyState(
                    prefix=r["prefix"],
                    hash=r["hash"],
                    account=r["account"],
                    admin=bool(r["admin"]),
                    revoked=r["revoked_at"] is not None,
                )
                for r in self.db.query("SELECT * FROM api_keys ORDER BY prefix")
                if r["account"] in names
            ]
            return protocol.DesiredState(
                node_id=node.id,
                serial=serial,
                accounts=accounts,
                keys=keys,
                # The models placed on this node: it fetches each artifact through the
                # tunnel (GET /v1/node/artifacts/SHA256), checks its sha256, loads it.
                models=[
                    protocol.PlacedModel(
                        name=m.name,
                        version=m.version,
                        sha256=m.sha256,
                        size_bytes=m.size_bytes,
                        format=m.format,
                    )
                    for m in self.placed_models(node.id)
                ],
                # The content packages seeded to this node: fetched the same way, pinned.
                packages=self.seeded_packages(node),
            )

    def node_accounts(self, node: Node) -> set[str]:
        """The accounts ``node`` serves: those its desired state gives it, the only ones it
        may report usage or ask leases for. Today every account of the fleet."""
        del node  # every node serves every account until accounts are bound to tenants
        return {str(r[0]) for r in self.db.execute("SELECT name FROM accounts").fetchall()}

    def lease_owners(self, lease_ids: Iterable[str]) -> dict[str, str]:
        """The node each of these leases was granted to (ids the hub never stored, such
        as a grant of nothing, are absent)."""
        ids = sorted(set(lease_ids))
        owners: dict[str, str] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for lease_id, node_id in self.db.execute(
                f"SELECT id, node_id FROM leases WHERE id IN ({marks})",  # noqa: S608 - placeholders only
                chunk,
            ).fetchall():
                owners[str(lease_id)] = str(node_id)
        return owners

    def key_account(self, key: str) -> str | None:
        """The account of an active API key (a client's, as a node hands it over with an
        offloaded request); None for a key unknown or revoked."""
        prefix = parse_prefix(key)
        if prefix is None:
            return None
        row = self.db.execute(
            "SELECT hash, account, revoked_at FROM api_keys WHERE prefix = ?", [prefix]
        ).fetchone()
        if row is None or row[2] is not None or not key_matches(key, row[0]):
            return None
        return str(row[1])

    # -- operators -------------------------------------------------------------------------

    def create_operator(self, name: str) -> NewKey:
        new = generate_key(OPERATOR_TOKEN)
        self.db.execute(
            "INSERT INTO operators (prefix, hash, name, created_at) VALUES (?, ?, ?, ?)",
            [new.prefix, new.hash, name, time.time()],
        )
        return new

    def authenticate_operator(self, token: str) -> str | None:
        """The operator's name for a valid, unrevoked token; None otherwise."""
        prefix = parse_prefix(token, OPERATOR_TOKEN)
        if prefix is None:
            return None
        row = self.db.execute(
            "SELECT hash, name, revoked_at FROM operators WHERE prefix = ?", [prefix]
        ).fetchone()
        if row is None or row[2] is not None or not key_matches(token, row[0]):
            return None
        return str(row[1])

    def revoke_operator(self, prefix: str) -> None:
        self._revoke("operators", prefix, "operator token")

    # -- models, deployments, placements --------------------------------------------------

    def add_model(self, model: ModelArtifact) -> None:
        added = self.db.execute(
            "INSERT INTO models (ref, name, version, sha256, size_bytes, format, memory_mib,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [model.ref, model.name, model.version, model.sha256, model.size_bytes,
             model.format, model.memory_mib, time.time()],
        ).rowcount  # fmt: skip
        if added == 0:
            raise ConflictError(f"model {model.ref} is already registered")

    def models(self) -> list[ModelArtifact]:
        rows = self.db.execute(
            "SELECT name, version, sha256, size_bytes, format, memory_mib FROM models ORDER BY ref"
        ).fetchall()
        return [ModelArtifact(*r) for r in rows]

    def model_by_sha256(self, sha256: str) -> ModelArtifact | None:
        row = self.db.execute(
            "SELECT name, version, sha256, size_bytes, format, memory_mib FROM models"
            " WHERE sha256 = ? LIMIT 1",
            [sha256],
        ).fetchone()
        return None if row is None else ModelArtifact(*row)

    def deploy(self, deployment: DeploymentRecord) -> int:
        """Add a deployment; the new serial (the reconciler places it within seconds)."""
        with self.db.transaction():
            if not self.db.execute(
                "SELECT 1 FROM models WHERE ref = ?", [deployment.model]
            ).fetchone():
                raise NotFoundError(
                    f"no model {deployment.model!r}; add it with `kvl hub models add`"
                )
            self.db.execute(
                "INSERT INTO deployments (id, model, replicas, service_class, isolation,"
                " constraints, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [deployment.id, deployment.model, deployment.replicas, deployment.service_class,
                 deployment.isolation, json.dumps(deployment.constraints), time.time()],
            )  # fmt: skip
            return self._bump()

    def undeploy(self, deployment_id: str) -> int:
        with self.db.transaction():
            gone = self.db.execute("DELETE FROM deployments WHERE id = ?", [deployment_id])
            if gone.rowcount == 0:
                raise NotFoundError(f"no deployment {deployment_id!r}")
            self.db.execute("DELETE FROM placements WHERE deployment_id = ?", [deployment_id])
            return self._bump()

    def deployments(self) -> list[DeploymentRecord]:
        rows = self.db.execute(
            "SELECT id, model, replicas, service_class, isolation, constraints FROM deployments"
            " ORDER BY created_at, id"
        ).fetchall()
        return [DeploymentRecord(r[0], r[1], int(r[2]), r[3], r[4], json.loads(r[5])) for r in rows]

    def placements(self) -> list[tuple[str, str, int | None]]:
        """(deployment id, node id, GPU index or None) of every replica placed."""
        rows = self.db.execute(
            "SELECT deployment_id, node_id, gpu FROM placements ORDER BY deployment_id, node_id"
        ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    def apply_placements(self, wanted: Iterable[tuple[str, str, int | None]]) -> bool:
        """Make the placements exactly `wanted` (the planner's answer); True when that
        changed anything (the desired state's serial then moves, so nodes converge).

        Every replica runs the reconciler: the serial's row, locked first, lets one apply
        at a time, and each compares with the placements as the one before left them."""
        target = set(wanted)
        with self.db.transaction():
            self.db.execute(
                "INSERT INTO meta (key, value) VALUES ('desired_serial', '0')"
                " ON CONFLICT DO NOTHING"
            )
            self.db.execute(
                f"SELECT value FROM meta WHERE key = 'desired_serial'{self.db.for_update}"  # noqa: S608 - a constant
            ).fetchall()
            current = set(self.placements())
            if current == target:
                return False
            self.db.executemany(
                "DELETE FROM placements WHERE deployment_id = ? AND node_id = ?",
                sorted((d, n) for d, n, _ in current - target),
            )
            now = time.time()
            self.db.executemany(
                "INSERT INTO placements (deployment_id, node_id, gpu, created_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (deployment_id, node_id) DO UPDATE SET"
                " gpu = excluded.gpu",
                [(d, n, g, now) for d, n, g in sorted(target - current, key=str)],
            )
            self._bump()
            return True

    def set_draining(self, node_id: str, *, draining: bool) -> Node:
        node = self.node(node_id)
        self.db.execute("UPDATE nodes SET draining = ? WHERE id = ?", [int(draining), node.id])
        return self.node(node.id)

    def placed_models(self, node_id: str) -> list[ModelArtifact]:
        """The models placed on a node, for its desired state."""
        rows = self.db.execute(
            "SELECT DISTINCT m.name, m.version, m.sha256, m.size_bytes, m.format, m.memory_mib,"
            " m.ref FROM placements p JOIN deployments d ON d.id = p.deployment_id"
            " JOIN models m ON m.ref = d.model WHERE p.node_id = ? ORDER BY m.ref",
            [node_id],
        ).fetchall()
        return [ModelArtifact(*r[:6]) for r in rows]

    # -- the ledger ----------------------------------------------------------------------

    def ingest(self, node_id: str, events: Iterable[protocol.Event]) -> tuple[list[str], int]:
        """Store a batch of a node's events; (every id acknowledged, how many were new).
        An event already in the ledger is acknowledged again and not stored twice: the
        ledger's key is the event id, an INSERT of one already there changes nothing, and
        its row count says so, whichever replica got the batch first."""
        events = list(events)
        [stored] = self.store_events([(node_id, events, ledger_rows(node_id, events, time.time()))])
        return stored

    @sql.retrying()
    def store_events(
        self, batches: Sequence[tuple[str, Sequence[protocol.Event], list[LedgerRow]]]
    ) -> list[tuple[list[str], int]]:
        """Several nodes' batches (node id, events, their `ledger_rows`) in one transaction,
        so in one durable commit; for each, as `ingest` answers."""
        insert = (
            "INSERT INTO ledger (event_id, node_id, kind, body, received_at, account, tokens,"
            " lease_id, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        )
        answers: dict[int, tuple[list[str], int]] = {}
        with self.db.transaction():
            # All the group's usage in a few statements, in the order of its ids: two
            # replicas storing overlapping batches lock the same keys in one order. An id
            # the statement returns was inserted now: new, for the first batch holding it.
            stored = self._insert_usage(
                sorted((r for b in batches for r in b[2] if r[2] == "usage"), key=lambda r: r[0])
            )
            order = sorted(
                range(len(batches)), key=lambda i: min((r[0] for r in batches[i][2]), default="")
            )
            for index in order:
                node_id, events, rows = batches[index]
                new = 0
                for row in rows:
                    if row[2] == "usage" and row[0] in stored:
                        stored.discard(row[0])
                        new += 1
                for event, row in zip(events, rows, strict=True):
                    if row[2] == "usage":
                        continue
                    # Others one by one, in the node's order, each applied if it was new.
                    if self.db.execute(insert, row).rowcount == 0:
                        continue
                    new += 1
                    self._apply_event(node_id, event, row[4])
                answers[index] = ([r[0] for r in rows], new)
        return [answers[i] for i in range(len(batches))]

    _USAGE_ROWS_PER_STATEMENT = 500  # 9 parameters each: under both databases' limits

    def _insert_usage(self, rows: Sequence[LedgerRow]) -> set[str]:
        """Insert usage rows (a row whose id is in the ledger already changes nothing);
        the ids inserted now. One multi-row statement per chunk: on PostgreSQL a round
        trip each, where one per row was most of a group commit's time."""
        inserted: set[str] = set()
        for start in range(0, len(rows), self._USAGE_ROWS_PER_STATEMENT):
            chunk = rows[start : start + self._USAGE_ROWS_PER_STATEMENT]
            values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            inserted.update(
                str(r[0])
                for r in self.db.execute(
                    "INSERT INTO ledger (event_id, node_id, kind, body, received_at, account,"  # noqa: S608 - placeholders only
                    f" tokens, lease_id, at) VALUES {values} ON CONFLICT DO NOTHING"
                    " RETURNING event_id",
                    [value for row in chunk for value in row],
                ).fetchall()
            )
        return inserted

    def _apply_event(self, node_id: str, event: protocol.Event, now: float) -> None:
        """A node's package report: the package (and its lineage) known to the fleet, held
        by that node; or no longer held. Usage is kept in the ledger only."""
        if isinstance(event, protocol.PackageEvent):
            body = event.body
            self._upsert_package(body.model_dump(mode="json"), origin_node=node_id, now=now)
            self.db.execute(
                "INSERT INTO package_copies (package_id, version, node_id, reported_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (package_id, version, node_id) DO UPDATE SET"
                " reported_at = excluded.reported_at",
                [body.id, body.version, node_id, now],
            )
        elif isinstance(event, protocol.PackageRemovedEvent):
            self.db.execute(
                "DELETE FROM package_copies WHERE package_id = ? AND version = ? AND node_id = ?",
                [event.body.id, event.body.version, node_id],
            )

    def _upsert_package(
        self, summary: Mapping[str, Any], *, origin_node: str | None, now: float
    ) -> None:
        """Record a package version the first time it is heard of; later reports (another
        node's copy, an upload) keep the first origin."""
        self.db.execute(
            "INSERT INTO packages (id, version, title, topic, level, items, size, digest,"
            " lineage, origin_node, created_at, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?,"
            " ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [str(summary["id"]), str(summary["version"]), str(summary["title"]),
             str(summary["topic"]), str(summary["level"]), int(summary["items"]),
             int(summary["size"]), str(summary["digest"]), json.dumps(summary["lineage"]),
             origin_node, str(summary["created_at"]), now],
        )  # fmt: skip

    # -- content packages ------------------------------------------------------------------

    def add_package_bundle(self, summary: Mapping[str, Any], sha256: str, size: int) -> None:
        """The hub now holds this package's archive (to seed it to nodes)."""
        with self.db.transaction():
            self._upsert_package(summary, origin_node=None, now=time.time())
            self.db.execute(
                "UPDATE packages SET bundle_sha256 = ?, bundle_size = ? WHERE id = ? AND"
                " version = ?",
                [sha256, size, summary["id"], summary["version"]],
            )

    def packages(self, query: str | None = None, limit: int = 200) -> list[PackageRecord]:
        """Packages known to the fleet, newest first, with the nodes that hold each."""
        needle = f"%{(query or '').casefold()}%"
        rows = self.db.query(
            "SELECT p.*, s.site AS seed_site, s.created_at AS seeded_at"
            " FROM packages p LEFT JOIN package_seeds s ON s.package_id = p.id AND"
            " s.version = p.version WHERE lower(p.id || ' ' || p.title || ' ' || p.topic)"
            " LIKE ? ORDER BY p.created_at DESC, p.id LIMIT ?",
            [needle, limit],
        )
        holders: dict[tuple[str, str], list[str]] = {}
        if rows:
            marks = ",".join("?" * len(rows))
            copies = self.db.execute(
                "SELECT package_id, version, node_id FROM package_copies"  # noqa: S608 - placeholders only
                f" WHERE package_id IN ({marks}) ORDER BY node_id",
                sorted({r["id"] for r in rows}),
            )
            for package_id, version, node_id in copies:
                holders.setdefault((package_id, version), []).append(node_id)
        return [_package(r, holders.get((r["id"], r["version"]), [])) for r in rows]

    def seed_package(self, package_id: str, version: str | None, site: str | None) -> int:
        """Seed a package version (the newest held when None) to every node, or to the
        nodes of ``site``; the new serial. NotFoundError when the hub holds no archive."""
        with self.db.transaction():
            row = self.db.execute(
                "SELECT version FROM packages WHERE id = ? AND (CAST(? AS TEXT) IS NULL OR"
                " version = ?) AND"
                " bundle_sha256 IS NOT NULL ORDER BY created_at DESC LIMIT 1",
                [package_id, version, version],
            ).fetchone()
            if row is None:
                raise NotFoundError(
                    f"the hub holds no archive of {package_id}"
                    + (f"@{version}" if version else "")
                    + "; add one with `kvl hub packages add FILE`"
                )
            self.db.execute(
                "INSERT INTO package_seeds (package_id, version, site, created_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (package_id, version) DO UPDATE SET"
                " site = excluded.site",
                [package_id, row[0], site, time.time()],
            )
            return self._bump()

    def unseed_package(self, package_id: str, version: str | None) -> int:
        with self.db.transaction():
            gone = self.db.execute(
                "DELETE FROM package_seeds WHERE package_id = ? AND"
                " (CAST(? AS TEXT) IS NULL OR version = ?)",
                [package_id, version, version],
            ).rowcount
            if not gone:
                raise NotFoundError(f"{package_id} is not seeded")
            return self._bump()

    def seeded_packages(self, node: Node) -> list[protocol.SeededPackage]:
        """The package archives seeded to ``node`` (all nodes, or its site)."""
        rows = self.db.execute(
            "SELECT p.id, p.version, p.bundle_sha256, p.bundle_size FROM package_seeds s"
            " JOIN packages p ON p.id = s.package_id AND p.version = s.version"
            " WHERE p.bundle_sha256 IS NOT NULL AND (s.site IS NULL OR s.site = ?)"
            " ORDER BY p.id, p.version",
            [node.site],
        ).fetchall()
        return [protocol.SeededPackage(id=r[0], version=r[1], sha256=r[2], size=r[3]) for r in rows]

    def ledger_count(self, node_id: str | None = None) -> int:
        sql, params = "SELECT COUNT(*) AS n FROM ledger", []
        if node_id is not None:
            sql, params = sql + " WHERE node_id = ?", [node_id]
        return int(self.db.query(sql, params)[0]["n"])


# A ledger row: event id, node id, kind, body (JSON), received at, account, tokens,
# lease id, when served (the last four for usage events only).
LedgerRow = tuple[str, str, str, str, float, str | None, int | None, str | None, float | None]


def ledger_rows(node_id: str, events: Iterable[protocol.Event], now: float) -> list[LedgerRow]:
    """A node's events (validated: bounded, non-negative numbers) as ledger rows."""
    return [(e.id, node_id, e.kind, e.body.model_dump_json(), now, *_usage(e, now))
            for e in events]  # fmt: skip


def _usage(
    event: protocol.Event, received_at: float
) -> tuple[str | None, int | None, str | None, float | None]:
    """(account, tokens, lease id, when) of a usage event; Nones for other kinds."""
    if not isinstance(event, protocol.UsageEvent):
        return None, None, None, None
    body = event.body
    at = received_at
    if body.created_at:
        with contextlib.suppress(ValueError, OverflowError, OSError):
            at = datetime.fromisoformat(body.created_at).timestamp()
    return body.account, body.tokens_in + body.tokens_out, body.lease_id, at


def _package(row: Mapping[str, Any], nodes: list[str]) -> PackageRecord:
    return PackageRecord(
        id=row["id"],
        version=row["version"],
        title=row["title"],
        topic=row["topic"],
        level=row["level"],
        items=row["items"],
        size=row["size"],
        digest=row["digest"],
        lineage=json.loads(row["lineage"]),
        origin_node=row["origin_node"],
        created_at=row["created_at"],
        received_at=row["received_at"],
        bundle_sha256=row["bundle_sha256"],
        bundle_size=row["bundle_size"],
        nodes=sorted(nodes),
        seeded_to=None if row["seeded_at"] is None else (row["seed_site"] or "*"),
    )


def _token(row: Mapping[str, Any]) -> EnrollmentToken:
    return EnrollmentToken(
        prefix=row["prefix"],
        site=row["site"],
        uses_left=row["uses_left"],
        expires_at=row["expires_at"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )


def capacity_of(stored: str | None) -> protocol.Capacity:
    """A node's last reported capacity as stored (validated when it arrived). A row an
    older hub wrote, in the free-form capacity of protocol 1, reads as empty until the
    node's next heartbeat."""
    if not stored:
        return protocol.Capacity()
    try:
        return protocol.Capacity.model_validate_json(stored)
    except ValueError:
        return protocol.Capacity()


def _node(row: Mapping[str, Any]) -> Node:
    return Node(
        id=row["id"],
        name=row["name"],
        site=row["site"],
        wg_public_key=row["wg_public_key"],
        overlay_address=row["overlay_address"],
        enrolled_at=row["enrolled_at"],
        last_seen=row["last_seen"],
        revoked_at=row["revoked_at"],
        labels=json.loads(row["labels"] or "{}"),
        versions=json.loads(row["versions"] or "{}"),
        capacity=capacity_of(row["capacity"]),
        address=row.get("address"),
        draining=bool(row.get("draining")),
    )


@dataclass(frozen=True)
class Lease:
    """A grant to one node: `granted` tokens of `account` until `expires_at` (0: the
    budget is spent until `period_ends_at`)."""

    id: str
    account: str
    node_id: str
    granted: int
    expires_at: float
    period_ends_at: float


@dataclass(frozen=True)
class Quota:
    account: str
    budget: Budget
    period_start: float
    period_end: float
    consumed: int
    leased: Mapping[str, int]  # node id -> tokens leased and not yet seen in the ledger
    remaining: int


@dataclass(frozen=True)
class ModelArtifact:
    name: str
    version: str
    sha256: str
    size_bytes: int
    format: str
    memory_mib: int

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class DeploymentRecord:
    id: str
    model: str  # name@version
    replicas: int
    service_class: str
    isolation: str
    constraints: Mapping[str, Any]  # sites, regions, labels, gpu, gpu_memory_mib, tenant


@dataclass(frozen=True)
class Heartbeat:
    node_id: str
    at: float  # unix seconds
    versions: Mapping[str, str]
    capacity: protocol.Capacity
    address: str | None = None  # the caller's address


EventsAnswer = tuple[list[str], int]  # every id acknowledged, how many were new
GROUP_EVENTS = 20_000  # at most this many events in one group commit


class AsyncHubStore(db.AsyncStore[HubStore]):
    """The hub's store on its writer thread, on the database the settings name; and a
    second connection on a thread of its own for snapshots of the whole fleet (`read`),
    so the placement reconciler's and the console's reads of ten thousand nodes never
    hold up the node calls queued on the writer."""

    _NODES_REMEMBERED = 200_000

    def __init__(self, settings: HubSettings) -> None:
        super().__init__(open_store, settings)
        self._reader = db.AsyncStore(open_store, settings)
        self._waiting: list[_Batch] = []
        self._committer: asyncio.Task[None] | None = None
        # Node tokens already checked, by their hash: the node they belong to. Dropped
        # whenever the authentication revision moves (a revocation, by any process).
        self._nodes_by_token: dict[str, Node] = {}
        self._auth_revision = -1
        self._auth_epoch = 0  # moves whenever the remembered answers are dropped
        # The fleet's account names as of a desired serial (dropped when it moves), and
        # which node each lease seen was granted to (None: never stored): what a node may
        # report usage for is checked without a read per sync.
        self._accounts: frozenset[str] | None = None
        self._desired_serial = -1
        self._lease_owner: dict[str, str | None] = {}

    async def open(self) -> None:
        await super().open()
        await self._reader.open()

    async def read(
        self, fn: Callable[Concatenate[HubStore, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`fn(store, …)` on the reading connection: reads only (SQLite's WAL and
        PostgreSQL both let it read what was committed while the writer writes)."""
        return await self._reader.run(fn, self._reader.sync, *args, **kwargs)

    async def nodes(self) -> list[Node]:
        """Every node (`HubStore.nodes`), read beside the writer."""
        return await self.read(HubStore.nodes)

    async def authenticate_node(self, token: str) -> Node | None:
        """`HubStore.authenticate_node`, remembered (by the token's sha256): a node's
        heartbeat or sync does not look its token up again, and never waits behind the
        writer's commits (a miss is read on the reading connection). A revocation holds
        on the revoking replica's next call; made by another replica or by the CLI,
        within the second in which the heartbeat flusher reads the authentication
        revision (`note_serials`).
        (Checked on every call, the revision cost a read per call: a SQLite file changes
        with every commit of the fleet's heartbeats and events.)"""
        if parse_prefix(token, NODE_TOKEN) is None:
            return None
        digest = hash_key(token)
        if (known := self._nodes_by_token.get(digest)) is not None:
            return known
        epoch = self._auth_epoch
        node = await self.read(HubStore.authenticate_node, token)
        if node is not None and epoch == self._auth_epoch:
            if len(self._nodes_by_token) >= self._NODES_REMEMBERED:
                self._nodes_by_token.clear()
            self._nodes_by_token[digest] = node
        return node

    async def revoke_node(self, node_id: str) -> Node:
        """`HubStore.revoke_node`; this replica forgets the node's token at once."""
        node = await self.run(self.sync.revoke_node, node_id)
        self._forget_nodes()
        return node

    def note_serials(self, serials: tuple[int, int]) -> None:
        """The serials just read (`HubStore.serials`): a moved authentication revision
        drops the remembered node tokens, a moved desired serial the account names."""
        if serials[0] != self._desired_serial:
            self._desired_serial = serials[0]
            self._accounts = None
        self._note_auth_revision(serials[1])

    async def node_accounts(self, node: Node, names: Iterable[str] = ()) -> frozenset[str]:
        """`HubStore.node_accounts`, remembered until the desired serial moves; read again
        when one of `names` is not among them (an account made a moment ago, on another
        replica, before this one's flusher saw the serial move)."""
        known = self._accounts
        if known is None or not known.issuperset(names):
            known = frozenset(await self.read(HubStore.node_accounts, node))
            self._accounts = known
        return known

    async def check_reports(
        self, node: Node, accounts: Iterable[str], leases: Iterable[str]
    ) -> None:
        """What a node reports (usage of `accounts`, spends under `leases`) is its own:
        accounts its desired state gives it, leases granted to it. ForeignAccountError or
        ForeignLeaseError otherwise."""
        accounts = set(accounts)
        if accounts:
            foreign = accounts - await self.node_accounts(node, accounts)
            if foreign:
                raise ForeignAccountError(
                    f"account {min(foreign)!r} is not one this node serves", min(foreign)
                )
        leases = set(leases)
        unknown = leases - self._lease_owner.keys()
        if unknown:
            owners = await self.read(HubStore.lease_owners, unknown)
            if len(self._lease_owner) >= self._NODES_REMEMBERED:
                self._lease_owner.clear()
            # A lease id the hub never stored stays unknown: ids are made by the hub when
            # it grants, and a node learns one only after the grant committed.
            self._lease_owner.update({lease: owners.get(lease) for lease in unknown})
        foreign_leases = sorted(
            lease for lease in leases if self._lease_owner.get(lease) not in {None, node.id}
        )
        if foreign_leases:
            raise ForeignLeaseError(
                f"lease {foreign_leases[0]} was not granted to this node", foreign_leases[0]
            )

    def _note_auth_revision(self, revision: int) -> None:
        if revision != self._auth_revision:
            self._auth_revision = revision
            self._forget_nodes()

    def _forget_nodes(self) -> None:
        self._nodes_by_token.clear()
        self._auth_epoch += 1

    async def ingest(self, node_id: str, events: Iterable[protocol.Event]) -> EventsAnswer:
        """`HubStore.ingest`, committed in groups: the batches that arrive while a commit is
        being made go together in the next one. A thousand nodes syncing in a second then
        cost a few durable commits, not a thousand (one writer thread makes them all), and
        no batch waits on a timer. Each is answered once its commit is durable."""
        events = list(events)
        rows = ledger_rows(node_id, events, time.time())  # a malformed batch fails alone
        future: asyncio.Future[EventsAnswer] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Batch(node_id, events, rows, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit(), name="kvl-hub-ledger")
        return await future

    async def _commit(self) -> None:
        while self._waiting:
            group: list[_Batch] = []
            size = 0
            while self._waiting and (
                not group or size + len(self._waiting[0].rows) <= GROUP_EVENTS
            ):
                group.append(self._waiting.pop(0))
                size += len(group[-1].rows)
            try:
                answers = await self.run(self.sync.store_events, [w.stored for w in group])
            except sql.DatabaseError:
                # Again one at a time, so only a batch at fault fails.
                for waiting in group:
                    await self._commit_one(waiting)
                continue
            except Exception as err:  # noqa: BLE001 - handed to every caller waiting on it
                for waiting in group:
                    _settle(waiting.answer, error=err)
                continue
            for waiting, answer in zip(group, answers, strict=True):
                _settle(waiting.answer, answer)

    async def _commit_one(self, waiting: _Batch) -> None:
        try:
            [answer] = await self.run(self.sync.store_events, [waiting.stored])
        except Exception as err:  # noqa: BLE001 - handed to the caller waiting on it
            _settle(waiting.answer, error=err)
        else:
            _settle(waiting.answer, answer)

    async def close(self) -> None:
        if self._committer is not None:
            with contextlib.suppress(Exception):
                await self._committer
        await self._reader.close()
        await super().close()


@dataclass(frozen=True)
class _Batch:
    """A node's batch of events waiting for the next group commit."""

    node_id: str
    events: list[protocol.Event]
    rows: list[LedgerRow]
    answer: asyncio.Future[EventsAnswer]

    @property
    def stored(self) -> tuple[str, list[protocol.Event], list[LedgerRow]]:
        return self.node_id, self.events, self.rows


def _settle(
    future: asyncio.Future[EventsAnswer],
    answer: EventsAnswer | None = None,
    *,
    error: BaseException | None = None,
) -> None:
    if future.done():  # its caller went away; the events are stored all the same
        return
    if error is not None:
        future.set_exception(error)
    elif answer is not None:
        future.set_result(answer)


@dataclass(frozen=True)
class PackageRecord:
    """A content package known to the fleet: reported by a node, or uploaded here."""

    id: str
    version: str
    title: str
    topic: str
    level: str
    items: int
    size: int
    digest: str
    lineage: dict[str, Any]
    origin_node: str | None  # the node that made it (None: uploaded to the hub)
    created_at: str
    received_at: float
    bundle_sha256: str | None  # the archive the hub holds to seed it (None: not held)
    bundle_size: int | None
    nodes: list[str]  # the nodes that hold it, as they last reported
    seeded_to: str | None  # "*" every node, a site, or None: not seeded
