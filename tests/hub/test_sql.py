"""hub.state.sql: one statement, both databases. Placeholders, transactions (all or nothing,
nested ones joining the outer, soft ones committing without waiting for the disk), row
counts and error families, on a real SQLite file and a real PostgreSQL database."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from hub.state.sql import (
    Database,
    IntegrityError,
    Migration,
    PostgresDatabase,
    SQLiteDatabase,
    to_pyformat,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from tests.postgres import Cluster

MIGRATIONS = [
    Migration("m001_items", "CREATE TABLE items (id TEXT PRIMARY KEY, n {int} NOT NULL);"),
    Migration(
        "m002_notes",
        """
        CREATE TABLE notes (body TEXT NOT NULL); -- a comment; with a semicolon
        INSERT INTO notes (body) VALUES ('one; not two');
        """,
        sqlite="INSERT INTO notes (body) VALUES ('sqlite only');",
        postgres="INSERT INTO notes (body) VALUES ('postgres only');",
    ),
]


def test_placeholders_become_pyformat_outside_quotes_only() -> None:
    assert to_pyformat("SELECT ? WHERE a = ?") == "SELECT %s WHERE a = %s"
    assert to_pyformat("SELECT '?', \"we?rd\" LIKE '50%' AND ?") == (
        "SELECT '?', \"we?rd\" LIKE '50%%' AND %s"
    )
    assert to_pyformat("SELECT 100 % 7") == "SELECT 100 %% 7"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    opened: Database
    if request.param == "sqlite":
        opened = SQLiteDatabase(tmp_path / "t.db", MIGRATIONS, migration_set="test-sql")
    else:
        cluster: Cluster = request.getfixturevalue("postgres")
        opened = PostgresDatabase(cluster.create(), MIGRATIONS)
    yield opened
    opened.close()


def test_a_migration_runs_its_shared_sql_then_its_own_branch(database: Database) -> None:
    bodies = [r["body"] for r in database.query("SELECT body FROM notes ORDER BY body")]
    assert bodies == ["one; not two", f"{database.dialect} only"]


def test_a_transaction_commits_all_or_nothing_and_nested_ones_join(database: Database) -> None:
    with database.transaction():
        database.execute("INSERT INTO items (id, n) VALUES (?, ?)", ["a", 1])
        with database.transaction():  # joins: rolled back with the outer below if it fails
            database.execute("INSERT INTO items (id, n) VALUES (?, ?)", ["b", 2])

    def change_then_fail() -> None:
        with database.transaction():
            database.execute("UPDATE items SET n = n + 10")
            raise RuntimeError("changed my mind")

    with pytest.raises(RuntimeError):
        change_then_fail()
    assert database.query("SELECT id, n FROM items ORDER BY id") == [
        {"id": "a", "n": 1},
        {"id": "b", "n": 2},
    ]


def test_row_counts_and_conflicts_are_the_same_on_both(database: Database) -> None:
    insert = "INSERT INTO items (id, n) VALUES (?, ?) ON CONFLICT DO NOTHING"
    assert database.executemany(insert, [("a", 1), ("b", 2), ("a", 3)]) == 2
    assert database.execute(insert, ["b", 9]).rowcount == 0
    assert database.execute("UPDATE items SET n = n + 1 WHERE n > ?", [1]).rowcount == 1
    with pytest.raises(IntegrityError):
        database.execute("INSERT INTO items (id, n) VALUES (?, ?)", ["a", 5])

    def insert_twice() -> None:
        with database.transaction():
            database.execute("INSERT INTO items (id, n) VALUES (?, ?)", ["c", 1])
            database.execute("INSERT INTO items (id, n) VALUES (?, ?)", ["c", 2])

    with pytest.raises(IntegrityError):  # a failed transaction leaves nothing behind
        insert_twice()
    assert [r["id"] for r in database.query("SELECT id FROM items ORDER BY id")] == ["a", "b"]


def _commit_setting(database: Database) -> str:
    """How this connection commits now: SQLite's `synchronous` (2: FULL, 1: NORMAL), or
    PostgreSQL's `synchronous_commit`."""
    if isinstance(database, SQLiteDatabase):
        return str(database.execute("PRAGMA synchronous").fetchone()[0])
    return str(database.execute("SHOW synchronous_commit").fetchone()[0])


def test_a_soft_transaction_commits_without_the_disk_and_only_itself(database: Database) -> None:
    # The tests' PostgreSQL cluster is itself set not to wait for the disk (speed): what a
    # soft transaction must do is set its own, and leave the connection's as it was.
    before = _commit_setting(database)
    if isinstance(database, SQLiteDatabase):
        assert before == "2"  # FULL, as shared.db opens every store
    with database.transaction(durable=False):
        database.execute("INSERT INTO items (id, n) VALUES (?, ?)", ["a", 1])
        assert _commit_setting(database) in {"1", "off"}
        with database.transaction():  # joins the soft one
            database.execute("INSERT INTO items (id, n) VALUES (?, ?)", ["b", 2])
    # The next transaction, and everything after, commits as before; a soft one that
    # fails leaves nothing behind and puts the setting back all the same.
    assert _commit_setting(database) == before

    def fail_softly() -> None:
        with database.transaction(durable=False):
            database.execute("UPDATE items SET n = n + 10")
            raise RuntimeError("changed my mind")

    with pytest.raises(RuntimeError):
        fail_softly()
    assert _commit_setting(database) == before
    assert database.query("SELECT id, n FROM items ORDER BY id") == [
        {"id": "a", "n": 1},
        {"id": "b", "n": 2},
    ]
