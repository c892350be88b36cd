"""Append-only schema migrations. Never edit, reorder or remove one: add a new one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlite_utils.migrations import Migrations

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
