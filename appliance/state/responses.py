"""The SQL of stored Responses API answers (`previous_response_id`): each answer with the
conversation it ended, per account, until it expires.

:class:`ResponseStore` works on the store's database; the gateway runs its methods on the
AsyncStore's one writer thread. Another account's answers are not found.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.state.store import NotFoundError
from shared.db import transaction

if TYPE_CHECKING:
    from sqlite_utils import Database


class ResponseNotFoundError(NotFoundError):
    """No such response in this account, or it expired."""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    account_id: int
    body: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def put(
        self,
        response_id: str,
        account_id: int,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        *,
        keep_s: float,
        max_per_account: int,
    ) -> None:
        """Keep an answer; an account's oldest beyond `max_per_account` go, as do all that
        expired (each write sweeps, so the table never outgrows its bounds)."""
        now = time.time()
        with transaction(self.db):
            self.db.execute("DELETE FROM responses WHERE expires_at <= ?", [now])
            self.db.execute(
                "INSERT OR REPLACE INTO responses (id, account_id, created_at, expires_at, body,"
                " messages) VALUES (?, ?, ?, ?, ?, ?)",
                [
                    response_id,
                    account_id,
                    now,
                    now + keep_s,
                    json.dumps(body, separators=(",", ":")),
                    json.dumps(messages, separators=(",", ":")),
                ],
            )
            self.db.execute(
                "DELETE FROM responses WHERE account_id = ? AND id NOT IN (SELECT id FROM"
                " responses WHERE account_id = ? ORDER BY created_at DESC LIMIT ?)",
                [account_id, account_id, max_per_account],
            )

    def get(self, response_id: str, account_id: int) -> StoredResponse:
        rows = list(
            self.db.query(
                "SELECT * FROM responses WHERE id = ? AND account_id = ? AND expires_at > ?",
                [response_id, account_id, time.time()],
            )
        )
        if not rows:
            raise ResponseNotFoundError(f"no response {response_id!r} (or it expired)")
        row = rows[0]
        return StoredResponse(
            id=row["id"],
            account_id=row["account_id"],
            body=json.loads(row["body"]),
            messages=json.loads(row["messages"]),
        )

    def delete(self, response_id: str, account_id: int) -> None:
        with transaction(self.db):
            cursor = self.db.execute(
                "DELETE FROM responses WHERE id = ? AND account_id = ?", [response_id, account_id]
            )
        if cursor.rowcount == 0:
            raise ResponseNotFoundError(f"no response {response_id!r}")
