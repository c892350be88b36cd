"""Quota leases: slices of an account's global budget granted to the nodes that spend it,
sized by the planner (hub/planning/quota.py), and what the ledger says was consumed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hub.planning.quota import Budget, LeaseView, Sizing, grant, remaining
from hub.state import sql

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from hub.state.accounts import Accounts


class ForeignLeaseError(Exception):
    """A node reported a lease the hub granted to another node."""

    def __init__(self, message: str, lease_id: str) -> None:
        super().__init__(message)
        self.lease_id = lease_id


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


class Leases:
    """The `leases` table, against the accounts' budgets (hub/state/accounts.py) and the
    ledger's usage (hub/state/ledger.py)."""

    def __init__(self, database: sql.Database, accounts: Accounts) -> None:
        self._db = database
        self._accounts = accounts

    def consumed(self, account: str, period_start: float, period_end: float) -> int:
        """Tokens of the account's usage in the period that reached the ledger: usage under
        the period's leases (whatever the node's clock said), and usage without a lease
        (a partitioned node's safe capacity) by when it was served."""
        row = self._db.execute(
            "SELECT COALESCE(SUM(tokens), 0) FROM ledger WHERE account = ? AND ("
            " (lease_id IS NULL AND at >= ? AND at < ?)"
            " OR lease_id IN (SELECT id FROM leases WHERE account = ? AND period_start = ?))",
            [account, period_start, period_end, account, period_start],
        ).fetchone()
        return int(row[0])

    def views(self, account: str, period_start: float) -> tuple[LeaseView, ...]:
        rows = self._db.execute(
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

    def holders(self, now: float) -> set[str]:
        """Nodes holding a lease that may still be spent (unexpired, no final report)."""
        rows = self._db.execute(
            "SELECT DISTINCT node_id FROM leases WHERE final IS NULL AND expires_at > ?", [now]
        ).fetchall()
        return {r[0] for r in rows}

    @sql.retrying()
    def renew(
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
        with self._db.transaction():
            if grant_new and accounts:
                for account in sorted(set(accounts)):
                    self._db.execute(
                        f"SELECT name FROM accounts WHERE name = ?{self._db.for_update}",  # noqa: S608 - a constant
                        [account],
                    ).fetchall()
            foreign = {lease for lease, owner in self.owners(finals).items() if owner[0] != node_id}
            if foreign:
                raise ForeignLeaseError(
                    f"lease {min(foreign)} was not granted to this node", min(foreign)
                )
            for lease_id, spent in finals.items():
                self._db.execute(
                    "UPDATE leases SET final = ? WHERE id = ? AND node_id = ? AND final IS NULL",
                    [max(0, int(spent)), lease_id, node_id],
                )
            if not grant_new:
                return granted
            for account in accounts:
                budget = self._accounts.budget(account)
                if budget is None:
                    continue
                start, end = budget.period(now)
                views = self.views(account, start)
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
                    self._db.execute(
                        "INSERT INTO leases (id, account, node_id, period_start, granted, final,"
                        " expires_at, created_at) VALUES (?, ?, ?, ?, ?, NULL, ?, ?)",
                        [lease.id, account, node_id, start, tokens, lease.expires_at, now],
                    )
                granted.append(lease)
        return granted

    def quota(self, account: str, now: float) -> Quota | None:
        """An account's budget in the current period: consumed, leased per node, left."""
        budget = self._accounts.budget(account)
        if budget is None:
            return None
        start, end = budget.period(now)
        views = self.views(account, start)
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

    def owners(self, lease_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
        """The node each of these leases was granted to, and its account (ids the hub
        never stored, such as a grant of nothing, are absent)."""
        ids = sorted(set(lease_ids))
        owners: dict[str, tuple[str, str]] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for lease_id, node_id, account in self._db.execute(
                f"SELECT id, node_id, account FROM leases WHERE id IN ({marks})",  # noqa: S608 - placeholders only
                chunk,
            ).fetchall():
                owners[str(lease_id)] = (str(node_id), str(account))
        return owners

    def quotas(self, now: float) -> list[tuple[dict[str, Any], Quota | None]]:
        """Every account (its row) with its budget this period (None: it has none)."""
        return [(account, self.quota(account["name"], now)) for account in self._accounts.all()]
