"""Operator tokens: what the operator API (`/v1/admin/…`) and the console's CLI check."""

from __future__ import annotations

from hub.state.base import StoreBase
from shared.keys import OPERATOR_TOKEN, NewKey, generate_key, key_matches, parse_prefix


class OperatorsMixin(StoreBase):
    """The `operators` table."""

    def create_operator(self, name: str) -> NewKey:
        new = generate_key(OPERATOR_TOKEN)
        self.db.execute(
            "INSERT INTO operators (prefix, hash, name, created_at) VALUES (?, ?, ?, ?)",
            [new.prefix, new.hash, name, self.clock()],
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
