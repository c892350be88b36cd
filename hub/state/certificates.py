"""Certificates the hub's CA issued nodes, and the names they hold.

A name (a DNS name or an address, never a loopback one) is one live node's at a time: a
claim takes it when it is free, already this node's, held past its last certificate's
expiry, or held by a revoked node (the operator's revocation hands its names back). The
claim is one `INSERT … ON CONFLICT DO UPDATE … WHERE`, whose row count says whether it
won, so two replicas claiming one name at once cannot both have it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from hub.state import sql


class NameTakenError(Exception):
    """A name another live node's certificate holds."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(
            f"{name} is named by the certificate of another node ({holder}); "
            "a name is one node's at a time"
        )
        self.name = name


@dataclass(frozen=True)
class IssuedCertificate:
    serial: str
    node_id: str
    ca: str
    names: list[str]
    issued_at: float
    not_after: float
    pem: str = ""  # the certificate itself (not kept: the node has it)


class Certificates:
    """The `node_certificates` and `node_names` tables."""

    def __init__(self, database: sql.Database, clock: Callable[[], float]) -> None:
        self._db = database
        self._clock = clock

    def claim_names(self, node_id: str, names: Sequence[str], until: float) -> None:
        """Take ``names`` for ``node_id`` until ``until``, all or none (the caller's
        transaction rolls back on NameTakenError)."""
        now = self._clock()
        for name in sorted(set(names)):  # a fixed order: no deadlock between replicas
            won = self._db.execute(
                "INSERT INTO node_names (name, node_id, until) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET node_id = excluded.node_id,"
                " until = CASE WHEN node_names.node_id = excluded.node_id"
                " AND node_names.until > excluded.until THEN node_names.until"
                " ELSE excluded.until END"
                " WHERE node_names.node_id = excluded.node_id OR node_names.until <= ?"
                " OR node_names.node_id IN (SELECT id FROM nodes WHERE revoked_at IS NOT NULL)",
                [name, node_id, until, now],
            ).rowcount
            if won != 1:
                row = self._db.execute(
                    "SELECT n.name, n.id FROM node_names AS h JOIN nodes AS n ON n.id = h.node_id"
                    " WHERE h.name = ?",
                    [name],
                ).fetchone()
                raise NameTakenError(name, f"{row[0]}, {row[1]}" if row else "unknown")

    def issue(
        self,
        node_id: str,
        names: Sequence[str],
        until: float,
        issue: Callable[[], IssuedCertificate],
    ) -> IssuedCertificate:
        """Claim ``names`` and issue (``issue()`` signs) in one transaction: nothing is
        signed for a name the node cannot have, and a name is not held by a certificate
        that was never made."""
        with self._db.transaction():
            self.claim_names(node_id, names, until)
            issued = issue()
            self._db.execute(
                "INSERT INTO node_certificates (serial, node_id, ca, names, issued_at, not_after)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [issued.serial, issued.node_id, issued.ca, json.dumps(issued.names),
                 issued.issued_at, issued.not_after],
            )  # fmt: skip
            return issued

    def of_node(self, node_id: str) -> list[IssuedCertificate]:
        """The node's certificates, newest first."""
        return [
            IssuedCertificate(
                serial=r["serial"],
                node_id=r["node_id"],
                ca=r["ca"],
                names=json.loads(r["names"]),
                issued_at=r["issued_at"],
                not_after=r["not_after"],
            )
            for r in self._db.query(
                "SELECT * FROM node_certificates WHERE node_id = ? ORDER BY issued_at DESC",
                [node_id],
            )
        ]

    def issued_to(self, node_id: str) -> bool:
        """Whether the hub ever issued ``node_id`` a certificate."""
        return (
            self._db.execute(
                "SELECT 1 FROM node_certificates WHERE node_id = ? LIMIT 1", [node_id]
            ).fetchone()
            is not None
        )

    def live(self, now: float) -> dict[str, int]:
        """Certificates not yet expired of nodes not revoked, by issuing CA fingerprint:
        what a CA rotation waits for before the old CA is retired."""
        rows = self._db.execute(
            "SELECT c.ca, COUNT(*) FROM node_certificates AS c JOIN nodes AS n"
            " ON n.id = c.node_id WHERE c.not_after > ? AND n.revoked_at IS NULL"
            " GROUP BY c.ca",
            [now],
        ).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def newest(self) -> dict[str, IssuedCertificate]:
        """Each node's newest certificate (of nodes not revoked), by node id: what the
        metrics and the alerts read of expiries and issuing CAs, in one query."""
        rows = self._db.query(
            "SELECT c.* FROM node_certificates AS c JOIN nodes AS n ON n.id = c.node_id"
            " WHERE n.revoked_at IS NULL AND c.issued_at = (SELECT MAX(issued_at)"
            " FROM node_certificates WHERE node_id = c.node_id)"
        )
        return {
            r["node_id"]: IssuedCertificate(
                serial=r["serial"],
                node_id=r["node_id"],
                ca=r["ca"],
                names=json.loads(r["names"]),
                issued_at=r["issued_at"],
                not_after=r["not_after"],
            )
            for r in rows
        }
