"""The hub's one list of migrations (hub/state/migrations/) makes the same tables, columns,
types, keys, indexes and references on SQLite and on PostgreSQL. Files and databases made
before, also by the code before that list, skip what they had and apply the rest;
PostgreSQL migrates once, also when replicas start together."""

from __future__ import annotations

import re
import sqlite3
import threading
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlite_utils import Database

from hub.settings import HubSettings
from hub.state.migrations import MIGRATION_SET, MIGRATIONS
from hub.state.sql import MIGRATIONS_TABLE, PostgresDatabase, sqlite_migrations
from hub.state.store import open_store

if TYPE_CHECKING:
    from tests.postgres import Cluster

# A hub file at m011 as the code before the one list made it (sqlite-utils' migrations).
OLD_HUB_FILE = Path(__file__).with_name("hub_m011.sql")

# SQLite's declared types as PostgreSQL names them (sqlite-utils declares float as REAL).
TYPES = {"INTEGER": "bigint", "REAL": "double precision", "FLOAT": "double precision",
         "TEXT": "text"}  # fmt: skip


def _sqlite_schema(path: Path) -> dict[str, Any]:
    with closing(sqlite3.connect(path)) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            " AND name != '_sqlite_migrations' ORDER BY name"
        )]  # fmt: skip
        columns, keys, indexes, references = {}, {}, set(), set()
        for table in tables:
            info = conn.execute(f'PRAGMA table_info("{table}")').fetchall()
            key = tuple(r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5]))
            keys[table] = key
            columns[table] = {r[1]: (TYPES[r[2].upper()], bool(r[3]) or r[1] in key) for r in info}
            for _, name, unique, origin, _ in conn.execute(f'PRAGMA index_list("{table}")'):
                if origin == "pk":
                    continue
                cols = tuple(r[2] for r in conn.execute(f'PRAGMA index_info("{name}")'))
                indexes.add((table, name, bool(unique), cols))
            for r in conn.execute(f'PRAGMA foreign_key_list("{table}")'):
                references.add((table, r[3], r[2], r[4]))
    return {"columns": columns, "keys": keys, "indexes": indexes, "references": references}


def _postgres_schema(db: PostgresDatabase) -> dict[str, Any]:
    columns: dict[str, dict[str, tuple[str, bool]]] = {}
    for r in db.query(
        "SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns"
        " WHERE table_schema = 'public' AND table_name != ? ORDER BY table_name, ordinal_position",
        [MIGRATIONS_TABLE],
    ):
        columns.setdefault(r["table_name"], {})[r["column_name"]] = (
            r["data_type"],
            r["is_nullable"] == "NO",
        )
    keys: dict[str, tuple[str, ...]] = dict.fromkeys(columns, ())
    indexes = set()
    for r in db.query(
        "SELECT t.relname AS tab, i.relname AS name, ix.indisunique AS uniq,"
        " ix.indisprimary AS pk, array_agg(a.attname ORDER BY k.n) AS cols"
        " FROM pg_index ix JOIN pg_class i ON i.oid = ix.indexrelid"
        " JOIN pg_class t ON t.oid = ix.indrelid"
        " JOIN pg_namespace ns ON ns.oid = t.relnamespace"
        " CROSS JOIN LATERAL unnest(ix.indkey) WITH ORDINALITY AS k(attnum, n)"
        " JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum"
        " WHERE ns.nspname = 'public' AND t.relname != ? GROUP BY 1, 2, 3, 4",
        [MIGRATIONS_TABLE],
    ):
        if r["pk"]:
            keys[r["tab"]] = tuple(r["cols"])
        else:
            indexes.add((r["tab"], r["name"], r["uniq"], tuple(r["cols"])))
    references = {
        (r["tab"], r["col"], r["ref"], r["ref_col"])
        for r in db.query(
            "SELECT cl.relname AS tab, a.attname AS col, rcl.relname AS ref,"
            " ra.attname AS ref_col FROM pg_constraint c"
            " JOIN pg_class cl ON cl.oid = c.conrelid JOIN pg_class rcl ON rcl.oid = c.confrelid"
            " JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]"
            " JOIN pg_attribute ra ON ra.attrelid = c.confrelid AND ra.attnum = c.confkey[1]"
            " WHERE c.contype = 'f'"
        )
    }
    return {"columns": columns, "keys": keys, "indexes": indexes, "references": references}


@pytest.mark.postgres
def test_postgres_and_sqlite_schemas_are_the_same(tmp_path: Path, postgres: Cluster) -> None:
    open_store(HubSettings.model_validate({"data_dir": tmp_path})).close()
    pg = PostgresDatabase(postgres.create(), MIGRATIONS)
    try:
        with closing(Database(tmp_path / "hub.db")) as sqlite_db:
            applied = sqlite_migrations(MIGRATIONS, MIGRATION_SET).applied(sqlite_db)
        assert [m.name for m in MIGRATIONS] == [m.name for m in applied]
        want, got = _sqlite_schema(tmp_path / "hub.db"), _postgres_schema(pg)
        assert got["columns"] == want["columns"]
        assert got["keys"] == want["keys"]
        assert got["indexes"] == want["indexes"]
        assert got["references"] == want["references"]
        assert len(want["columns"]) >= 17  # a schema was compared, not two empty ones
    finally:
        pg.close()


def test_an_old_sqlite_hub_file_opens_and_migrates(tmp_path: Path) -> None:
    path = tmp_path / "hub.db"
    old = Database(path)
    # A hub from before the console.
    sqlite_migrations(MIGRATIONS, MIGRATION_SET).apply(old, stop_before="m008_console")
    old.execute("INSERT INTO meta (key, value) VALUES ('desired_serial', '41')")
    old.conn.commit()
    old.close()
    store = open_store(HubSettings.model_validate({"data_dir": tmp_path}))
    try:
        assert store.serials.desired() == 41
        assert store.accounts.put("acme", "S1") == 42
        assert store.db.query("SELECT COUNT(*) AS n FROM console_users") == [{"n": 0}]
    finally:
        store.close()


@pytest.mark.postgres
def test_replicas_starting_together_migrate_the_database_once(postgres: Cluster) -> None:
    url = postgres.create()
    opened: list[PostgresDatabase] = []
    failures: list[BaseException] = []

    def start() -> None:
        try:
            opened.append(PostgresDatabase(url, MIGRATIONS))
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            failures.append(err)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert failures == []
        applied = opened[0].query(f"SELECT name FROM {MIGRATIONS_TABLE} ORDER BY name")  # noqa: S608 - a constant
        assert [r["name"] for r in applied] == [m.name for m in MIGRATIONS]
        assert opened[0].migrate(MIGRATIONS) == []  # nothing left to apply
    finally:
        for db in opened:
            db.close()


def test_the_migrations_are_numbered_in_order_once_each() -> None:
    numbers = [re.fullmatch(r"m(\d{3})_[a-z0-9_]+", m.name) for m in MIGRATIONS]
    assert [int(n.group(1)) if n else None for n in numbers] == list(range(1, len(MIGRATIONS) + 1))


def _records(path: Path) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute("SELECT * FROM _sqlite_migrations ORDER BY id").fetchall()


def _declared(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Each table's columns as declared: name, type, NOT NULL, default, place in the key."""
    with closing(sqlite3.connect(path)) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: conn.execute(f'PRAGMA table_info("{t}")').fetchall() for t in tables}


def test_a_hub_file_made_before_the_one_list_skips_what_it_had(tmp_path: Path) -> None:
    """The old code's file, at m011, applies m012 on and nothing it had (its records stay as
    they were), then holds what a new file holds, and its rows carried through m015."""
    old, fresh = tmp_path / "old", tmp_path / "fresh"
    old.mkdir()
    with closing(sqlite3.connect(old / "hub.db")) as conn:
        conn.executescript(OLD_HUB_FILE.read_text())
    before = _records(old / "hub.db")
    assert [r[2] for r in before] == [m.name for m in MIGRATIONS[:11]]
    store = open_store(HubSettings.model_validate({"data_dir": old}))
    try:
        assert store.serials.desired() == 41
        assert (store.nodes.get("n1").tenant, store.nodes.get("n1").private) == ("acme", True)
        assert store.db.query("SELECT name FROM node_names") == [{"name": "lab.local"}]
    finally:
        store.close()
    after = _records(old / "hub.db")
    assert after[: len(before)] == before
    assert [(r[1], r[2]) for r in after[len(before) :]] == [
        (MIGRATION_SET, m.name) for m in MIGRATIONS[len(before) :]
    ]
    open_store(HubSettings.model_validate({"data_dir": old})).close()
    assert _records(old / "hub.db") == after  # opened again: nothing to apply
    open_store(HubSettings.model_validate({"data_dir": fresh})).close()
    assert _declared(old / "hub.db") == _declared(fresh / "hub.db")
    assert _sqlite_schema(old / "hub.db") == _sqlite_schema(fresh / "hub.db")


@pytest.mark.postgres
def test_a_postgres_database_skips_what_it_had(postgres: Cluster) -> None:
    db = PostgresDatabase(postgres.create(), MIGRATIONS[:11])
    try:
        query = f"SELECT name, applied_at FROM {MIGRATIONS_TABLE} ORDER BY name"  # noqa: S608 - a constant
        before = db.query(query)
        assert db.migrate(MIGRATIONS) == [m.name for m in MIGRATIONS[11:]]
        assert db.query(query)[: len(before)] == before
        assert db.migrate(MIGRATIONS) == []
    finally:
        db.close()
