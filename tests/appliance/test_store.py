from __future__ import annotations

import asyncio
import re
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from pydantic import ValidationError

from appliance.state import store as store_module
from appliance.state.migrations import migrations
from appliance.state.records import ModelRecord
from appliance.state.store import (
    ApiKey,
    AsyncStore,
    ConflictError,
    NotFoundError,
    Store,
    UsageEvent,
)
from shared import protocol
from shared.classes import ServiceClass


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "appliance.db")


def test_database_is_wal_with_full_sync(store: Store) -> None:
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_migrations_are_recorded_once_and_in_order(tmp_path: Path) -> None:
    Store(tmp_path / "a.db").close()
    again = Store(tmp_path / "a.db")  # reopening applies nothing twice
    applied = [m.name for m in migrations.applied(again.db)]
    assert applied == sorted(applied)
    assert len(applied) == len(set(applied)) >= 1
    assert migrations.pending(again.db) == []


def test_account_defaults_to_s1_and_class_can_change(store: Store) -> None:
    assert store.ensure_account("acme").service_class is ServiceClass.S1
    assert store.ensure_account("acme", ServiceClass.S2).service_class is ServiceClass.S2
    assert store.ensure_account("acme").service_class is ServiceClass.S2
    assert [a.name for a in store.list_accounts()] == ["acme"]


def test_only_the_hash_is_stored(store: Store, tmp_path: Path) -> None:
    new = store.create_key("acme")
    store.close()
    raw = sqlite3.connect(tmp_path / "appliance.db")
    dump = "\n".join(raw.iterdump())
    assert new.plaintext not in dump
    assert new.hash in dump


def test_authenticate_and_revoke(store: Store) -> None:
    new = store.create_key("acme", ServiceClass.S0)
    key = store.authenticate(new.plaintext)
    assert key is not None
    assert key.account.name == "acme"
    assert key.account.service_class is ServiceClass.S0
    assert not key.revoked
    forged = new.plaintext[:-1] + ("0" if new.plaintext[-1] != "0" else "1")
    assert store.authenticate(forged) is None
    assert store.authenticate("nonsense") is None
    store.revoke_key(new.prefix)
    after = store.authenticate(new.plaintext)
    assert after is not None
    assert after.revoked
    with pytest.raises(ConflictError):
        store.revoke_key(new.prefix)
    with pytest.raises(NotFoundError):
        store.revoke_key("nosuchpx")


def test_list_keys_by_account(store: Store) -> None:
    store.create_key("a")
    store.create_key("b")
    store.create_key("a")
    assert [k.account.name for k in store.list_keys("a")] == ["a", "a"]
    assert len(store.list_keys()) == 3


def test_usage_events_are_committed_and_unique(store: Store, tmp_path: Path) -> None:
    account = store.ensure_account("acme")
    event = UsageEvent(
        account_id=account.id,
        key_prefix="px",
        route="/v1/completions",
        model="m@1",
        tokens_in=5,
        tokens_out=7,
        ttft_ms=12.5,
        duration_ms=40.0,
        status=200,
        finish_reason="stop",
    )
    stored = store.record_usage(event)
    assert stored.id
    assert stored.created_at
    # Visible to another connection at once: committed, not pending in a transaction.
    other = sqlite3.connect(tmp_path / "appliance.db")
    assert other.execute(
        "SELECT tokens_out FROM usage_events WHERE id = ?", [stored.id]
    ).fetchone() == (7,)
    with pytest.raises(sqlite3.IntegrityError):
        store.record_usage(stored)  # the same id twice is refused: nothing counted twice
    assert [e.id for e in store.usage_events("acme")] == [stored.id]


def test_models_register_once(store: Store) -> None:
    record = ModelRecord(
        name="m",
        version="1",
        format="gguf",
        path="/x.gguf",
        sha256="0" * 64,
        size_bytes=1,
        quantization="Q4_K_M",
        source="file:/x.gguf",
        added_at="2026-01-01T00:00:00+00:00",
    )
    store.add_model(record)
    with pytest.raises(ConflictError):
        store.add_model(record)
    newer = ModelRecord(
        **{**record.__dict__, "version": "2", "added_at": "2026-02-01T00:00:00+00:00"}
    )
    store.add_model(newer)
    got = store.get_model("m")
    assert got is not None
    assert got.version == "2"
    assert store.get_model("m", "1") == record
    assert store.get_model("nope") is None


def test_node_id_is_stable(tmp_path: Path) -> None:
    first = Store(tmp_path / "n.db")
    node = first.node_id()
    first.close()
    assert Store(tmp_path / "n.db").node_id() == node


async def test_authenticated_keys_are_remembered_until_the_database_changes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "appliance.db"
    store = AsyncStore(path)
    await store.open()
    try:
        new = await store.run(store.sync.create_key, "acme")
        trips = _count_trips(store)
        first = await store.authenticate(new.plaintext)
        assert first is not None
        assert not first.revoked
        assert await store.authenticate(new.plaintext) == first
        assert len(trips) == 1  # the second came from memory
        assert await store.authenticate("kvl_nope_nope") is None
        assert await store.authenticate("not a key at all: é") is None

        # Revoked by another connection (as the CLI does): seen on the very next call.
        before = len(trips)
        other = Store(path)
        other.revoke_key(new.prefix)
        other.close()
        revoked = await store.authenticate(new.plaintext)
        assert revoked is not None
        assert revoked.revoked
        assert len(trips) == before + 1

        # Any change through this store's own writer is seen as well.
        second = await store.run(store.sync.create_key, "acme")
        assert await store.authenticate(second.plaintext) is not None
        await store.run(store.sync.revoke_key, second.prefix)
        again = await store.authenticate(second.plaintext)
        assert again is not None
        assert again.revoked
    finally:
        await store.close()


async def test_keys_stay_remembered_across_usage_and_a_burst_makes_one_trip(
    tmp_path: Path,
) -> None:
    """Every finished request writes its usage: the keys remembered survive that (only a
    key or an account changing clears them, m013_key_changes), and a burst of one key's
    requests while it is not remembered makes one trip to the writer thread, not one each."""
    path = tmp_path / "appliance.db"
    store = AsyncStore(path)
    await store.open()
    try:
        new = await store.run(store.sync.create_key, "acme")
        trips = _count_trips(store)
        keys = await asyncio.gather(*(store.authenticate(new.plaintext) for _ in range(32)))
        assert len(trips) == 1
        key = keys[0]
        assert key is not None
        assert all(k == key for k in keys)

        usage = UsageEvent(key.account.id, new.prefix, "/v1/completions", "m", 3, 4,
                           10.0, 20.0, 200, "stop")  # fmt: skip
        for _ in range(3):
            await store.run(store.sync.record_usage, usage)
        assert await store.authenticate(new.plaintext) == key
        assert len(trips) == 1  # still remembered

        # An account's change, by another connection (the CLI), is seen at once.
        other = Store(path)
        other.ensure_account("acme", ServiceClass.S3)
        other.close()
        moved = await store.authenticate(new.plaintext)
        assert moved is not None
        assert moved.account.service_class is ServiceClass.S3
        assert len(trips) == 2
    finally:
        await store.close()


def _count_trips(store: AsyncStore) -> list[str]:
    """The key lookups that go to the writer thread from now on, one entry each."""
    trips: list[str] = []
    authenticate = store.sync.authenticate

    def counted(plaintext: str) -> ApiKey | None:
        trips.append(plaintext)
        return authenticate(plaintext)

    store.sync.authenticate = counted  # type: ignore[method-assign]
    return trips


# -- multi-statement writes are all or nothing -----------------------------------------------


def _desired(serial: int, *accounts: protocol.AccountState) -> protocol.DesiredState:
    return protocol.DesiredState(node_id="-", serial=serial, accounts=list(accounts), keys=[])


def _accounts(store: Store) -> list[tuple[str, int]]:
    """(name, withdrawn) of every account, read on the store's own connection."""
    rows = store.db.execute("SELECT name, withdrawn FROM accounts ORDER BY name").fetchall()
    return [(str(r[0]), int(r[1])) for r in rows]


def test_a_desired_state_is_applied_all_or_nothing(store: Store, tmp_path: Path) -> None:
    store.apply_desired_state(_desired(1, protocol.AccountState(name="old", service_class="S1")))
    # A quota past SQLite's INTEGER (the protocol refuses it when read, as it did not
    # before; built here without validation) fails at its insert, after "old" was
    # withdrawn and "acme" inserted by the statements before it.
    with pytest.raises(ValidationError):
        protocol.AccountState(name="evil", service_class="S1", tokens_per_day=2**63)
    hostile = _desired(
        2,
        protocol.AccountState(name="acme", service_class="S2"),
        protocol.AccountState.model_construct(
            name="evil", service_class="S1", tokens_per_day=2**63
        ),
    )
    with pytest.raises(OverflowError):
        store.apply_desired_state(hostile)
    assert _accounts(store) == [("old", 0)]
    assert store.meta("desired_serial") == "1"
    # Nothing is left open either: another connection sees the same, and can write.
    with closing(sqlite3.connect(tmp_path / "appliance.db", timeout=0.1)) as other:
        assert other.execute("SELECT name, withdrawn FROM accounts").fetchall() == [("old", 0)]
        with other:
            other.execute("UPDATE meta SET value = '1' WHERE key = 'desired_serial'")


def test_the_leases_kept_are_replaced_all_or_nothing(store: Store) -> None:
    def lease(lease_id: str) -> dict[str, object]:
        return {"id": lease_id, "account": "acme", "granted": 100, "granted_at": 1.0,
                "expires_at": 61.0, "period_ends_at": 86_401.0}  # fmt: skip

    store.save_leases([(lease("L1"), True)])
    # The same lease twice: the second insert fails after the first statement deleted L1.
    with pytest.raises(sqlite3.IntegrityError):
        store.save_leases([(lease("L2"), True), (lease("L2"), False)])
    assert [(kept["id"], current) for kept, current, _ in store.load_leases()] == [("L1", True)]


def test_every_write_of_the_state_package_is_a_transaction() -> None:
    # `with db.conn:` reads as a transaction and is none (sqlite-utils commits each
    # statement), and `db.atomic()` opens a deferred one: writes use shared.db.transaction.
    package = Path(store_module.__file__).parent
    found = [
        f"{path.name}:{n}"
        for path in sorted(package.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"^\s*with [\w.]*\.conn\b|\.atomic\(", line)
    ]
    assert found == []
