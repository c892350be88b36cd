"""The node registry: enrollment (a token spent, a node and its overlay address, in one
transaction), node tokens, heartbeats, drains and revocations. Every read of node rows
goes through `_node_rows` and `node_of`."""

from __future__ import annotations

import ipaddress
import json
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hub.state import sql
from hub.state.certificates import NameTakenError
from hub.state.errors import NotFoundError
from hub.state.serials import AUTH_REVISION
from hub.state.tokens import EnrollmentToken, TokenProblem, TokenRefusedError, token_of
from shared import protocol
from shared.keys import ENROLLMENT_TOKEN, NODE_TOKEN, generate_key, key_matches, parse_prefix

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from hub.state.certificates import IssuedCertificate
    from hub.state.serials import Serials


class AddressPoolExhaustedError(Exception):
    pass


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
    # Its tenancy, the operator's (its enrollment token's, or `kvl hub nodes set`), never
    # its labels': dedicated to `tenant` (S3), or on a private site (S4).
    tenant: str | None = None
    private: bool = False
    certificate_refused: str | None = None  # why its last certificate request was refused

    @property
    def fleet_url(self) -> str | None:
        """The node's fleet listener as the hub reaches it (through the tunnel, at the
        address its heartbeats come from), the one way the hub calls a node: mutual TLS,
        the node's certificate checked for its URI. None where it has none (no
        certificate yet, or an appliance from before protocol 3): the hub never calls a
        node's LAN API, which a node that says `tls: false` would serve in clear."""
        api = self.capacity.api
        if self.address is None or api is None or api.fleet_port is None:
            return None
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"https://{host}:{api.fleet_port}"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class Enrolled:
    node: Node
    node_token: str  # shown once, to the node
    certificate: IssuedCertificate | None = None

    def certified(self, certificate: IssuedCertificate) -> Enrolled:
        return replace(self, certificate=certificate)


class AlreadyEnrolledError(Exception):
    """A node with this WireGuard key is enrolled already, and this is not a retry of
    that enrollment (another token, or too late)."""


# An enrollment whose answer was lost may be sent again, with the same token and key, for
# this long: it gets the same node, with a new node token (the first was never received).
ENROLL_RETRY_S = 600.0


@dataclass(frozen=True)
class Heartbeat:
    node_id: str
    at: float  # unix seconds
    versions: Mapping[str, str]
    capacity: protocol.Capacity
    address: str | None = None  # the caller's address
    objectives: protocol.Objectives | None = None  # protocol 4 (hub/state/objectives.py)


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


@dataclass(frozen=True)
class HeartbeatHealth:
    """The fields of a node's last heartbeat (`protocol.Capacity`) the alert rules judge."""

    outbox_alarm: bool = False
    outbox_lag: int = 0
    leases_lapsed: int = 0
    lease_failures: int = 0
    backup: BackupHealth | None = None  # protocol 9: its scheduled backups


@dataclass(frozen=True)
class BackupHealth:
    """Of a node's scheduled backups (`protocol.BackupReport`), what the alert rule judges."""

    overdue_at: float
    last_good_at: float | None = None


@dataclass(frozen=True)
class NodeHealth:
    """What the alert rules read of a node: who it is, when it was last heard, and the few
    heartbeat fields they judge."""

    id: str
    name: str
    site: str
    last_seen: float | None
    revoked: bool
    capacity: HeartbeatHealth


# The columns of `snapshot_rows`, in order.
SNAPSHOT_COLUMNS = "id, site, labels, capacity, last_seen, draining, revoked_at, tenant, private"
HEALTH_CHUNK = 500  # nodes in one read of `node_health`
_HEALTH_FIELDS = ("outbox_alarm", "outbox_lag", "leases_lapsed", "lease_failures")


def _health_of(row: Sequence[Any]) -> NodeHealth:
    """A node's health from its row. The capacity is read with the C JSON parser and not
    validated again: it was when it arrived, and only four of its fields are wanted."""
    node_id, name, site, last_seen, revoked_at, stored = row
    try:
        capacity = json.loads(stored) if stored else {}
    except ValueError:
        capacity = {}
    wanted: dict[str, Any] = {}
    if isinstance(capacity, dict):
        for key in _HEALTH_FIELDS:
            value = capacity.get(key)
            # A row of an older hub (protocol 1's free-form capacity) reads as defaults.
            if type(value) is (bool if key == "outbox_alarm" else int) and value >= 0:
                wanted[key] = value
        wanted["backup"] = _backup_health(capacity.get("backup"))
    return NodeHealth(
        node_id, name, site, last_seen, revoked_at is not None, HeartbeatHealth(**wanted)
    )


def _backup_health(stored: object) -> BackupHealth | None:
    if not isinstance(stored, dict):
        return None
    overdue, last = stored.get("overdue_at"), stored.get("last_good_at")
    if not isinstance(overdue, int | float) or isinstance(overdue, bool):
        return None
    good = float(last) if isinstance(last, int | float) and not isinstance(last, bool) else None
    return BackupHealth(float(overdue), good)


def node_of(row: Mapping[str, Any]) -> Node:
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
        tenant=row.get("tenant") or None,
        private=bool(row.get("private")),
        certificate_refused=row.get("certificate_refused"),
    )


class Nodes:
    """The `nodes` table."""

    def __init__(
        self, database: sql.Database, clock: Callable[[], float], serials: Serials
    ) -> None:
        self._db = database
        self._clock = clock
        self._serials = serials

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
        certify: Callable[[Node], IssuedCertificate] | None = None,
    ) -> Enrolled:
        """Spend one use of ``token`` and register a node with the next free overlay
        address, in one transaction. Raises TokenRefusedError naming the problem.
        ``certify(node)`` issues the node's first certificate inside that transaction,
        after the token and the node are checked; what it raises undoes the enrollment
        (the token's use is not spent)."""
        prefix = parse_prefix(token, ENROLLMENT_TOKEN)
        now = self._clock()
        with self._db.transaction():
            rows = self._db.query("SELECT * FROM enrollment_tokens WHERE prefix = ?", [prefix])
            if prefix is None or not rows or not key_matches(token, rows[0]["hash"]):
                raise TokenRefusedError(TokenProblem.unknown, prefix)
            record = token_of(rows[0])
            state = record.state(now)
            if state == "revoked":
                raise TokenRefusedError(TokenProblem.revoked, prefix)
            # A retry may find its token used up (by itself) or just expired.
            again = self._enrolled_again(record, wg_public_key, name, now)
            if again is not None:
                return again if certify is None else again.certified(certify(again.node))
            if state != "active":
                raise TokenRefusedError(TokenProblem(state), prefix)
            # A name is one live node's, compared as DNS compares it (without case); its
            # certificate's names are claimed for it alone besides (`certify`).
            holder = self._db.execute(
                "SELECT name, id FROM nodes WHERE lower(name) = ? AND revoked_at IS NULL",
                [name.lower()],
            ).fetchone()
            if holder is not None:
                raise NameTakenError(name, f"{holder[0]}, {holder[1]}")
            # Spent only while a use is left, checked by the UPDATE itself: of two replicas
            # spending the last use at once, the second updates nothing (PostgreSQL makes
            # it wait for the first, then reads the row again).
            spent = self._db.execute(
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
                inserted = self._db.execute(
                    "INSERT INTO nodes (id, name, site, labels, wg_public_key, overlay_address,"
                    " token_prefix, token_hash, enrolled_with, enrolled_at, last_seen, versions,"
                    " capacity, revoked_at, tenant, private) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?,"
                    " ?, NULL, ?, '{}', NULL, ?, ?) ON CONFLICT (overlay_address) DO NOTHING",
                    [node_id, name, record.site, json.dumps(dict(labels)), wg_public_key, address,
                     node_token.prefix, node_token.hash, prefix, now, json.dumps(dict(versions)),
                     record.tenant, int(record.private)],
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
                tenant=record.tenant,
                private=record.private,
            )
            enrolled = Enrolled(node, node_token.plaintext)
            return enrolled if certify is None else enrolled.certified(certify(node))

    def _enrolled_again(
        self, token: EnrollmentToken, wg_public_key: str, name: str, now: float
    ) -> Enrolled | None:
        """Inside enroll's transaction: the node this key enrolled, when this is a retry of
        that enrollment (the same token, the same name, within ENROLL_RETRY_S, neither
        revoked), with a new node token in place of the lost one; None when the key is
        new. AlreadyEnrolledError when the key belongs to another enrollment."""
        rows = self._node_rows(" WHERE wg_public_key = ?", [wg_public_key])
        if not rows:
            return None
        row = rows[0]
        node = node_of(row)
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
        self._db.execute(
            "UPDATE nodes SET token_prefix = ?, token_hash = ? WHERE id = ?",
            [node_token.prefix, node_token.hash, node.id],
        )
        self._serials.bump(AUTH_REVISION)  # the token it replaces is good no more, anywhere
        return Enrolled(node, node_token.plaintext)

    def _next_address(self, overlay_prefix: str, tried: set[str]) -> str:
        """A free host address of the prefix (the first host is the hub's), not one of
        `tried`. Addresses are handed out in order and never reused, so the one after the
        count of nodes is nearly always free: two index lookups. Otherwise (the prefix
        changed, or another replica just took it), the lowest free one."""
        network = ipaddress.ip_network(overlay_prefix)
        count = int(self._db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0])
        if count + 2 < network.num_addresses - 1:
            candidate = str(network[count + 2])  # [0] the network, [1] the hub
            if candidate not in tried:
                taken = self._db.execute(
                    "SELECT 1 FROM nodes WHERE overlay_address = ?", [candidate]
                ).fetchone()
                if taken is None:
                    return candidate
        taken_all = {
            r["overlay_address"] for r in self._db.query("SELECT overlay_address FROM nodes")
        } | tried
        hosts = network.hosts()
        next(hosts)  # the hub
        for address in hosts:
            if str(address) not in taken_all:
                return str(address)
        raise AddressPoolExhaustedError(f"no free address left in {overlay_prefix}")

    def authenticate(self, token: str) -> Node | None:
        """The node a node token belongs to (revoked ones included), or None."""
        prefix = parse_prefix(token, NODE_TOKEN)
        if prefix is None:
            return None
        rows = self._node_rows(" WHERE token_prefix = ?", [prefix])
        if not rows or not key_matches(token, rows[0]["token_hash"]):
            return None
        return node_of(rows[0])

    def record_heartbeats(self, beats: Sequence[Heartbeat]) -> None:
        """Record heartbeats (the last of each node), in one transaction (`HubStore.heartbeats`
        counts their objectives in it too). In the order of the node ids: two replicas
        writing the same nodes lock their rows in one order, so neither waits on the other
        in a cycle."""
        with self._db.transaction():
            self._db.executemany(
                "UPDATE nodes SET last_seen = ?, versions = ?, capacity = ?, address = ?"
                " WHERE id = ?",
                [(b.at, json.dumps(b.versions), b.capacity.model_dump_json(), b.address,
                  b.node_id) for b in sorted(beats, key=lambda b: b.node_id)],
            )  # fmt: skip

    def _node_rows(self, where: str = "", params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Whole rows of the nodes table: the one query every read of nodes goes through
        (`node_of` makes a row a Node). `where`: a constant of this module, never input."""
        return self._db.query(f"SELECT * FROM nodes{where}", params)  # noqa: S608

    def all(self) -> list[Node]:
        return [node_of(r) for r in self._node_rows(" ORDER BY site, name")]

    def snapshot_rows(self) -> list[tuple[Any, ...]]:
        """Every node's columns a planner's snapshot is made of (`SNAPSHOT_COLUMNS`), by
        site and name: what the placement reconciler reads each round (hub/reconciler.py
        makes snapshots again of the rows that changed only)."""
        return [
            tuple(row)
            for row in self._db.execute(
                f"SELECT {SNAPSHOT_COLUMNS} FROM nodes ORDER BY site, name"  # noqa: S608 - constants
            ).fetchall()
        ]

    def wireguard_peers(self) -> dict[str, tuple[str, str]]:
        """Each node's WireGuard public key, with its overlay address and name, of the nodes
        not revoked: what the peers loop reads every few seconds (the columns alone: a
        whole `nodes()` of 10,000 nodes took half a second)."""
        rows = self._db.execute(
            "SELECT wg_public_key, overlay_address, name FROM nodes WHERE revoked_at IS NULL"
        ).fetchall()
        return {str(key): (str(address), str(name)) for key, address, name in rows}

    def health(self, after: str = "", limit: int = HEALTH_CHUNK) -> list[NodeHealth]:
        """The health (`NodeHealth`) of up to `limit` nodes, by id, those after `after`:
        what the alert loop reads each round, a chunk at a time. A read of all 10,000
        nodes at once (`nodes()`: every column, each capacity validated again) held the
        interpreter the node calls share for half a second or more, every round; a chunk
        holds it a few milliseconds, and the calls run between chunks."""
        rows = self._db.execute(
            "SELECT id, name, site, last_seen, revoked_at, capacity FROM nodes"
            " WHERE id > ? ORDER BY id LIMIT ?",
            [after, limit],
        ).fetchall()
        return [_health_of(row) for row in rows]

    def names(self) -> dict[str, str]:
        """Each node's name by its id: how views show the nodes that records name by id."""
        rows = self._db.execute("SELECT id, name FROM nodes").fetchall()
        return {str(node_id): str(name) for node_id, name in rows}

    def get(self, node_id: str) -> Node:
        rows = self._node_rows(" WHERE id = ? OR name = ?", [node_id] * 2)
        if len(rows) != 1:
            raise NotFoundError(f"no single node {node_id!r}")
        return node_of(rows[0])

    def revoke(self, node_id: str) -> Node:
        """Revoke a node: its token is refused from then on. The revision of node
        authentication moves in the same transaction, so every replica drops the answers
        it remembers (`AsyncHubStore.authenticate_node`)."""
        node = self.get(node_id)
        with self._db.transaction():
            changed = self._db.execute(
                "UPDATE nodes SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                [self._clock(), node.id],
            ).rowcount
            if changed:
                self._serials.bump(AUTH_REVISION)
        return self.get(node.id)

    def note_certificate_refused(self, node_id: str, why: str | None) -> None:
        """Why the hub refused the node a certificate (None: it issued one)."""
        if why is None:  # a renewal like any other writes nothing
            self._db.execute(
                "UPDATE nodes SET certificate_refused = NULL WHERE id = ?"
                " AND certificate_refused IS NOT NULL",
                [node_id],
            )
        else:
            self._db.execute(
                "UPDATE nodes SET certificate_refused = ? WHERE id = ?", [why[:1000], node_id]
            )

    def set_draining(self, node_id: str, *, draining: bool) -> Node:
        node = self.get(node_id)
        self._db.execute("UPDATE nodes SET draining = ? WHERE id = ?", [int(draining), node.id])
        return self.get(node.id)
