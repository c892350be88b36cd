"""API keys of the fleet's accounts: only their hashes go to the nodes, in the desired
state; the hub checks a client's key itself when a node hands over an offloaded request."""

from __future__ import annotations

from hub.state.base import NotFoundError, StoreBase
from shared.keys import NewKey, generate_key, key_matches, parse_prefix


class ApiKeysMixin(StoreBase):
    """The `api_keys` table (each key of an account in `accounts`)."""

    def create_key(self, account: str, *, admin: bool = False) -> NewKey:
        new = generate_key()
        with self.db.transaction():
            if not self.db.query("SELECT 1 FROM accounts WHERE name = ?", [account]):
                raise NotFoundError(
                    f"no account {account!r}; create it with `kvl hub accounts set {account}`",
                    param="account",
                )
            self.db.execute(
                "INSERT INTO api_keys (prefix, hash, account, admin, created_at, revoked_at)"
                " VALUES (?, ?, ?, ?, ?, NULL)",
                [new.prefix, new.hash, account, int(admin), self.clock()],
            )
            self._bump()
        return new

    def revoke_key(self, prefix: str) -> int:
        with self.db.transaction():
            self._revoke("api_keys", prefix, "key")
            return self._bump()

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
