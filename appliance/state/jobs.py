"""The SQL of durable jobs (IF-4): jobs, their items, webhook secrets and deliveries.

:class:`JobStore` works on the store's database; the gateway runs its methods on the
AsyncStore's one writer thread (``store.run(jobs.get, ...)``), the CLI calls them directly.
Each method is one transaction (`shared.db.transaction`), so a job and its items, an item's
result and the end of its job, or a cancel and its webhook delivery are committed together or
not at all.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from appliance.state.store import ConflictError, NotFoundError
from shared.db import transaction

if TYPE_CHECKING:
    from collections.abc import Collection

    from sqlite_utils import Database

JobStatus = Literal["queued", "running", "completed", "failed", "cancelled"]
ItemStatus = Literal["pending", "completed", "failed", "cancelled"]
DeliveryStatus = Literal["pending", "delivered", "failed"]

# Usage events of items are keyed by this namespace and the item: an item is charged once,
# even when a restart runs it again after its usage was committed.
_USAGE_NAMESPACE = uuid.UUID("4f1c2a7e-7d0b-4a52-9a4e-2f0a3c5b6d71")


class JobNotFoundError(NotFoundError):
    """No such job in this account (another account's jobs are not found either)."""


class JobFinishedError(ConflictError):
    """The job already ended; it cannot be cancelled."""


@dataclass(frozen=True)
class NewItem:
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Delivery:
    id: str
    job_id: str
    account_id: int
    url: str
    event: str
    payload: str | None
    status: DeliveryStatus
    attempts: int
    created_at: float
    first_attempt_at: float | None
    last_attempt_at: float | None
    next_attempt_at: float | None
    last_status: int | None
    last_error: str | None
    delivered_at: float | None


@dataclass(frozen=True)
class Job:
    id: str
    account_id: int
    key_prefix: str
    status: JobStatus
    total: int
    completed: int  # items that ended with a 2xx result
    failed: int  # items that ended with an error result
    metadata: dict[str, str]
    webhook_url: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    delivery: Delivery | None

    @property
    def active(self) -> bool:
        return self.status in ("queued", "running")


@dataclass(frozen=True)
class ItemResult:
    index: int
    custom_id: str
    status_code: int
    response: dict[str, Any]


@dataclass(frozen=True)
class PendingItem:
    job_id: str
    index: int
    custom_id: str
    url: str
    body: dict[str, Any]
    attempts: int
    account: str
    key_prefix: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.index)

    @property
    def usage_id(self) -> str:
        return uuid.uuid5(_USAGE_NAMESPACE, f"{self.job_id}/{self.index}").hex


@dataclass(frozen=True)
class SigningSecrets:
    current: str
    previous: tuple[str, ...]  # rotated secrets still in their grace period


@dataclass(frozen=True)
class ItemOutcome:
    recorded: bool  # False: the item already had a result
    ended: Job | None  # the job, when this item was its last


def new_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


class JobStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- the API's operations --------------------------------------------------------------

    def create(
        self,
        *,
        account_id: int,
        key_prefix: str,
        items: list[NewItem],
        metadata: dict[str, str],
        webhook_url: str | None,
    ) -> Job:
        job_id = "job_" + uuid.uuid4().hex
        now = time.time()
        with transaction(self.db):
            self.db.execute(
                "INSERT INTO jobs (id, account_id, key_prefix, status, total, metadata,"
                " webhook_url, created_at) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?)",
                [
                    job_id,
                    account_id,
                    key_prefix,
                    len(items),
                    json.dumps(metadata),
                    webhook_url,
                    now,
                ],
            )
            self.db.conn.executemany(
                "INSERT INTO job_items (job_id, idx, custom_id, url, body, status, attempts)"
                " VALUES (?, ?, ?, ?, ?, 'pending', 0)",
                [
                    (job_id, i, item.custom_id, item.url, json.dumps(item.body))
                    for i, item in enumerate(items)
                ],
            )
            if webhook_url is not None:
                # Made now, not at the first delivery, so the operator can hand it out at once.
                self._ensure_secret(account_id, now)
        return self.get(job_id)

    def get(self, job_id: str, account_id: int | None = None) -> Job:
        """The job; with `account_id`, only if that account owns it."""
        sql = _JOB_SELECT + " WHERE j.id = ?"
        params: list[Any] = [job_id]
        if account_id is not None:
            sql += " AND j.account_id = ?"
            params.append(account_id)
        rows = list(self.db.query(sql, params))
        if not rows:
            raise JobNotFoundError(f"no job {job_id!r} in this account")
        return self._job(rows[0])

    def list_jobs(
        self, account_id: int | None, *, after: str | None, limit: int
    ) -> tuple[list[Job], bool]:
        """Jobs newest first, `limit` of them after the job `after` (None: from the
        newest), and whether there are more; with `account_id`, only that account's (an
        `after` it does not own is not found)."""
        where = ""
        params: list[Any] = []
        if account_id is not None:
            where, params = " WHERE j.account_id = ?", [account_id]
        if after is not None:
            ref = self.get(after, account_id)
            where += (" AND" if where else " WHERE") + (
                " (j.created_at < ? OR (j.created_at = ? AND j.id < ?))"
            )
            params += [ref.created_at, ref.created_at, ref.id]
        rows = list(
            self.db.query(
                _JOB_SELECT + where + " ORDER BY j.created_at DESC, j.id DESC LIMIT ?",
                [*params, limit + 1],
            )
        )
        return [self._job(r) for r in rows[:limit]], len(rows) > limit

    def results(
        self, job_id: str, account_id: int, *, after: str | None, limit: int
    ) -> tuple[list[ItemResult], bool]:
        """Results of the items that ended, in request order, after the item `after` (its
        custom_id); and whether more follow."""
        self.get(job_id, account_id)
        start = -1
        if after is not None:
            row = self.db.execute(
                "SELECT idx FROM job_items WHERE job_id = ? AND custom_id = ?", [job_id, after]
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no item with custom_id {after!r} in job {job_id}")
            start = int(row[0])
        rows = self.db.execute(
            "SELECT idx, custom_id, status_code, response FROM job_items"
            " WHERE job_id = ? AND idx > ? AND status IN ('completed', 'failed')"
            " ORDER BY idx LIMIT ?",
            [job_id, start, limit + 1],
        ).fetchall()
        results = [
            ItemResult(index=r[0], custom_id=r[1], status_code=r[2], response=json.loads(r[3]))
            for r in rows[:limit]
        ]
        return results, len(rows) > limit

    def cancel(self, job_id: str, account_id: int) -> Job:
        """Cancel an active job: items not yet ended never run; results so far stay."""
        now = time.time()
        with transaction(self.db):
            job = self.get(job_id, account_id)
            if not job.active:
                raise JobFinishedError(
                    f"job {job_id} already ended ({job.status}); only a queued or running job "
                    "can be cancelled"
                )
            self.db.execute(
                "UPDATE job_items SET status = 'cancelled', ended_at = ?"
                " WHERE job_id = ? AND status = 'pending'",
                [now, job_id],
            )
            self._end(job, "cancelled", now)
        return self.get(job_id)

    # -- the runner ------------------------------------------------------------------------

    def pending_items(
        self, limit: int, skip: Collection[tuple[str, int]] = ()
    ) -> list[PendingItem]:
        """The next items to run: oldest job first, in request order, without those in `skip`
        (running already). Job by job, so each step reads an index range, however many
        items wait."""
        jobs = self.db.execute(
            "SELECT j.id, a.name, j.key_prefix FROM jobs j JOIN accounts a ON a.id = j.account_id"
            " WHERE j.status IN ('queued', 'running') ORDER BY j.created_at, j.rowid"
        ).fetchall()
        items: list[PendingItem] = []
        for job_id, account, key_prefix in jobs:
            rows = self.db.execute(
                "SELECT idx, custom_id, url, body, attempts FROM job_items"
                " WHERE job_id = ? AND status = 'pending' ORDER BY idx LIMIT ?",
                [job_id, limit - len(items) + len(skip)],
            ).fetchall()
            for index, custom_id, url, body, attempts in rows:
                if (job_id, index) in skip:
                    continue
                items.append(
                    PendingItem(
                        job_id=job_id,
                        index=index,
                        custom_id=custom_id,
                        url=url,
                        body=json.loads(body),
                        attempts=attempts,
                        account=account,
                        key_prefix=key_prefix,
                    )
                )
                if len(items) == limit:
                    return items
        return items

    def start(self, job_id: str) -> bool:
        """Mark a queued job running; False if it was not queued."""
        with transaction(self.db):
            cur = self.db.execute(
                "UPDATE jobs SET status = 'running', started_at = ?"
                " WHERE id = ? AND status = 'queued'",
                [time.time(), job_id],
            )
        return cur.rowcount == 1

    def finish_item(
        self, job_id: str, index: int, status_code: int, response: dict[str, Any]
    ) -> ItemOutcome:
        """Commit an item's result; the job ends in the same transaction when it was the last.

        An item that ended while its job was being cancelled keeps its result (its tokens
        are spent and charged); an item that already has one keeps it.
        """
        now = time.time()
        status: ItemStatus = "completed" if 200 <= status_code < 300 else "failed"
        with transaction(self.db):
            cur = self.db.execute(
                "UPDATE job_items SET status = ?, status_code = ?, response = ?, ended_at = ?"
                " WHERE job_id = ? AND idx = ? AND status IN ('pending', 'cancelled')",
                [status, status_code, json.dumps(response), now, job_id, index],
            )
            if cur.rowcount == 0:
                return ItemOutcome(recorded=False, ended=None)
            waiting = self.db.execute(
                "SELECT 1 FROM job_items WHERE job_id = ? AND status = 'pending' LIMIT 1",
                [job_id],
            ).fetchone()
            if waiting is not None:
                return ItemOutcome(recorded=True, ended=None)
            job = self.get(job_id)
            if not job.active:  # cancelled: it ended already
                return ItemOutcome(recorded=True, ended=None)
            self._end(job, "failed" if job.failed == job.total else "completed", now)
        return ItemOutcome(recorded=True, ended=self.get(job_id))

    def retry_item(self, job_id: str, index: int) -> int:
        """Count a transient failure of an item; returns its failures so far."""
        with transaction(self.db):
            self.db.execute(
                "UPDATE job_items SET attempts = attempts + 1 WHERE job_id = ? AND idx = ?",
                [job_id, index],
            )
            row = self.db.execute(
                "SELECT attempts FROM job_items WHERE job_id = ? AND idx = ?", [job_id, index]
            ).fetchone()
        return int(row[0]) if row is not None else 0

    def usage_recorded(self, usage_id: str) -> bool:
        row = self.db.execute("SELECT 1 FROM usage_events WHERE id = ?", [usage_id]).fetchone()
        return row is not None

    def _end(self, job: Job, status: JobStatus, now: float) -> None:
        """End a job, and schedule its webhook (inside the caller's transaction)."""
        self.db.execute(
            "UPDATE jobs SET status = ?, ended_at = ? WHERE id = ?", [status, now, job.id]
        )
        if job.webhook_url is not None:
            self.db.execute(
                "INSERT INTO webhook_deliveries (id, job_id, account_id, url, event, status,"
                " attempts, created_at, next_attempt_at)"
                " VALUES (?, ?, ?, ?, ?, 'pending', 0, ?, ?)",
                [
                    "dlv_" + uuid.uuid4().hex,
                    job.id,
                    job.account_id,
                    job.webhook_url,
                    f"job.{status}",
                    now,
                    now,
                ],
            )

    # -- webhook secrets -------------------------------------------------------------------

    def signing_secrets(self, account_id: int) -> SigningSecrets:
        """The secrets a delivery to this account is signed with (made on first use)."""
        now = time.time()
        with transaction(self.db):
            self._ensure_secret(account_id, now)
            row = self.db.execute(
                "SELECT secret, previous_secret, previous_until FROM webhook_secrets"
                " WHERE account_id = ?",
                [account_id],
            ).fetchone()
        previous = (row[1],) if row[1] is not None and (row[2] or 0) > now else ()
        return SigningSecrets(current=row[0], previous=previous)

    def webhook_secret(self, account: str, *, rotate: bool = False, grace_s: float = 0.0) -> str:
        """An account's webhook secret (made if it has none); `rotate` replaces it, the old
        one still signing for `grace_s`."""
        now = time.time()
        with transaction(self.db):
            row = self.db.execute("SELECT id FROM accounts WHERE name = ?", [account]).fetchone()
            if row is None:
                raise NotFoundError(f"no account {account!r}")
            account_id = int(row[0])
            created = self._ensure_secret(account_id, now)
            if rotate and not created:
                self.db.execute(
                    "UPDATE webhook_secrets SET previous_secret = secret, previous_until = ?,"
                    " secret = ?, created_at = ? WHERE account_id = ?",
                    [now + grace_s, new_secret(), now, account_id],
                )
            secret = self.db.execute(
                "SELECT secret FROM webhook_secrets WHERE account_id = ?", [account_id]
            ).fetchone()
        return str(secret[0])

    def _ensure_secret(self, account_id: int, now: float) -> bool:
        cur = self.db.execute(
            "INSERT OR IGNORE INTO webhook_secrets (account_id, secret, created_at)"
            " VALUES (?, ?, ?)",
            [account_id, new_secret(), now],
        )
        return cur.rowcount == 1

    # -- webhook deliveries ----------------------------------------------------------------

    def due_deliveries(self, limit: int, skip: Collection[str] = ()) -> list[Delivery]:
        rows = self.db.query(
            "SELECT * FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= ?"
            " ORDER BY next_attempt_at LIMIT ?",
            [time.time(), limit + len(skip)],
        )
        return [d for d in map(_delivery, rows) if d.id not in skip][:limit]

    def next_delivery_at(self, skip: Collection[str] = ()) -> float | None:
        """When the next pending delivery, other than those in `skip`, is due."""
        sql = "SELECT MIN(next_attempt_at) FROM webhook_deliveries WHERE status = 'pending'"
        if skip:
            # Only placeholders are formatted in; the ids are parameters.
            sql += f" AND id NOT IN ({', '.join('?' for _ in skip)})"
        row = self.db.execute(sql, list(skip)).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def fix_payload(self, delivery_id: str, payload: str) -> str:
        """The body of every attempt of a delivery: the first one given, kept from then on."""
        with transaction(self.db):
            self.db.execute(
                "UPDATE webhook_deliveries SET payload = ? WHERE id = ? AND payload IS NULL",
                [payload, delivery_id],
            )
            row = self.db.execute(
                "SELECT payload FROM webhook_deliveries WHERE id = ?", [delivery_id]
            ).fetchone()
        return str(row[0])

    def delivery_attempted(
        self,
        delivery_id: str,
        *,
        status_code: int | None,
        error: str | None,
        delivered: bool,
        retry_s: float,
        backoff_s: float,
    ) -> Delivery:
        """Record an attempt: delivered, or retried after `backoff_s`, or given up once
        `retry_s` has passed since the first attempt."""
        now = time.time()
        with transaction(self.db):
            row = next(
                iter(self.db.query("SELECT * FROM webhook_deliveries WHERE id = ?", [delivery_id]))
            )
            first = row["first_attempt_at"] if row["first_attempt_at"] is not None else now
            deadline = first + retry_s
            if delivered:
                status, next_at, delivered_at = "delivered", None, now
            elif now >= deadline:
                status, next_at, delivered_at = "failed", None, None
            else:
                # The last try falls on the deadline rather than never.
                status, next_at, delivered_at = "pending", min(now + backoff_s, deadline), None
            self.db.execute(
                "UPDATE webhook_deliveries SET status = ?, attempts = attempts + 1,"
                " first_attempt_at = ?, last_attempt_at = ?, next_attempt_at = ?,"
                " last_status = ?, last_error = ?, delivered_at = ? WHERE id = ?",
                [status, first, now, next_at, status_code, error, delivered_at, delivery_id],
            )
            updated = next(
                iter(self.db.query("SELECT * FROM webhook_deliveries WHERE id = ?", [delivery_id]))
            )
        return _delivery(updated)

    # -- rows ------------------------------------------------------------------------------

    def _job(self, row: dict[str, Any]) -> Job:
        delivery_rows = list(
            self.db.query("SELECT * FROM webhook_deliveries WHERE job_id = ?", [row["id"]])
        )
        return Job(
            id=row["id"],
            account_id=row["account_id"],
            key_prefix=row["key_prefix"],
            status=row["status"],
            total=row["total"],
            completed=row["completed"] or 0,
            failed=row["failed"] or 0,
            metadata=json.loads(row["metadata"]),
            webhook_url=row["webhook_url"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
            delivery=_delivery(delivery_rows[0]) if delivery_rows else None,
        )


_JOB_SELECT = (
    "SELECT j.*,"
    " (SELECT COUNT(*) FROM job_items i WHERE i.job_id = j.id AND i.status = 'completed')"
    " AS completed,"
    " (SELECT COUNT(*) FROM job_items i WHERE i.job_id = j.id AND i.status = 'failed') AS failed"
    " FROM jobs j"
)


def _delivery(row: dict[str, Any]) -> Delivery:
    return Delivery(**row)
