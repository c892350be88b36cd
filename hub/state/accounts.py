"""Accounts of the fleet: service class, quotas and global budgets, pushed to every node in
its desired state (hub/state/desired.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hub.planning.quota import Budget
from hub.state.base import StoreBase

if TYPE_CHECKING:
    from hub.state.nodes import Node


class ForeignAccountError(Exception):
    """A node reported usage of, or asked a lease for, an account it does not serve."""

    def __init__(self, message: str, account: str) -> None:
        super().__init__(message)
        self.account = account


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
        return list(self.db.query("SELECT * FROM accounts ORDER BY name"))

    def node_accounts(self, node: Node) -> set[str]:
        """The accounts ``node`` serves: those its desired state gives it, the only ones it
        may report usage or ask leases for. Today every account of the fleet."""
        del node  # every node serves every account until accounts are bound to tenants
        return {str(r[0]) for r in self.db.execute("SELECT name FROM accounts").fetchall()}
