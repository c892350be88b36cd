"""Operator tokens: what the operator API (`/v1/admin/…`) and the console's CLI check."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hub.state.errors import NotFoundError
from shared.keys import OPERATOR_TOKEN, NewKey, generate_key, key_matches, parse_prefix

if TYPE_CHECKING:
    from collections.abc import Callable

    from hub.state import sql


class Operators:
    """The `operators` table."""

    def __init__(self, database: sql.Database, clock: Callable[[], float]) -> None:
        self._db = database
        self._clock = clock

    def create(self, name: str) -> NewKey:
        new = generate_key(OPERATOR_TOKEN)
        self._db.execute(
            "INSERT INTO operators (prefix, hash, name, created_at) VALUES (?, ?, ?, ?)",
            [new.prefix, new.hash, name, self._clock()],
        )
        return new

    def authenticate(self, token: str) -> str | None:
        """The operator's name for a valid, unrevoked token; None otherwise."""
        prefix = parse_prefix(token, OPERATOR_TOKEN)
        if prefix is None:
            return None
        row = self._db.execute(
            "SELECT hash, name, revoked_at FROM operators WHERE prefix = ?", [prefix]
        ).fetchone()
        if row is None or row[2] is not None or not key_matches(token, row[0]):
            return None
        return str(row[1])

    def revoke(self, prefix: str) -> None:
        done = self._db.execute(
            "UPDATE operators SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL",
            [self._clock(), prefix],
        )
        if done.rowcount == 0:
            raise NotFoundError(f"no active operator token {prefix!r}")
