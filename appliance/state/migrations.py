"""Append-only schema migrations. Never edit, reorder or remove one: add a new one."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from shared.db import Migrations  # sqlite_utils without numpy (see shared/db.py)

if TYPE_CHECKING:
    from sqlite_utils import Database

migrations = Migrations("appliance")


@migrations()
def m001_initial(db: Database) -> None:
    db.table("meta").create({"key": str, "value": str}, pk="key")
    db.table("accounts").create(
        {"id": int, "name": str, "service_class": str, "created_at": str},
        pk="id",
        not_null={"name", "service_class", "created_at"},
    )
    db.table("accounts").create_index(["name"], unique=True)
    db.table("api_keys").create(
        {
            "id": int,
            "prefix": str,
            "hash": str,
            "account_id": int,
            "created_at": str,
            "revoked_at": str,
        },
        pk="id",
        not_null={"prefix", "hash", "account_id", "created_at"},
        foreign_keys=[("account_id", "accounts", "id")],
    )
    db.table("api_keys").create_index(["prefix"], unique=True)
    db.table("usage_events").create(
        {
            "id": str,
            "account_id": int,
            "key_prefix": str,
            "route": str,
            "model": str,
            "tokens_in": int,
            "tokens_out": int,
            "ttft_ms": float,
            "duration_ms": float,
            "status": int,
            "finish_reason": str,
            "created_at": str,
        },
        pk="id",
        not_null={
            "account_id",
            "route",
            "model",
            "tokens_in",
            "tokens_out",
            "status",
            "created_at",
        },
        foreign_keys=[("account_id", "accounts", "id")],
    )
    db.table("usage_events").create_index(["account_id", "created_at"])
    db.table("models").create(
        {
            "name": str,
            "version": str,
            "format": str,
            "path": str,
            "sha256": str,
            "size_bytes": int,
            "quantization": str,
            "source": str,
            "added_at": str,
        },
        pk=("name", "version"),
        not_null={"format", "path", "sha256", "size_bytes", "added_at"},
    )


@migrations()
def m002_worker_restarts(db: Database) -> None:
    db.table("worker_restarts").create(
        {"id": int, "model": str, "kind": str, "detail": str, "exit_code": int, "at": str},
        pk="id",
        not_null={"model", "kind", "detail", "at"},
    )


@migrations()
def m003_pins_and_admin_keys(db: Database) -> None:
    # A pinned model is loaded at start and never unloaded to make room; an admin key may
    # use /v1/admin routes.
    db.table("models").add_column("pinned", int, not_null_default=0)
    db.table("api_keys").add_column("admin", int, not_null_default=0)


@migrations()
def m004_jobs(db: Database) -> None:
    # Durable jobs (IF-4). Times here are unix seconds (REAL): the API reports them so, and
    # retry schedules are arithmetic on them.
    db.table("jobs").create(
        {
            "id": str,
            "account_id": int,
            "key_prefix": str,  # the key that created it: its usage is recorded under it
            "status": str,  # queued, running, completed, failed, cancelled
            "total": int,
            "metadata": str,  # JSON object
            "webhook_url": str,
            "created_at": float,
            "started_at": float,
            "ended_at": float,
        },
        pk="id",
        not_null={"account_id", "key_prefix", "status", "total", "metadata", "created_at"},
        foreign_keys=[("account_id", "accounts", "id")],
    )
    db.table("jobs").create_index(["account_id", "created_at"])
    db.table("jobs").create_index(["status", "created_at"])
    db.table("job_items").create(
        {
            "job_id": str,
            "idx": int,
            "custom_id": str,
            "url": str,
            "body": str,  # the request body, JSON, as validated at creation
            "status": str,  # pending, completed, failed, cancelled
            "status_code": int,
            "response": str,  # JSON: what the route would have answered
            "attempts": int,  # transient failures so far
            "ended_at": float,
        },
        pk=("job_id", "idx"),
        not_null={"custom_id", "url", "body", "status", "attempts"},
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db.table("job_items").create_index(["job_id", "custom_id"], unique=True)
    db.table("job_items").create_index(["job_id", "status", "idx"])
    db.table("webhook_secrets").create(
        {
            "account_id": int,
            "secret": str,
            "previous_secret": str,  # still signs, beside the current one, until previous_until
            "previous_until": float,
            "created_at": float,
        },
        pk="account_id",
        not_null={"secret", "created_at"},
        foreign_keys=[("account_id", "accounts", "id")],
    )
    db.table("webhook_deliveries").create(
        {
            "id": str,  # the delivery id receivers deduplicate on; the same on every retry
            "job_id": str,
            "account_id": int,
            "url": str,
            "event": str,  # job.completed, job.failed, job.cancelled
            "payload": str,  # the exact body, fixed at the first attempt
            "status": str,  # pending, delivered, failed (gave up)
            "attempts": int,
            "created_at": float,
            "first_attempt_at": float,
            "last_attempt_at": float,
            "next_attempt_at": float,
            "last_status": int,  # HTTP status of the last attempt; null if none came back
            "last_error": str,
            "delivered_at": float,
        },
        pk="id",
        not_null={"job_id", "account_id", "url", "event", "status", "attempts", "created_at"},
        foreign_keys=[("job_id", "jobs", "id"), ("account_id", "accounts", "id")],
    )
    db.table("webhook_deliveries").create_index(["job_id"], unique=True)
    db.table("webhook_deliveries").create_index(["status", "next_attempt_at"])


@migrations()
def m005_account_quotas(db: Database) -> None:
    # Per-account quotas set on the hub (null: the class's default).
    db.table("accounts").add_column("requests_per_minute", int)
    db.table("accounts").add_column("tokens_per_day", int)


@migrations()
def m006_quota_leases(db: Database) -> None:
    # An account with a global budget on the hub spends it through leases; each usage
    # event names the lease it was charged to (null: none, or safe capacity).
    db.table("accounts").add_column("budget_tokens", int)
    db.table("usage_events").add_column("lease_id", str)
    db.table("usage_events").create_index(["lease_id"])
    # The leases this node holds (current: spending it; else retired, its final spend not
    # yet reported); their spend is summed from usage_events.
    db.table("leases").create(
        {
            "id": str,
            "account": str,
            "granted": int,
            "granted_at": float,
            "expires_at": float,
            "period_ends_at": float,
            "current": int,
        },
        pk="id",
        not_null={"account", "granted", "granted_at", "expires_at", "period_ends_at", "current"},
    )


@migrations()
def m007_outbox_events(db: Database) -> None:
    # Events for the hub other than usage (a package made or removed here), synced after
    # usage events from their own checkpoint; the id makes a resend harmless.
    db.table("outbox_events").create(
        {"id": str, "kind": str, "body": str, "created_at": str},
        pk="id",
        not_null={"kind", "body", "created_at"},
    )


@migrations()
def m008_fleet_accounts(db: Database) -> None:
    # Accounts the hub's desired state gives this node (1) and accounts made here (0):
    # only the fleet's usage goes to the hub, which refuses usage of accounts it did not
    # give the node. The per-node offload secret is retired (offloaded requests carry
    # their client's own key).
    db.table("accounts").add_column("fleet", int, not_null_default=0)
    db.execute("DELETE FROM meta WHERE key = 'offload_secret'")


@migrations()
def m009_tenancy(db: Database) -> None:
    # A fleet account the hub's desired state no longer gives this node (its binding to a
    # tenant or to sites changed): its keys are refused here (1), until a state gives it
    # again (0). Its usage served before still syncs.
    db.table("accounts").add_column("withdrawn", int, not_null_default=0)
    # Which accounts may see a cached package version: the accounts that asked for it
    # (made, or a cache hit), and every account for one the hub seeded (account 0).
    # A package cached before this migration has no row: only admin keys see it.
    db.table("package_owners").create(
        {"package_id": str, "version": str, "account_id": int, "created_at": str},
        not_null={"package_id", "version", "account_id", "created_at"},
    )
    db.table("package_owners").create_index(["package_id", "version", "account_id"], unique=True)


@migrations()
def m010_responses(db: Database) -> None:
    # Responses API answers kept for `previous_response_id` (and GET /v1/responses/{id}),
    # per account, until they expire (`responses.keep_s`): the answer as sent, and the
    # conversation it ended (the messages a follow-up continues from).
    db.table("responses").create(
        {
            "id": str,
            "account_id": int,
            "created_at": float,
            "expires_at": float,
            "body": str,
            "messages": str,
        },
        pk="id",
        not_null={"account_id", "created_at", "expires_at", "body", "messages"},
    )
    db.table("responses").create_index(["expires_at"])


@migrations()
def m011_objectives(db: Database) -> None:
    # The live objectives' cumulative counters, per service class and account (as
    # protocol.ObjectiveSeries has them: maps and histograms as JSON), stored before each
    # heartbeat is sent. The epoch names their generation: made once, with the table, so
    # it changes only with a new database (and the hub then counts the new one whole).
    db.table("objectives").create(
        {
            "service_class": str,
            "account": str,
            "requests": int,
            "admitted": int,
            "refused": str,
            "met": str,
            "missed": str,
            "ttft": str,
            "completion": str,
        },
        pk=("service_class", "account"),
        not_null={"requests", "admitted", "refused", "met", "missed", "ttft", "completion"},
    )
    db.execute("INSERT INTO meta (key, value) VALUES ('objectives_epoch', ?)", [uuid.uuid4().hex])


@migrations()
def m012_disabled_accounts(db: Database) -> None:
    # An account disabled through the admin API (`DELETE /v1/admin/accounts/{name}`): its
    # keys were revoked with it, and no key is made for it again. Kept, not deleted: its
    # usage, jobs and answers still name it.
    db.table("accounts").add_column("disabled_at", str)


@migrations()
def m013_key_changes(db: Database) -> None:
    # A generation that moves whenever a key or an account changes (a key made or revoked,
    # an account's class, limits, disabling or withdrawal), by this process or any other
    # (the CLI): the gateway keeps the keys it authenticated until it moves, not until
    # anything at all is written (every finished request writes its usage).
    db.execute(
        "CREATE TABLE key_changes (id INTEGER PRIMARY KEY CHECK (id = 1),"
        " generation INTEGER NOT NULL)"
    )
    db.execute("INSERT INTO key_changes (id, generation) VALUES (1, 0)")
    for table in ("api_keys", "accounts"):
        for event in ("INSERT", "UPDATE", "DELETE"):
            trigger = f"{table}_{event.lower()}_key_changes AFTER {event} ON {table}"
            db.execute(
                f"CREATE TRIGGER {trigger}"  # noqa: S608 - names from this code
                " BEGIN UPDATE key_changes SET generation = generation + 1; END"
            )
