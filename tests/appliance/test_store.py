from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

import pytest

from appliance.state.migrations import migrations
from appliance.state.store import (
    ApiKey,
    AsyncStore,
    ConflictError,
    ModelRecord,
    NotFoundError,
    Store,
    UsageEvent,
)
from shared.classes import ServiceClass

if TYPE_CHECKING:
    from pathlib import Path


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
        calls = 0
        authenticate = store.sync.authenticate

        def counted(plaintext: str) -> ApiKey | None:
            nonlocal calls
            calls += 1
            return authenticate(plaintext)

        store.sync.authenticate = counted  # type: ignore[method-assign]
        first = await store.authenticate(new.plaintext)
        assert first is not None
        assert not first.revoked
        assert await store.authenticate(new.plaintext) == first
        assert calls == 1  # the second came from memory
        assert await store.authenticate("kvl_nope_nope") is None
        assert await store.authenticate("not a key at all: é") is None

        # Revoked by another connection (as the CLI does): seen on the very next call.
        before = calls
        other = Store(path)
        other.revoke_key(new.prefix)
        other.close()
        revoked = await store.authenticate(new.plaintext)
        assert revoked is not None
        assert revoked.revoked
        assert calls == before + 1

        # Any change through this store's own writer is seen as well.
        second = await store.run(store.sync.create_key, "acme")
        assert await store.authenticate(second.plaintext) is not None
        await store.run(store.sync.revoke_key, second.prefix)
        again = await store.authenticate(second.plaintext)
        assert again is not None
        assert again.revoked
    finally:
        await store.close()
