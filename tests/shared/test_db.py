"""shared.db.transaction: a write of several statements on a sqlite-utils database commits
all of it or none, nested blocks are savepoints, and the outermost takes the write lock at
once. On a real SQLite file, opened as both services open theirs."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from typing import TYPE_CHECKING

import pytest
from sqlite_utils.migrations import Migrations

from shared.db import open_database, transaction

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from sqlite_utils import Database

items_migrations = Migrations("test-db")


@items_migrations()
def m001_items(db: Database) -> None:
    db.execute("CREATE TABLE items (id TEXT PRIMARY KEY, n INTEGER NOT NULL)")


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "t.db"


@pytest.fixture
def db(path: Path) -> Iterator[Database]:
    opened = open_database(path, items_migrations)
    yield opened
    opened.close()


def _insert(db: Database, item: str, n: int = 0) -> None:
    db.execute("INSERT INTO items (id, n) VALUES (?, ?)", [item, n])


def _items(path: Path) -> list[tuple[str, int]]:
    """What another connection sees: only what was committed."""
    with closing(sqlite3.connect(path)) as other:
        return other.execute("SELECT id, n FROM items ORDER BY id").fetchall()


def test_a_failing_statement_takes_the_ones_before_it_back(db: Database, path: Path) -> None:
    _insert(db, "a")

    def change_then_collide() -> None:
        with transaction(db):
            db.execute("UPDATE items SET n = 1")
            _insert(db, "b")
            _insert(db, "a")  # taken already: fails after the two writes above

    with pytest.raises(sqlite3.IntegrityError):
        change_then_collide()
    assert _items(path) == [("a", 0)]
    assert not db.conn.in_transaction  # nothing left open to capture the next write


def test_an_error_of_the_code_inside_takes_everything_back(db: Database, path: Path) -> None:
    def insert_then_fail() -> None:
        with transaction(db):
            _insert(db, "a")
            raise RuntimeError("changed my mind")

    with pytest.raises(RuntimeError):
        insert_then_fail()
    assert _items(path) == []


def test_a_nested_block_commits_with_the_outermost_only(db: Database, path: Path) -> None:
    with transaction(db):
        _insert(db, "a")
        with transaction(db):
            _insert(db, "b")
        assert _items(path) == []  # the inner block's end commits nothing
    assert _items(path) == [("a", 0), ("b", 0)]


def test_a_nested_block_that_fails_is_undone_alone(db: Database, path: Path) -> None:
    def insert_then_collide() -> None:
        with transaction(db):
            _insert(db, "b")
            _insert(db, "a")

    with transaction(db):
        _insert(db, "a")
        with pytest.raises(sqlite3.IntegrityError):
            insert_then_collide()
        # The caller caught it: its transaction goes on as it was before the block.
        _insert(db, "c")
    assert _items(path) == [("a", 0), ("c", 0)]


def test_an_outer_block_that_fails_takes_its_nested_ones_back(db: Database, path: Path) -> None:
    def nest_then_fail() -> None:
        with transaction(db):
            _insert(db, "a")
            with transaction(db):
                _insert(db, "b")
            raise RuntimeError("after the nested block")

    with pytest.raises(RuntimeError):
        nest_then_fail()
    assert _items(path) == []


def test_the_write_lock_is_taken_at_the_start(db: Database, path: Path) -> None:
    # BEGIN IMMEDIATE: another writer is kept out from the first read on, so a block that
    # reads and then writes never finds its read overtaken at its first write.
    with closing(sqlite3.connect(path, timeout=0, isolation_level=None)) as other:
        with transaction(db):
            db.execute("SELECT COUNT(*) FROM items").fetchone()
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")  # free again once it committed
        other.execute("ROLLBACK")
