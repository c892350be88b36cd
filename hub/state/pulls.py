"""Model pulls the operator asked for (`POST /v1/admin/models`): durable jobs the hub's pull
loop runs one at a time (hub/models/jobs.py), with their progress, so a pull outlives the
request that started it, shows its bytes to whoever looks, can be cancelled, and goes on
after the hub restarts."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hub.state.errors import ConflictError, NotFoundError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from hub.state import sql

PullState = Literal["queued", "running", "done", "failed", "cancelled"]
FINISHED = ("done", "failed", "cancelled")


@dataclass(frozen=True)
class Pull:
    id: str
    reference: str
    name: str | None
    version: str | None
    memory_mib: int | None
    state: PullState
    done_bytes: int
    total_bytes: int | None
    model: str | None  # the registered model's ref, once done
    error_kind: str | None
    error: str | None
    created_by: str
    created_at: float
    updated_at: float


def _pull(row: Sequence[Any]) -> Pull:
    return Pull(*row)


class Pulls:
    """The `model_pulls` table."""

    def __init__(self, database: sql.Database, clock: Callable[[], float]) -> None:
        self._db = database
        self._clock = clock

    def create(
        self,
        reference: str,
        name: str | None,
        version: str | None,
        memory_mib: int | None,
        created_by: str,
    ) -> Pull:
        now = self._clock()
        pull_id = f"pull_{secrets.token_hex(8)}"
        self._db.execute(
            "INSERT INTO model_pulls (id, reference, name, version, memory_mib, state,"
            " done_bytes, created_by, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, 'queued', 0, ?, ?, ?)",
            [pull_id, reference, name, version, memory_mib, created_by, now, now],
        )
        return self.get(pull_id)

    def get(self, pull_id: str) -> Pull:
        row = self._db.execute(
            "SELECT id, reference, name, version, memory_mib, state, done_bytes, total_bytes,"
            " model, error_kind, error, created_by, created_at, updated_at"
            " FROM model_pulls WHERE id = ?",
            [pull_id],
        ).fetchone()
        if row is None:
            raise NotFoundError(f"no model pull {pull_id!r}", param="id")
        return _pull(row)

    def recent(self, limit: int = 50) -> list[Pull]:
        rows = self._db.execute(
            "SELECT id, reference, name, version, memory_mib, state, done_bytes, total_bytes,"
            " model, error_kind, error, created_by, created_at, updated_at"
            " FROM model_pulls ORDER BY created_at DESC, id LIMIT ?",
            [limit],
        ).fetchall()
        return [_pull(r) for r in rows]

    def claim(self) -> Pull | None:
        """The oldest queued pull, now running (a conditional UPDATE: one hub replica wins)."""
        with self._db.transaction():
            row = self._db.execute(
                "SELECT id FROM model_pulls WHERE state = 'queued' ORDER BY created_at, id LIMIT 1"
            ).fetchone()
            if row is None:
                return None
            claimed = self._db.execute(
                "UPDATE model_pulls SET state = 'running', updated_at = ?"
                " WHERE id = ? AND state = 'queued'",
                [self._clock(), row[0]],
            ).rowcount
        return self.get(row[0]) if claimed else None

    def progress(self, pull_id: str, done_bytes: int, total_bytes: int | None) -> PullState:
        """Record how far it got; its state now (`cancelled`: the operator stopped it)."""
        self._db.execute(
            "UPDATE model_pulls SET done_bytes = ?, total_bytes = ?, updated_at = ?"
            " WHERE id = ? AND state = 'running'",
            [done_bytes, total_bytes, self._clock(), pull_id],
        )
        return self.get(pull_id).state

    def finish(self, pull_id: str, model: str) -> None:
        self._db.execute(
            "UPDATE model_pulls SET state = 'done', model = ?, updated_at = ?"
            " WHERE id = ? AND state = 'running'",
            [model, self._clock(), pull_id],
        )

    def fail(self, pull_id: str, kind: str, message: str) -> None:
        self._db.execute(
            "UPDATE model_pulls SET state = 'failed', error_kind = ?, error = ?, updated_at = ?"
            " WHERE id = ? AND state IN ('queued', 'running')",
            [kind, message[:2000], self._clock(), pull_id],
        )

    def cancel(self, pull_id: str) -> Pull:
        """Stop a pull that has not finished (the loop sees it at its next progress)."""
        done = self._db.execute(
            "UPDATE model_pulls SET state = 'cancelled', updated_at = ?"
            " WHERE id = ? AND state IN ('queued', 'running')",
            [self._clock(), pull_id],
        ).rowcount
        pull = self.get(pull_id)
        if not done:
            raise ConflictError(f"model pull {pull_id} is {pull.state} already")
        return pull

    def requeue_running(self) -> int:
        """Pulls a stopped hub was running, queued again (each goes on from its part file)."""
        return self._db.execute(
            "UPDATE model_pulls SET state = 'queued', updated_at = ? WHERE state = 'running'",
            [self._clock()],
        ).rowcount
