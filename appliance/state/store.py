"""The store: the only module that writes SQL. One connection, one writer thread.

Every write runs in `transaction(self.db)` (shared.db), its statements committed together
or not at all; `with self.db.conn:` is not that, with sqlite-utils committing each
statement as it runs. A method that calls another inside its own transaction nests it (a
savepoint), so the outer one still commits or fails as one.

The synchronous :class:`Store` serves the CLI; :class:`AsyncStore` runs the same calls on a
single dedicated thread for the gateway, so there is exactly one writer per process and the
event loop never waits on disk.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from appliance.state.migrations import migrations
from appliance.state.records import ModelRecord
from shared import db
from shared.classes import DEFAULT_CLASS, ServiceClass
from shared.db import transaction
from shared.keys import NewKey, generate_key, hash_key, key_matches, parse_prefix

if TYPE_CHECKING:
    from pathlib import Path

    from sqlite_utils import Database

    from shared import protocol


class StoreError(Exception):
    """A documented failure of a store operation; the CLI and gateway translate it."""


class NotFoundError(StoreError):
    pass


class ConflictError(StoreError):
    pass


class AccountExistsError(ConflictError):
    pass


class AccountDisabledError(ConflictError):
    pass


class LastAdminKeyError(ConflictError):
    """The change would leave no active admin key: nobody could manage the node again."""


@dataclass(frozen=True)
class Account:
    id: int
    name: str
    service_class: ServiceClass
    created_at: str
    # Quotas of this account (from the hub); None: the class's default.
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    # A global budget on the hub, spent here through quota leases; None: no budget.
    budget_tokens: int | None = None
    fleet: bool = False  # given by the hub's desired state (else made here)
    disabled_at: str | None = None  # disabled through the admin API: its keys revoked


@dataclass(frozen=True)
class ApiKey:
    id: int
    prefix: str
    account: Account
    created_at: str
    revoked_at: str | None
    admin: bool = False  # may use the /v1/admin routes

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class UsageEvent:
    account_id: int
    key_prefix: str
    route: str
    model: str
    tokens_in: int
    tokens_out: int
    ttft_ms: float | None
    duration_ms: float
    status: int
    finish_reason: str | None
    id: str = ""
    created_at: str = ""
    lease_id: str | None = None  # the quota lease it was charged to


now_iso = db.now_iso
# The last worker restart (by id) of an epoch before the current one, if any.
RESTARTS_COUNTED_AFTER = "objectives_restarts_after"
EVERY_ACCOUNT = 0  # a package_owners row every account may see (account ids start at 1)


class Store:
    def __init__(self, path: Path) -> None:
        self.db = db.open_database(path, migrations)

    def close(self) -> None:
        self.db.close()

    # -- node identity -------------------------------------------------------------------

    def node_id(self) -> str:
        """This appliance's stable id, made on first use."""
        with transaction(self.db):
            row = self.db.execute("SELECT value FROM meta WHERE key = 'node_id'").fetchone()
            if row is not None:
                return str(row[0])
            node_id = uuid.uuid4().hex
            self.db.execute("INSERT INTO meta (key, value) VALUES ('node_id', ?)", [node_id])
            return node_id

    # -- accounts and keys ---------------------------------------------------------------

    def ensure_account(self, name: str, service_class: ServiceClass | None = None) -> Account:
        """The account by name, created if new; an explicit class updates an existing one."""
        with transaction(self.db):
            row = self._account_row(name)
            if row is None:
                cls = service_class or DEFAULT_CLASS
                self.db.execute(
                    "INSERT INTO accounts (name, service_class, created_at) VALUES (?, ?, ?)",
                    [name, cls.value, now_iso()],
                )
            elif service_class is not None and row["service_class"] != service_class.value:
                self.db.execute(
                    "UPDATE accounts SET service_class = ? WHERE name = ?",
                    [service_class.value, name],
                )
            row = self._account_row(name)
        if row is None:  # pragma: no cover - inserted above in the same transaction
            raise StoreError(f"account {name!r} vanished")
        return _account(row)

    def list_accounts(self) -> list[Account]:
        return [_account(r) for r in self.db.query("SELECT * FROM accounts ORDER BY name")]

    def get_account(self, name: str) -> Account | None:
        row = self._account_row(name)
        return None if row is None else _account(row)

    def create_account(
        self,
        name: str,
        service_class: ServiceClass,
        *,
        requests_per_minute: int | None = None,
        tokens_per_day: int | None = None,
    ) -> Account:
        """A new account made here (AccountExistsError if the name is taken, disabled or
        not: a name keeps its usage and its history)."""
        with transaction(self.db):
            if self._account_row(name) is not None:
                raise AccountExistsError(f"an account named {name!r} exists already")
            self.db.execute(
                "INSERT INTO accounts (name, service_class, created_at, requests_per_minute,"
                " tokens_per_day) VALUES (?, ?, ?, ?, ?)",
                [name, service_class.value, now_iso(), requests_per_minute, tokens_per_day],
            )
            row = self._account_row(name)
        if row is None:  # pragma: no cover - inserted above in the same transaction
            raise StoreError(f"account {name!r} vanished")
        return _account(row)

    def disable_account(self, name: str) -> Account:
        """Disable an account and revoke its keys, at once; again, a no-op. Refused
        (LastAdminKeyError) when it holds every active admin key left."""
        with transaction(self.db):
            row = self._account_row(name)
            if row is None:
                raise NotFoundError(f"no account named {name!r}")
            if row["disabled_at"] is None:
                at = now_iso()
                self.db.execute(
                    "UPDATE api_keys SET revoked_at = ? WHERE account_id = ?"
                    " AND revoked_at IS NULL",
                    [at, row["id"]],
                )
                self.db.execute("UPDATE accounts SET disabled_at = ? WHERE id = ?", [at, row["id"]])
                # Checked after the change, in its transaction (the raise rolls it back):
                # no other writer can slip between the count and the change.
                if self._active_admin_keys() == 0:
                    raise LastAdminKeyError(
                        f"account {name!r} holds every active admin key: make an admin key "
                        "of another account first"
                    )
            row = self._account_row(name)
        if row is None:  # pragma: no cover - read in the same transaction
            raise StoreError(f"account {name!r} vanished")
        return _account(row)

    def issue_key(self, account: str, *, admin: bool = False) -> tuple[ApiKey, str]:
        """A new key of an existing account that is not disabled: (its record, the key,
        shown once)."""
        new = generate_key()
        with transaction(self.db):
            row = self._account_row(account)
            if row is None:
                raise NotFoundError(f"no account named {account!r}")
            if row["disabled_at"] is not None:
                raise AccountDisabledError(
                    f"account {account!r} was disabled at {row['disabled_at']}"
                )
            self.db.execute(
                "INSERT INTO api_keys (prefix, hash, account_id, created_at, admin)"
                " VALUES (?, ?, ?, ?, ?)",
                [new.prefix, new.hash, row["id"], now_iso(), int(admin)],
            )
        key = self._key_by_prefix(new.prefix)
        if key is None:  # pragma: no cover - inserted above
            raise StoreError(f"key {new.prefix!r} vanished")
        return key, new.plaintext

    def import_bootstrap_key(self, account: str, prefix: str, key_hash: str) -> bool:
        """A site's first admin key, from its provisioning file (prefix and hash only):
        added once, as an admin key of `account` (made if new, enabled again if it was
        disabled: the file on the boot partition speaks for whoever holds the machine).
        A key with that prefix already here, revoked or not, is left as it is: another
        start adds nothing, and a revoked bootstrap key stays revoked. Whether it was
        added now."""
        with transaction(self.db):
            if self._key_by_prefix(prefix) is not None:
                return False
            row = self._account_row(account)
            if row is None:
                self.db.execute(
                    "INSERT INTO accounts (name, service_class, created_at) VALUES (?, ?, ?)",
                    [account, DEFAULT_CLASS.value, now_iso()],
                )
            elif row["disabled_at"] is not None:
                self.db.execute("UPDATE accounts SET disabled_at = NULL WHERE id = ?", [row["id"]])
            self.db.execute(
                "INSERT INTO api_keys (prefix, hash, account_id, created_at, admin)"
                " SELECT ?, ?, id, ?, 1 FROM accounts WHERE name = ?",
                [prefix, key_hash, now_iso(), account],
            )
        return True

    def create_key(
        self, account: str, service_class: ServiceClass | None = None, *, admin: bool = False
    ) -> NewKey:
        new = generate_key()
        # One transaction, the account's with it: a key refused leaves no account made for it.
        with transaction(self.db):
            acct = self.ensure_account(account, service_class)
            if acct.disabled_at is not None:
                raise AccountDisabledError(
                    f"account {account!r} was disabled at {acct.disabled_at}"
                )
            self.db.execute(
                "INSERT INTO api_keys (prefix, hash, account_id, created_at, admin)"
                " VALUES (?, ?, ?, ?, ?)",
                [new.prefix, new.hash, acct.id, now_iso(), int(admin)],
            )
        return new

    def list_keys(self, account: str | None = None) -> list[ApiKey]:
        sql = _KEY_SELECT
        params: list[Any] = []
        if account is not None:
            sql += " WHERE a.name = ?"
            params.append(account)
        sql += " ORDER BY k.id"
        return [_api_key(r) for r in self.db.query(sql, params)]

    def revoke_key(self, prefix: str, *, keep_an_admin: bool = False) -> ApiKey:
        """Revoke a key (ConflictError if it was already). `keep_an_admin`: refuse
        (LastAdminKeyError) to revoke the last active admin key, which the admin API does
        on a node whose only other way in is a shell it may not have."""
        with transaction(self.db):
            cur = self.db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL",
                [now_iso(), prefix],
            )
            # Checked after the change, in its transaction (the raise rolls it back).
            if keep_an_admin and cur.rowcount and self._active_admin_keys() == 0:
                key = self._key_by_prefix(prefix)
                if key is not None and key.admin:
                    raise LastAdminKeyError(
                        f"key {prefix!r} is the last active admin key: make another admin key first"
                    )
        key = self._key_by_prefix(prefix)
        if key is None:
            raise NotFoundError(f"no key with prefix {prefix!r}")
        if cur.rowcount == 0:
            raise ConflictError(f"key {prefix!r} was already revoked at {key.revoked_at}")
        return key

    def authenticate(self, plaintext: str) -> ApiKey | None:
        """The key record for a presented key (revoked ones included), or None if unknown."""
        prefix = parse_prefix(plaintext)
        if prefix is None:
            return None
        # A key of an account the hub withdrew from this node is unknown here, as if
        # never received (its binding to a tenant or to sites no longer reaches here).
        rows = list(
            self.db.query(_KEY_SELECT + " WHERE k.prefix = ? AND a.withdrawn = 0", [prefix])
        )
        if not rows or not key_matches(plaintext, rows[0]["hash"]):
            return None
        return _api_key(rows[0])

    def _active_admin_keys(self) -> int:
        """Admin keys that still let someone in: not revoked, of an account neither
        disabled nor withdrawn by the hub."""
        row = self.db.execute(
            "SELECT COUNT(*) FROM api_keys k JOIN accounts a ON a.id = k.account_id"
            " WHERE k.admin = 1 AND k.revoked_at IS NULL AND a.disabled_at IS NULL"
            " AND a.withdrawn = 0"
        ).fetchone()
        return int(row[0])

    def _key_by_prefix(self, prefix: str) -> ApiKey | None:
        rows = list(self.db.query(_KEY_SELECT + " WHERE k.prefix = ?", [prefix]))
        return _api_key(rows[0]) if rows else None

    def _account_row(self, name: str) -> dict[str, Any] | None:
        rows = list(self.db.query("SELECT * FROM accounts WHERE name = ?", [name]))
        return rows[0] if rows else None

    # -- usage ---------------------------------------------------------------------------

    def record_usage(self, event: UsageEvent) -> UsageEvent:
        """Commit one usage event durably; returns it with its id and time filled in."""
        stored = UsageEvent(
            **{
                **asdict(event),
                "id": event.id or uuid.uuid4().hex,
                "created_at": event.created_at or now_iso(),
            }
        )
        with transaction(self.db):
            _insert(self.db, "usage_events", asdict(stored))
        return stored

    # -- the outbox: usage events not yet acknowledged by the hub ------------------------

    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with transaction(self.db):
            self.db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [key, value],
            )

    def sync_checkpoint(self) -> int:
        """The last usage event (by rowid) the hub acknowledged; 0 before the first."""
        return int(self.meta("sync_checkpoint") or 0)

    def outbox(self, limit: int) -> list[tuple[int, UsageEvent, str]]:
        """Usage events of the fleet's accounts after the checkpoint, oldest first: (rowid,
        event, account name; the hub knows accounts by name). Accounts made here keep
        their usage here."""
        rows = self.db.query(
            "SELECT e.rowid AS _rowid, a.name AS _account, e.* FROM usage_events e"
            " JOIN accounts a ON a.id = e.account_id"
            " WHERE e.rowid > ? AND a.fleet = 1 ORDER BY e.rowid LIMIT ?",
            [self.sync_checkpoint(), limit],
        )
        return [
            (int(r.pop("_rowid")), UsageEvent(**{k: v for k, v in r.items() if k != "_account"}),
             str(r["_account"]))
            for r in (dict(row) for row in rows)
        ]  # fmt: skip

    def acknowledge(self, rowid: int) -> None:
        """The hub holds every event up to ``rowid``: the checkpoint moves, never back."""
        with transaction(self.db):  # read and moved together: no older one overwrites it
            if rowid > self.sync_checkpoint():
                self.set_meta("sync_checkpoint", str(rowid))

    def outbox_lag(self) -> int:
        """Events committed here and not yet acknowledged by the hub."""
        row = self.db.execute(
            "SELECT (SELECT COUNT(*) FROM usage_events e JOIN accounts a ON a.id = e.account_id"
            " WHERE e.rowid > ? AND a.fleet = 1)"
            " + (SELECT COUNT(*) FROM outbox_events WHERE rowid > ?)",
            [self.sync_checkpoint(), self._events_checkpoint()],
        ).fetchone()
        return int(row[0])

    def record_event(self, kind: str, body: dict[str, Any]) -> str:
        """Commit an event for the hub (not usage: a package made, say); its id."""
        event_id = uuid.uuid4().hex
        with transaction(self.db):
            self.db.execute(
                "INSERT INTO outbox_events (id, kind, body, created_at) VALUES (?, ?, ?, ?)",
                [event_id, kind, json.dumps(body), now_iso()],
            )
        return event_id

    def events_outbox(self, limit: int) -> list[tuple[int, dict[str, Any]]]:
        """Events after their checkpoint, oldest first: (rowid, {id, kind, body})."""
        rows = self.db.execute(
            "SELECT rowid, id, kind, body FROM outbox_events WHERE rowid > ? ORDER BY rowid"
            " LIMIT ?",
            [self._events_checkpoint(), limit],
        ).fetchall()
        return [(r[0], {"id": r[1], "kind": r[2], "body": json.loads(r[3])}) for r in rows]

    def acknowledge_events(self, rowid: int) -> None:
        with transaction(self.db):
            if rowid > self._events_checkpoint():
                self.set_meta("events_checkpoint", str(rowid))

    def _events_checkpoint(self) -> int:
        return int(self.meta("events_checkpoint") or 0)

    def apply_desired_state(self, state: protocol.DesiredState) -> int:
        """Apply the hub's accounts and keys atomically (all or nothing) and remember the
        serial; a state older than the one applied is ignored. Keys are never deleted: one
        the hub revoked is revoked here; keys made locally stay as they are. The accounts
        it gives are marked as the fleet's: their usage goes to the hub. A fleet account
        it no longer gives is withdrawn: its keys are refused until a state gives it again
        (its usage served before still syncs)."""
        serial = state.serial
        with transaction(self.db):
            if serial <= int(self.meta("desired_serial") or -1):
                return serial
            given = [a.name for a in state.accounts]
            self.db.execute(
                "UPDATE accounts SET withdrawn = 1 WHERE fleet = 1 AND withdrawn = 0"
                " AND name NOT IN (SELECT value FROM json_each(?))",
                [json.dumps(given)],
            )
            for account in state.accounts:
                self.db.execute(
                    "INSERT INTO accounts (name, service_class, created_at, requests_per_minute,"
                    " tokens_per_day, budget_tokens, fleet) VALUES (?, ?, ?, ?, ?, ?, 1)"
                    " ON CONFLICT(name) DO UPDATE SET"
                    " service_class = excluded.service_class,"
                    " requests_per_minute = excluded.requests_per_minute,"
                    " tokens_per_day = excluded.tokens_per_day,"
                    " budget_tokens = excluded.budget_tokens, fleet = 1, withdrawn = 0",
                    [
                        account.name,
                        account.service_class,
                        now_iso(),
                        account.requests_per_minute,
                        account.tokens_per_day,
                        account.budget_tokens,
                    ],
                )
            for key in state.keys:
                row = self.db.execute(
                    "SELECT id FROM accounts WHERE name = ?", [key.account]
                ).fetchone()
                if row is None:
                    continue  # a key of an account the state does not give this node
                revoked = now_iso() if key.revoked else None
                self.db.execute(
                    "INSERT INTO api_keys (prefix, hash, account_id, created_at, admin, revoked_at)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(prefix) DO UPDATE SET"
                    " revoked_at = COALESCE(api_keys.revoked_at, excluded.revoked_at),"
                    " admin = excluded.admin",
                    [key.prefix, key.hash, row[0], now_iso(), int(key.admin), revoked],
                )
            self.db.execute(
                "INSERT INTO meta (key, value) VALUES ('desired_serial', ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [str(serial)],
            )
            # The models the hub places here and the packages it seeds here; the fleet
            # link converges on them.
            for part, items in (("models", state.models), ("packages", state.packages)):
                self.db.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?)"
                    " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    [f"desired_{part}", json.dumps([i.model_dump(mode="json") for i in items])],
                )
            # The image release the hub gives this node (null: none); the updater
            # (appliance/fleet/release.py) converges on it. The site's update window
            # (null: any time), which model files wait for (appliance/fleet/placement.py).
            targets = {"desired_release": state.release, "desired_window": state.window}
            for meta_key, target in targets.items():
                value = None if target is None else target.model_dump(mode="json")
                self.db.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?)"
                    " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    [meta_key, json.dumps(value)],
                )
            # What the hub sets of this node's settings (protocol 7); the fleet link applies
            # them (appliance/inference/names.py), now and at every start.
            self.db.execute(
                "INSERT INTO meta (key, value) VALUES ('desired_settings', ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [state.settings.model_dump_json()],
            )
        return serial

    def save_leases(self, leases: list[tuple[dict[str, Any], bool]]) -> None:
        """Replace the leases kept: (lease as JSON, current?) pairs."""
        with transaction(self.db):
            self.db.execute("DELETE FROM leases")
            for lease, current in leases:
                self.db.execute(
                    "INSERT INTO leases (id, account, granted, granted_at, expires_at,"
                    " period_ends_at, current) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [lease["id"], lease["account"], lease["granted"], lease["granted_at"],
                     lease["expires_at"], lease["period_ends_at"], int(current)],
                )  # fmt: skip

    def load_leases(self) -> list[tuple[dict[str, Any], bool, int]]:
        """The leases kept, each with whether it is current and its spend so far."""
        rows = self.db.execute(
            "SELECT l.id, l.account, l.granted, l.granted_at, l.expires_at, l.period_ends_at,"
            " l.current, (SELECT COALESCE(SUM(u.tokens_in + u.tokens_out), 0)"
            " FROM usage_events u WHERE u.lease_id = l.id) FROM leases l"
        ).fetchall()
        keys = ("id", "account", "granted", "granted_at", "expires_at", "period_ends_at")
        return [(dict(zip(keys, r[:6], strict=True)), bool(r[6]), int(r[7])) for r in rows]

    def tokens_used_since(self, account_id: int, since: str) -> int:
        """Prompt and completion tokens an account used since an ISO timestamp."""
        rows = self.db.query(
            "SELECT COALESCE(SUM(tokens_in + tokens_out), 0) AS used FROM usage_events"
            " WHERE account_id = ? AND created_at >= ?",
            [account_id, since],
        )
        return int(next(iter(rows))["used"])

    # -- who sees which package ------------------------------------------------------------

    def add_package_owner(self, package_id: str, version: str, account_id: int) -> None:
        """`account_id` may see the cached package version (EVERY_ACCOUNT: one the hub
        seeded)."""
        with transaction(self.db):
            self.db.execute(
                "INSERT INTO package_owners (package_id, version, account_id, created_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [package_id, version, account_id, now_iso()],
            )

    def visible_packages(self, account_id: int) -> set[tuple[str, str]]:
        """(id, version) of every package version `account_id` may see: its own and the
        hub's seeded ones."""
        rows = self.db.execute(
            "SELECT package_id, version FROM package_owners WHERE account_id IN (?, ?)",
            [account_id, EVERY_ACCOUNT],
        ).fetchall()
        return {(str(r[0]), str(r[1])) for r in rows}

    def usage_events(self, account: str | None = None, limit: int = 100) -> list[UsageEvent]:
        sql = "SELECT e.* FROM usage_events e"
        params: list[Any] = []
        if account is not None:
            sql += " JOIN accounts a ON a.id = e.account_id WHERE a.name = ?"
            params.append(account)
        sql += " ORDER BY e.created_at DESC LIMIT ?"
        params.append(limit)
        return [UsageEvent(**r) for r in self.db.query(sql, params)]

    # -- model workers ---------------------------------------------------------------------

    def record_worker_restart(
        self, model: str, kind: str, detail: str, exit_code: int | None
    ) -> None:
        with transaction(self.db):
            _insert(
                self.db,
                "worker_restarts",
                {
                    "model": model,
                    "kind": kind,
                    "detail": detail,
                    "exit_code": exit_code,
                    "at": now_iso(),
                },
            )

    def worker_restarts(self, model: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT model, kind, detail, exit_code, at FROM worker_restarts"
        params: list[Any] = []
        if model is not None:
            sql += " WHERE model = ?"
            params.append(model)
        return list(self.db.query(sql + " ORDER BY id", params))

    # -- live objectives ------------------------------------------------------------------

    def save_objectives(self, rows: list[dict[str, Any]]) -> tuple[str, int]:
        """Store series of the objective book (`ObjectiveSeries` as JSON, cumulative: each
        replaces its row) in one transaction; (the epoch, model-worker restarts so far).
        Called before a heartbeat is sent, so what the hub is told is never more than what
        a restart resumes from."""
        with transaction(self.db):
            for r in rows:
                self.db.execute(
                    "INSERT INTO objectives (service_class, account, requests, admitted,"
                    " refused, met, missed, ttft, completion) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(service_class, account) DO UPDATE SET"
                    " requests = excluded.requests, admitted = excluded.admitted,"
                    " refused = excluded.refused, met = excluded.met, missed = excluded.missed,"
                    " ttft = excluded.ttft, completion = excluded.completion",
                    [r["service_class"], r["account"], r["requests"], r["admitted"],
                     json.dumps(r["refused"]), json.dumps(r["met"]), json.dumps(r["missed"]),
                     json.dumps(r["ttft"]), json.dumps(r["completion"])],
                )  # fmt: skip
            return self.objectives_epoch(), self.worker_restart_count()

    def load_objectives(self) -> list[dict[str, Any]]:
        """The series stored, as `save_objectives` took them."""
        rows = self.db.execute(
            "SELECT service_class, account, requests, admitted, refused, met, missed, ttft,"
            " completion FROM objectives ORDER BY service_class, account"
        ).fetchall()
        keys = ("service_class", "account", "requests", "admitted")
        maps = ("refused", "met", "missed", "ttft", "completion")
        return [
            {
                **dict(zip(keys, r[:4], strict=True)),
                **{k: json.loads(v) for k, v in zip(maps, r[4:], strict=True)},
            }
            for r in rows
        ]

    def objectives_epoch(self) -> str:
        """The objectives' epoch: made with their table, the same for the database's life."""
        epoch = self.meta("objectives_epoch")
        if epoch is None:  # pragma: no cover - m011 makes it
            raise StoreError("the objectives epoch is missing")
        return epoch

    def worker_restart_count(self) -> int:
        """Model-worker restarts recorded (any cause) in the objectives' epoch: since the
        database was made, or since it was restored (a restore starts a new epoch, which the
        hub counts whole: appliance/state/dump.py)."""
        after = int(self.meta(RESTARTS_COUNTED_AFTER) or 0)
        row = self.db.execute("SELECT COUNT(*) FROM worker_restarts WHERE id > ?", [after])
        return int(row.fetchone()[0])

    # -- models --------------------------------------------------------------------------

    def add_model(self, record: ModelRecord) -> ModelRecord:
        with transaction(self.db):
            exists = self.get_model(record.name, record.version)
            if exists is not None:
                raise ConflictError(f"model {record.ref} is already registered")
            _insert(self.db, "models", asdict(record))
        return record

    def model_by_sha256(self, sha256: str) -> ModelRecord | None:
        """A registered model with this content, under whatever name."""
        rows = list(self.db.query("SELECT * FROM models WHERE sha256 = ? LIMIT 1", [sha256]))
        return _model(rows[0]) if rows else None

    def get_model(self, name: str, version: str | None = None) -> ModelRecord | None:
        """A model by name and version; with no version, the most recently added one."""
        if version is None:
            rows = list(
                self.db.query(
                    "SELECT * FROM models WHERE name = ? ORDER BY added_at DESC LIMIT 1", [name]
                )
            )
        else:
            rows = list(
                self.db.query(
                    "SELECT * FROM models WHERE name = ? AND version = ?", [name, version]
                )
            )
        return _model(rows[0]) if rows else None

    def list_models(self) -> list[ModelRecord]:
        return [_model(r) for r in self.db.query("SELECT * FROM models ORDER BY name, added_at")]

    def pinned_models(self) -> list[ModelRecord]:
        rows = self.db.query("SELECT * FROM models WHERE pinned = 1 ORDER BY name, added_at")
        return [_model(r) for r in rows]

    def set_model_pinned(self, ref: str, pinned: bool) -> None:
        name, _, version = ref.partition("@")
        with transaction(self.db):
            cur = self.db.execute(
                "UPDATE models SET pinned = ? WHERE name = ? AND version = ?",
                [int(pinned), name, version],
            )
        if cur.rowcount == 0:
            raise NotFoundError(f"no model {ref!r}")


_KEY_SELECT = (
    "SELECT k.id, k.prefix, k.hash, k.created_at, k.revoked_at, k.admin, a.id AS account_id,"
    " a.name AS account_name, a.service_class, a.created_at AS account_created_at,"
    " a.requests_per_minute, a.tokens_per_day, a.budget_tokens, a.fleet, a.disabled_at"
    " FROM api_keys k JOIN accounts a ON a.id = k.account_id"
)


def _insert(db: Database, table: str, row: dict[str, Any]) -> None:
    cols = ", ".join(row)
    marks = ", ".join("?" for _ in row)
    # Table and column names come from this module's dataclasses, never from input.
    db.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", list(row.values()))  # noqa: S608


def _account(row: dict[str, Any]) -> Account:
    return Account(
        id=row["id"],
        name=row["name"],
        service_class=ServiceClass(row["service_class"]),
        created_at=row["created_at"],
        requests_per_minute=row.get("requests_per_minute"),
        tokens_per_day=row.get("tokens_per_day"),
        budget_tokens=row.get("budget_tokens"),
        fleet=bool(row.get("fleet", 0)),
        disabled_at=row.get("disabled_at"),
    )


def _model(row: dict[str, Any]) -> ModelRecord:
    return ModelRecord(**{k: v for k, v in row.items() if k != "pinned"})


def _api_key(row: dict[str, Any]) -> ApiKey:
    account = Account(
        id=row["account_id"],
        name=row["account_name"],
        service_class=ServiceClass(row["service_class"]),
        created_at=row["account_created_at"],
        requests_per_minute=row["requests_per_minute"],
        tokens_per_day=row["tokens_per_day"],
        budget_tokens=row["budget_tokens"],
        fleet=bool(row["fleet"]),
        disabled_at=row["disabled_at"],
    )
    return ApiKey(
        id=row["id"],
        prefix=row["prefix"],
        account=account,
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        admin=bool(row["admin"]),
    )


class AsyncStore(db.AsyncStore[Store]):
    """The appliance's store on its writer thread (shared.db.AsyncStore), with the keys it
    authenticated remembered until a key or an account next changes."""

    _KEYS_REMEMBERED = 4096

    def __init__(self, path: Path) -> None:
        super().__init__(Store, path)
        self._changes = db.ChangeProbe(path)
        self._keys: dict[str, ApiKey] = {}  # by the presented key's hash
        self._keys_as_of = -1  # the key_changes generation they were read at
        self._version = -1  # the database's data_version when it was last read
        # (hash, generation) -> its lookup on the writer thread, shared by every request
        # that presents the key meanwhile (a burst of one key's requests makes one trip)
        self._lookups: dict[tuple[str, int], asyncio.Future[ApiKey | None]] = {}

    async def close(self) -> None:
        self._changes.close()
        await super().close()

    def _generation(self) -> int:
        """The keys' generation now (m013_key_changes), read again only when the database
        changed at all."""
        version = self._changes.version()
        if version != self._version:
            self._version = version
            generation = self._changes.generation("key_changes")
            if generation != self._keys_as_of:
                self._keys.clear()
                self._keys_as_of = generation
        return self._keys_as_of

    async def authenticate(self, plaintext: str) -> ApiKey | None:
        """``Store.authenticate`` without the trip to the writer thread while no key or
        account changed since the key was last looked up: a revocation, by this process
        or by any other (the CLI), takes effect on the very next request."""
        if parse_prefix(plaintext) is None:
            return None
        generation = self._generation()
        digest = hash_key(plaintext)
        if (known := self._keys.get(digest)) is not None:
            return known
        lookup = self._lookups.get((digest, generation))
        if lookup is None:
            lookup = asyncio.ensure_future(self._look_up(plaintext, digest, generation))
            self._lookups[digest, generation] = lookup
            lookup.add_done_callback(lambda _: self._lookups.pop((digest, generation), None))
        return await asyncio.shield(lookup)

    async def _look_up(self, plaintext: str, digest: str, generation: int) -> ApiKey | None:
        key = await self.run(self.sync.authenticate, plaintext)
        if key is not None and self._generation() == generation:
            if len(self._keys) >= self._KEYS_REMEMBERED:
                self._keys.clear()
            self._keys[digest] = key
        return key
