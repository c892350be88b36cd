"""The ledger: every event the nodes sync (usage, package reports), stored once by its id
whichever replica gets it first, in group commits. A package report new to the ledger
updates the packages' copies too (hub/state/packages.py), in the same transaction."""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import TYPE_CHECKING, Any

from hub.state import sql
from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from hub.state.packages import Packages


# A ledger row: event id, node id, kind, body (JSON), received at, account, tokens,
# lease id, when served (the last four for usage events only).
LedgerRow = tuple[str, str, str, str, float, str | None, int | None, str | None, float | None]


def ledger_rows(node_id: str, events: Iterable[protocol.Event], now: float) -> list[LedgerRow]:
    """A node's events (validated: bounded, non-negative numbers) as ledger rows."""
    return [(e.id, node_id, e.kind, e.body.model_dump_json(), now, *_usage(e, now))
            for e in events]  # fmt: skip


def _usage(
    event: protocol.Event, received_at: float
) -> tuple[str | None, int | None, str | None, float | None]:
    """(account, tokens, lease id, when) of a usage event; Nones for other kinds."""
    if not isinstance(event, protocol.UsageEvent):
        return None, None, None, None
    body = event.body
    at = received_at
    if body.created_at:
        with contextlib.suppress(ValueError, OverflowError, OSError):
            at = datetime.fromisoformat(body.created_at).timestamp()
    return body.account, body.tokens_in + body.tokens_out, body.lease_id, at


class Ledger:
    """The `ledger` table; package reports also update the packages' copies."""

    def __init__(
        self, database: sql.Database, clock: Callable[[], float], packages: Packages
    ) -> None:
        self._db = database
        self._clock = clock
        self._packages = packages

    def ingest(self, node_id: str, events: Iterable[protocol.Event]) -> tuple[list[str], int]:
        """Store a batch of a node's events; (every id acknowledged, how many were new).
        An event already in the ledger is acknowledged again and not stored twice: the
        ledger's key is the event id, an INSERT of one already there changes nothing, and
        its row count says so, whichever replica got the batch first."""
        events = list(events)
        [(ids, new, _)] = self.store_events(
            [(node_id, events, ledger_rows(node_id, events, self._clock()))]
        )
        return ids, new

    @sql.retrying()
    def store_events(
        self, batches: Sequence[tuple[str, Sequence[protocol.Event], list[LedgerRow]]]
    ) -> list[tuple[list[str], int, dict[str, int]]]:
        """Several nodes' batches (node id, events, their `ledger_rows`) in one transaction,
        so in one durable commit; for each, as `ingest` answers, and how many were new of
        each kind."""
        insert = (
            "INSERT INTO ledger (event_id, node_id, kind, body, received_at, account, tokens,"
            " lease_id, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        )
        answers: dict[int, tuple[list[str], int, dict[str, int]]] = {}
        with self._db.transaction():
            # All the group's usage in a few statements, in the order of its ids: two
            # replicas storing overlapping batches lock the same keys in one order. An id
            # the statement returns was inserted now: new, for the first batch holding it.
            stored = self._insert_usage(
                sorted((r for b in batches for r in b[2] if r[2] == "usage"), key=lambda r: r[0])
            )
            order = sorted(
                range(len(batches)), key=lambda i: min((r[0] for r in batches[i][2]), default="")
            )
            for index in order:
                node_id, events, rows = batches[index]
                fresh: dict[str, int] = {}
                for row in rows:
                    if row[2] == "usage" and row[0] in stored:
                        stored.discard(row[0])
                        fresh["usage"] = fresh.get("usage", 0) + 1
                for event, row in zip(events, rows, strict=True):
                    if row[2] == "usage":
                        continue
                    # Others one by one, in the node's order, each applied if it was new.
                    if self._db.execute(insert, row).rowcount == 0:
                        continue
                    fresh[row[2]] = fresh.get(row[2], 0) + 1
                    self._packages.apply_report(node_id, event, row[4])
                answers[index] = ([r[0] for r in rows], sum(fresh.values()), fresh)
        return [answers[i] for i in range(len(batches))]

    _USAGE_ROWS_PER_STATEMENT = 500  # 9 parameters each: under both databases' limits

    def _insert_usage(self, rows: Sequence[LedgerRow]) -> set[str]:
        """Insert usage rows (a row whose id is in the ledger already changes nothing);
        the ids inserted now. One multi-row statement per chunk: on PostgreSQL a round
        trip each, where one per row was most of a group commit's time."""
        inserted: set[str] = set()
        for start in range(0, len(rows), self._USAGE_ROWS_PER_STATEMENT):
            chunk = rows[start : start + self._USAGE_ROWS_PER_STATEMENT]
            values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            inserted.update(
                str(r[0])
                for r in self._db.execute(
                    "INSERT INTO ledger (event_id, node_id, kind, body, received_at, account,"  # noqa: S608 - placeholders only
                    f" tokens, lease_id, at) VALUES {values} ON CONFLICT DO NOTHING"
                    " RETURNING event_id",
                    [value for row in chunk for value in row],
                ).fetchall()
            )
        return inserted

    def count(self, node_id: str | None = None) -> int:
        sql, params = "SELECT COUNT(*) AS n FROM ledger", []
        if node_id is not None:
            sql, params = sql + " WHERE node_id = ?", [node_id]
        return int(self._db.query(sql, params)[0]["n"])

    def node_events(self, node_id: str, limit: int) -> list[dict[str, Any]]:
        """The node's latest events, newest first: what the console shows of a node."""
        rows = self._db.execute(
            "SELECT event_id, kind, received_at, account, tokens FROM ledger WHERE node_id = ?"
            " ORDER BY received_at DESC LIMIT ?",
            [node_id, limit],
        ).fetchall()
        keys = ("event_id", "kind", "received_at", "account", "tokens")
        return [dict(zip(keys, r, strict=True)) for r in rows]
