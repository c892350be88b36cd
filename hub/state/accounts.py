"""Accounts of the fleet: service class, quotas and global budgets, and their tenancy: the
nodes whose desired state (hub/state/desired.py) gives each one.

Tenancy (docs/hub.md#tenancy-and-isolation). An account may be bound to a tenant (None: a
shared account), to sites (none: every site), and, with a tenant, restricted to that
tenant's dedicated nodes (`dedicated`). A node's own tenancy is the operator's, never
what the node says (its labels describe it and grant nothing): its enrollment token's
(`kvl hub tokens create --tenant T [--private]`), changed by an operator only (`kvl hub
nodes set`, the console): dedicated to T (class S3), or T's private site (`private`,
class S4). An account reaches a node, or not, until either changes (`account_reaches`):

- an account bound to sites reaches only nodes of those sites, whatever else holds;
- a node with a tenant gets only that tenant's accounts;
- a private node without a tenant gets only accounts that name its site and are not
  restricted to dedicated nodes;
- a shared node gets the shared accounts and the tenants' accounts not restricted to
  their dedicated nodes.

When a binding change withdraws an account from a node that called the hub while the
account reached it (so may have served it), the node is noted in `account_departures`:
what it served of the account before is still its to report (usage in its outbox is
never foreign), until the account reaches it again."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hub.planning.quota import Budget
from hub.state.base import AUTH_REVISION, NotFoundError, StoreBase

if TYPE_CHECKING:
    from hub.state.nodes import Node


class ForeignAccountError(Exception):
    """A node reported usage of, or asked a lease for, an account it does not serve."""

    def __init__(self, message: str, account: str) -> None:
        super().__init__(message)
        self.account = account


@dataclass(frozen=True)
class Tenancy:
    """An account's binding: its tenant (None: shared), its sites (empty: every site), and
    whether only its tenant's dedicated nodes serve it."""

    tenant: str | None = None
    sites: tuple[str, ...] = ()
    dedicated: bool = False

    def __post_init__(self) -> None:
        if self.dedicated and self.tenant is None:
            raise ValueError("an account restricted to dedicated nodes names its tenant")

    @classmethod
    def of(cls, tenant: str | None, sites: str | None, dedicated: int | None) -> Tenancy:
        """From an `accounts` row's columns (sites: a JSON list)."""
        return cls(tenant or None, tuple(json.loads(sites or "[]")), bool(dedicated))


def account_reaches(account: Tenancy, site: str, tenant: str | None, private: bool) -> bool:
    """Whether a node of `site` dedicated to `tenant` (None: to none), `private` or not,
    is given the account (the module's rules)."""
    if account.sites and site not in account.sites:
        return False
    if tenant is not None:
        return account.tenant == tenant
    if private:
        return bool(account.sites) and not account.dedicated
    return not account.dedicated


class AccountsMixin(StoreBase):
    """The `accounts` table."""

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
                    self.clock(),
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

    def accounts(self) -> list[dict[str, Any]]:
        """Every account's row, its sites as a list."""
        return [
            {**r, "sites": json.loads(r["sites"] or "[]"), "dedicated": bool(r["dedicated"])}
            for r in self.db.query("SELECT * FROM accounts ORDER BY name")
        ]

    def set_tenancy(self, name: str, tenancy: Tenancy) -> int:
        """Bind an account to a tenant and sites (or to none: `Tenancy()`); the new serial.
        The nodes it no longer reaches are noted as departed (their usage of it stays
        theirs to report), those it reaches again are not any more."""
        with self.db.transaction():
            row = self.db.execute(  # for_update is a constant, never input
                "SELECT tenant, sites, dedicated, COALESCE(tenancy_at, created_at)"  # noqa: S608
                f" FROM accounts WHERE name = ?{self.db.for_update}",
                [name],
            ).fetchone()
            if row is None:
                raise NotFoundError(
                    f"no account {name!r}; create it with `kvl hub accounts set {name}`",
                    param="account",
                )
            before, since = Tenancy.of(row[0], row[1], row[2]), float(row[3])
            now = self.clock()
            gone, back = [], []
            for node_id, site, tenant, private, last_seen in self.db.execute(
                "SELECT id, site, tenant, private, last_seen FROM nodes"
                " WHERE revoked_at IS NULL ORDER BY id"
            ).fetchall():
                if account_reaches(tenancy, site, tenant or None, bool(private)):
                    back.append((name, node_id))
                elif (
                    last_seen is not None
                    and last_seen >= since
                    and account_reaches(before, site, tenant or None, bool(private))
                ):
                    # It called while the account reached it: it may have served it.
                    gone.append((name, node_id, now))
            self.db.executemany(
                "INSERT INTO account_departures (account, node_id, at) VALUES (?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                gone,
            )
            self.db.executemany(
                "DELETE FROM account_departures WHERE account = ? AND node_id = ?", back
            )
            self.db.execute(
                "UPDATE accounts SET tenant = ?, sites = ?, dedicated = ?, tenancy_at = ?"
                " WHERE name = ?",
                [
                    tenancy.tenant,
                    json.dumps(list(tenancy.sites)),
                    int(tenancy.dedicated),
                    now,
                    name,
                ],
            )
            return self._bump()

    def served_accounts(self, node: Node) -> set[str]:
        """The accounts ``node``'s desired state gives it (the module's rules)."""
        rows = self.db.execute("SELECT name, tenant, sites, dedicated FROM accounts").fetchall()
        return {
            str(r[0])
            for r in rows
            if account_reaches(Tenancy.of(r[1], r[2], r[3]), node.site, node.tenant, node.private)
        }

    def set_node_tenancy(self, node: Node, *, tenant: str | None, private: bool) -> int:
        """The operator sets a node's tenancy: dedicated to ``tenant`` (S3), or, ``private``,
        on a private site (S4); neither: a shared node. The accounts it no longer reaches
        are noted as departed if it ever called (their usage it served stays its to
        report), those it reaches now are not; the new desired serial."""
        changed = replace(node, tenant=tenant or None, private=private)
        with self.db.transaction():
            before, after = self.served_accounts(node), self.served_accounts(changed)
            now = self.clock()
            if node.last_seen is not None:
                self.db.executemany(
                    "INSERT INTO account_departures (account, node_id, at) VALUES (?, ?, ?)"
                    " ON CONFLICT DO NOTHING",
                    [(account, node.id, now) for account in sorted(before - after)],
                )
            self.db.executemany(
                "DELETE FROM account_departures WHERE account = ? AND node_id = ?",
                [(account, node.id) for account in sorted(after)],
            )
            self.db.execute(
                "UPDATE nodes SET tenant = ?, private = ? WHERE id = ?",
                [changed.tenant, int(private), node.id],
            )
            # Replicas remember authenticated nodes (their rows) until this revision
            # moves: the node's tenancy is read from that row.
            self._bump(AUTH_REVISION)
            return self._bump()

    def node_accounts(self, node: Node) -> set[str]:
        """The accounts ``node`` may report usage or ask leases for: those its desired state
        gives it, and those withdrawn from it since it was given them (what it served
        before the binding changed is its own)."""
        departed = self.db.execute(
            "SELECT account FROM account_departures WHERE node_id = ?", [node.id]
        ).fetchall()
        return self.served_accounts(node) | {str(r[0]) for r in departed}
