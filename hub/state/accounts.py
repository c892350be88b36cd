"""Accounts of the fleet: service class, quotas and global budgets, their API keys, and
their tenancy: the nodes whose desired state (hub/state/desired.py) gives each one, by the
rules of hub/planning/tenancy.py.

Only the keys' hashes go to the nodes, in the desired state; the hub checks a client's key
itself when a node hands over an offloaded request.

When a binding change withdraws an account from a node that called the hub while the
account reached it (so may have served it), the node is noted in `account_departures`:
what it served of the account before is still its to report (usage in its outbox is
never foreign), until the account reaches it again."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hub.planning.quota import Budget
from hub.planning.tenancy import Tenancy, account_reaches
from hub.state.errors import NotFoundError
from hub.state.serials import AUTH_REVISION
from shared.keys import NewKey, generate_key, key_matches, parse_prefix

if TYPE_CHECKING:
    from collections.abc import Callable

    from hub.state import sql
    from hub.state.nodes import Node
    from hub.state.serials import Serials


class ForeignAccountError(Exception):
    """A node reported usage of, or asked a lease for, an account it does not serve."""

    def __init__(self, message: str, account: str) -> None:
        super().__init__(message)
        self.account = account


class Accounts:
    """The `accounts`, `api_keys` and `account_departures` tables (and the tenancy columns
    of `nodes`)."""

    def __init__(
        self, database: sql.Database, clock: Callable[[], float], serials: Serials
    ) -> None:
        self._db = database
        self._clock = clock
        self._serials = serials

    def put(
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
        with self._db.transaction():
            self._db.execute(
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
                    self._clock(),
                ],
            )
            return self._serials.bump()

    def budget(self, account: str) -> Budget | None:
        row = self._db.execute(
            "SELECT budget_tokens, budget_period_s FROM accounts WHERE name = ?", [account]
        ).fetchone()
        if row is None or row[0] is None:
            return None
        return Budget(int(row[0]), float(row[1]))

    def all(self) -> list[dict[str, Any]]:
        """Every account's row, its sites as a list."""
        return [
            {**r, "sites": json.loads(r["sites"] or "[]"), "dedicated": bool(r["dedicated"])}
            for r in self._db.query("SELECT * FROM accounts ORDER BY name")
        ]

    def set_tenancy(self, name: str, tenancy: Tenancy) -> int:
        """Bind an account to a tenant and sites (or to none: `Tenancy()`); the new serial.
        The nodes it no longer reaches are noted as departed (their usage of it stays
        theirs to report), those it reaches again are not any more."""
        with self._db.transaction():
            row = self._db.execute(  # for_update is a constant, never input
                "SELECT tenant, sites, dedicated, COALESCE(tenancy_at, created_at)"  # noqa: S608
                f" FROM accounts WHERE name = ?{self._db.for_update}",
                [name],
            ).fetchone()
            if row is None:
                raise NotFoundError(
                    f"no account {name!r}; create it with `kvl hub accounts set {name}`",
                    param="account",
                )
            before, since = Tenancy.of(row[0], row[1], row[2]), float(row[3])
            now = self._clock()
            gone, back = [], []
            for node_id, site, tenant, private, last_seen in self._db.execute(
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
            self._db.executemany(
                "INSERT INTO account_departures (account, node_id, at) VALUES (?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                gone,
            )
            self._db.executemany(
                "DELETE FROM account_departures WHERE account = ? AND node_id = ?", back
            )
            self._db.execute(
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
            return self._serials.bump()

    def served(self, node: Node) -> set[str]:
        """The accounts ``node``'s desired state gives it (the module's rules)."""
        rows = self._db.execute("SELECT name, tenant, sites, dedicated FROM accounts").fetchall()
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
        with self._db.transaction():
            before, after = self.served(node), self.served(changed)
            now = self._clock()
            if node.last_seen is not None:
                self._db.executemany(
                    "INSERT INTO account_departures (account, node_id, at) VALUES (?, ?, ?)"
                    " ON CONFLICT DO NOTHING",
                    [(account, node.id, now) for account in sorted(before - after)],
                )
            self._db.executemany(
                "DELETE FROM account_departures WHERE account = ? AND node_id = ?",
                [(account, node.id) for account in sorted(after)],
            )
            self._db.execute(
                "UPDATE nodes SET tenant = ?, private = ? WHERE id = ?",
                [changed.tenant, int(private), node.id],
            )
            # Replicas remember authenticated nodes (their rows) until this revision
            # moves: the node's tenancy is read from that row.
            self._serials.bump(AUTH_REVISION)
            return self._serials.bump()

    def node_accounts(self, node: Node) -> set[str]:
        """The accounts ``node`` may report usage or ask leases for: those its desired state
        gives it, and those withdrawn from it since it was given them (what it served
        before the binding changed is its own)."""
        departed = self._db.execute(
            "SELECT account FROM account_departures WHERE node_id = ?", [node.id]
        ).fetchall()
        return self.served(node) | {str(r[0]) for r in departed}

    # -- API keys ----------------------------------------------------------------------------

    def create_key(self, account: str, *, admin: bool = False) -> NewKey:
        new = generate_key()
        with self._db.transaction():
            if not self._db.query("SELECT 1 FROM accounts WHERE name = ?", [account]):
                raise NotFoundError(
                    f"no account {account!r}; create it with `kvl hub accounts set {account}`",
                    param="account",
                )
            self._db.execute(
                "INSERT INTO api_keys (prefix, hash, account, admin, created_at, revoked_at)"
                " VALUES (?, ?, ?, ?, ?, NULL)",
                [new.prefix, new.hash, account, int(admin), self._clock()],
            )
            self._serials.bump()
        return new

    def revoke_key(self, prefix: str) -> int:
        with self._db.transaction():
            done = self._db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL",
                [self._clock(), prefix],
            )
            if done.rowcount == 0:
                raise NotFoundError(f"no active key {prefix!r}")
            return self._serials.bump()

    def key_account(self, key: str) -> str | None:
        """The account of an active API key (a client's, as a node hands it over with an
        offloaded request); None for a key unknown or revoked."""
        prefix = parse_prefix(key)
        if prefix is None:
            return None
        row = self._db.execute(
            "SELECT hash, account, revoked_at FROM api_keys WHERE prefix = ?", [prefix]
        ).fetchone()
        if row is None or row[2] is not None or not key_matches(key, row[0]):
            return None
        return str(row[1])

    def keys(self) -> list[dict[str, Any]]:
        """Every API key (prefix, account, admin, created, revoked), never its hash: what
        the console lists."""
        rows = self._db.execute(
            "SELECT prefix, account, admin, created_at, revoked_at FROM api_keys"
            " ORDER BY account, created_at"
        ).fetchall()
        return [
            {"prefix": r[0], "account": r[1], "admin": bool(r[2]), "created_at": r[3],
             "revoked_at": r[4]}
            for r in rows
        ]  # fmt: skip
