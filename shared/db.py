"""SQLite as both services use it: one file in WAL mode, durable commits, append-only
migrations, and one writer thread for the event loop."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Generic, ParamSpec, Protocol, TypeVar

from shared.errors import ShuttingDown

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

# sqlite_utils imports numpy and pandas when they are installed, only to map their scalar
# types to column types; nothing here stores either. numpy is installed (the embeddings,
# the model worker), and would cost every process that opens a database about 18 MiB: so
# sqlite_utils is imported with both hidden (None in sys.modules: `import` raises
# ImportError), unless something has loaded them already. Import sqlite_utils from here.
_HIDDEN = [name for name in ("numpy", "pandas") if name not in sys.modules]
for _name in _HIDDEN:
    sys.modules[_name] = None  # type: ignore[assignment]
try:
    from sqlite_utils import Database
    from sqlite_utils.migrations import Migrations
finally:
    for _name in _HIDDEN:
        del sys.modules[_name]

__all__ = ["Database", "Migrations"]

P = ParamSpec("P")
T = TypeVar("T")
A = TypeVar("A")


def open_database(path: Path, migrations: Migrations) -> Database:
    """The database at ``path`` (created if new), migrated to the latest schema."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # check_same_thread=False: an AsyncStore opens it on its thread and uses it only there.
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=30.0)
    db = Database(conn)
    db.execute("PRAGMA journal_mode=WAL")
    # FULL makes every commit durable before the client is answered: an acknowledged
    # event survives a crash.
    db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA foreign_keys=ON")
    migrations.apply(db)
    return db


# Savepoint names: each nested block its own, so the one it rolls back to is its own.
_savepoints = itertools.count()


@contextmanager
def transaction(db: Database) -> Iterator[Database]:
    """Everything written inside commits together, or none of it does: the one way a write
    of several statements is made on a sqlite-utils database (`with transaction(db): ...`).

    Not `with db.conn:`: sqlite-utils' `Database.execute` commits each write statement at
    once unless a transaction is already open, so by the time the connection's context
    manager would roll back there is nothing left to roll back.

    The outermost block is `BEGIN IMMEDIATE`, which takes the write lock up front (waiting
    out the connection's busy timeout). Under a deferred `BEGIN` (sqlite-utils' `atomic`),
    a block that reads and then writes fails at its first write, at once and without
    waiting, when another process (the CLI) committed after its read.

    A nested block (a helper called inside another transaction) is a savepoint, not a
    depth counter that joins the outer one: when it fails, only its own writes are undone,
    so a caller that catches the error carries on with its transaction as it was before
    the block, never with half of it. The commit is still the outermost one's. Nesting is
    read from `conn.in_transaction`, which only a block here leaves set: sqlite-utils
    commits or rolls back any transaction its own calls open.

    The hub's SQLite (hub.state.sql) needs none of this: it runs its statements on the
    connection itself, in driver autocommit, and begins its transactions explicitly."""
    with _savepoint(db.conn) if db.conn.in_transaction else _outermost(db.conn):
        yield db


@contextmanager
def _outermost(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.commit()
    except BaseException:
        # A failed COMMIT leaves the transaction open: never leave it for the next write.
        if conn.in_transaction:
            conn.rollback()
        raise


@contextmanager
def _savepoint(conn: sqlite3.Connection) -> Iterator[None]:
    savepoint = f"kvl_{next(_savepoints)}"
    conn.execute(f"SAVEPOINT {savepoint}")
    try:
        yield
    except BaseException:
        # An error such as SQLITE_FULL may have rolled back the whole transaction already,
        # savepoints with it: undoing one then would hide the error.
        if conn.in_transaction:
            conn.execute(f"ROLLBACK TO {savepoint}")
            conn.execute(f"RELEASE {savepoint}")
        raise
    conn.execute(f"RELEASE {savepoint}")


def snapshot(source: Path, target: Path) -> None:
    """A consistent copy of the database at `source` in a new file `target`, taken while
    other connections go on writing: SQLite's online backup API in one step, which reads
    one snapshot (in WAL mode writers never wait for it; copied in several steps, each
    write elsewhere would start the copy over). The copy is in rollback-journal mode, one
    file whole; whoever opens it next puts it back in WAL mode."""
    source_conn = sqlite3.connect(f"{source.resolve().as_uri()}?mode=rw", uri=True, timeout=30.0)
    try:
        target_conn = sqlite3.connect(str(target))
        try:
            source_conn.backup(target_conn)
            target_conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            target_conn.close()
    finally:
        source_conn.close()


def integrity_problems(path: Path) -> list[str]:
    """What `PRAGMA integrity_check` finds wrong with the database file (none: [])."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = [str(r[0]) for r in conn.execute("PRAGMA integrity_check").fetchall()]
    except sqlite3.DatabaseError as err:
        return [str(err)]
    finally:
        conn.close()
    return [] if rows == ["ok"] else rows


def applied_migrations(path: Path, migrations: Migrations) -> list[str]:
    """The names of `migrations` the database file has had, oldest first; read only."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return [m.name for m in migrations.applied(Database(conn))]
    finally:
        conn.close()


def known_migrations(migrations: Migrations) -> list[str]:
    """The names of every migration this code has, in order."""
    return [m.name for m in migrations.pending(Database(memory=True))]


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class ChangeProbe:
    """Whether anything changed in a database file: ``version()`` moves whenever any other
    connection, in this process or another, commits (SQLite's ``PRAGMA data_version``).

    It reads only the WAL index in shared memory, so the event loop may call it."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._conn: sqlite3.Connection | None = None

    def version(self) -> int:
        return int(self._connection().execute("PRAGMA data_version").fetchone()[0])

    def generation(self, table: str) -> int:
        """The `generation` column of `table`'s one row (a counter the database's own
        triggers move), read as `version()` is, without waiting on a writer."""
        # Table names come from the caller's code, never from input.
        row = self._connection().execute(f"SELECT generation FROM {table}").fetchone()  # noqa: S608
        return int(row[0])

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = sqlite3.connect(
                f"{self._path.resolve().as_uri()}?mode=ro",
                uri=True,
                check_same_thread=False,
                timeout=1.0,
            )
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Closable(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=Closable)


class AsyncStore(Generic[S]):
    """A synchronous store for the event loop: every call runs on one dedicated thread, so
    there is exactly one writer per process and the loop never waits on disk.

    `factory(where)` opens the store on that thread (`where`: a database file, or the
    settings that name the database)."""

    def __init__(self, factory: Callable[[A], S], where: A) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvl-store")
        self._open: Callable[[], S] = lambda: factory(where)
        self._store: S | None = None
        self._closed = False

    async def open(self) -> None:
        self._store = await self._submit(self._open)

    async def close(self) -> None:
        if self._store is not None:
            await self._submit(self._store.close)
        self._closed = True
        self._executor.shutdown(wait=True)

    @property
    def sync(self) -> S:
        if self._store is None:
            raise RuntimeError("AsyncStore.open() was not awaited")
        return self._store

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a store method (``store.run(store.sync.get_model, ...)``) on the writer thread."""
        return await self._submit(fn, *args, **kwargs)

    async def _submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if self._closed:
            # A server stopping: its app closed the store while a connection kept alive
            # from before still sends requests (aiohttp serves them until it closes it).
            raise ShuttingDown("the server is stopping; send the request again", retry_after=1)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
