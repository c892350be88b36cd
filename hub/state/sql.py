"""One way to run SQL on SQLite or PostgreSQL, for the hub's store.

The store writes its statements once, in the subset both databases run (`?` placeholders,
`INSERT … ON CONFLICT`, no `group_concat`, no `INSERT OR IGNORE`), and runs them through a
`Database`: `execute`, `executemany` (its row count), `query` (dict rows) and
`transaction()`. Outside a transaction each statement commits on its own. Driver errors
come out as `DatabaseError` (`IntegrityError`, `RetryableError` for a deadlock or a
serialization failure, which a caller may run again), so callers catch one family whatever
the backend.

Both open migrated by the same `Migration`s (the hub's are hub/state/migrations/), each
applied once and recorded by name in the same transaction: SQLite in sqlite-utils' table,
PostgreSQL in `schema_migrations`.

SQLite: one file in WAL mode (shared.db); a transaction is `BEGIN IMMEDIATE`, so writers
take turns, also across processes. PostgreSQL: psycopg 3 in autocommit mode, `?` rewritten
to `%s`; a transaction is READ COMMITTED, made correct under concurrency by constraints,
conditional updates and row locks (`for_update`).
"""

from __future__ import annotations

import functools
import sqlite3
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, ParamSpec, Protocol, TypeAlias, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence
    from pathlib import Path

    import psycopg
    from sqlite_utils import Database as SqliteUtilsDatabase
    from sqlite_utils.migrations import Migrations

P = ParamSpec("P")
T = TypeVar("T")
Dialect: TypeAlias = Literal["sqlite", "postgres"]

# The column types whose names differ, as a migration's shared SQL writes them: PostgreSQL's
# INTEGER and REAL are 32-bit, SQLite's hold 64.
COLUMN_TYPES: dict[Dialect, dict[str, str]] = {
    "sqlite": {"int": "INTEGER", "real": "REAL"},
    "postgres": {"int": "BIGINT", "real": "DOUBLE PRECISION"},
}


@dataclass(frozen=True)
class Migration:
    """A schema migration, written once for both databases. `sql` runs on either, with
    `{int}` and `{real}` where a column's type is named (COLUMN_TYPES; a literal brace is
    written twice); `sqlite` and `postgres`, as written, run after it on that database only:
    the branch for what the two spell differently. Statements end with `;`."""

    name: str
    sql: str
    sqlite: str = ""
    postgres: str = ""

    def scripts(self, dialect: Dialect) -> list[str]:
        """What runs on `dialect`, in order."""
        own = self.sqlite if dialect == "sqlite" else self.postgres
        return [s for s in (self.sql.format_map(COLUMN_TYPES[dialect]), own) if s.strip()]


class DatabaseError(Exception):
    """A statement failed (the driver's error is its cause)."""


class IntegrityError(DatabaseError):
    """A constraint refused the change."""


class RetryableError(DatabaseError):
    """A deadlock or a serialization failure: the transaction was rolled back and may be
    run again as it was."""


class Rows(Protocol):
    """What `execute` answers: a DB-API cursor, read at once."""

    @property
    def rowcount(self) -> int: ...

    @property
    def description(self) -> Any: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Database:
    """A connection, on one thread (an AsyncStore's), with the calls the store makes."""

    dialect: ClassVar[Dialect]
    # Appended to a SELECT that must lock the rows it reads until the transaction ends.
    # SQLite has no row locks: its transactions are BEGIN IMMEDIATE, one writer at a time.
    for_update: ClassVar[str] = ""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        raise NotImplementedError

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        """Run `sql` once per row; how many rows it changed in all."""
        raise NotImplementedError

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """The rows of a SELECT, each a dict by column name."""
        rows = self.execute(sql, params)
        names = [c[0] for c in rows.description]
        return [dict(zip(names, row, strict=True)) for row in rows.fetchall()]

    _depth = 0  # transactions open, the outermost and those nested in it

    @contextmanager
    def transaction(self, *, durable: bool = True) -> Iterator[None]:
        """Everything inside commits together, or not at all (nested: joins the outer, and
        the outer's durability).

        `durable=False` is for soft state a crash may lose whole: the commit does not wait
        for the disk (SQLite's `synchronous=NORMAL` in WAL mode, PostgreSQL's
        `synchronous_commit = off`), so it never holds the writer for a flush to disk. The
        database stays consistent either way; a crash (of the machine, not the process)
        may roll back the last such transactions, never half of one, and the next durable
        commit carries them to the disk with its own."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with self._outermost(durable=durable):
            self._depth = 1
            try:
                yield
            finally:
                self._depth = 0

    def _outermost(self, *, durable: bool) -> AbstractContextManager[None]:
        """The backend's own transaction: begun, then committed, or rolled back on error."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SQLiteDatabase(Database):
    dialect = "sqlite"

    def __init__(self, path: Path, migrations: Sequence[Migration], *, migration_set: str) -> None:
        from shared.db import open_database  # noqa: PLC0415 - shared.db imports nothing of this

        self.path = path
        self._conn = open_database(path, sqlite_migrations(migrations, migration_set)).conn
        # Autocommit: transactions are only the explicit ones (BEGIN IMMEDIATE), never a
        # write left open by the driver's implicit BEGIN.
        self._conn.commit()
        self._conn.isolation_level = None
        # What durable transactions commit with (shared.db's FULL), put back after a soft one.
        self._synchronous = int(self._conn.execute("PRAGMA synchronous").fetchone()[0])

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        try:
            return self._conn.execute(sql, params)
        except sqlite3.Error as err:
            raise _sqlite_error(err) from err

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        try:
            return self._conn.executemany(sql, rows).rowcount
        except sqlite3.Error as err:
            raise _sqlite_error(err) from err

    @contextmanager
    def _outermost(self, *, durable: bool) -> Iterator[None]:
        if not durable:
            # Set outside the transaction (SQLite takes it per connection), and back after.
            self._conn.execute("PRAGMA synchronous=NORMAL")
        try:
            self.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._conn.rollback()
                raise
            try:
                self._conn.commit()
            except sqlite3.Error as err:
                self._conn.rollback()
                raise _sqlite_error(err) from err
        finally:
            if not durable:
                self._conn.execute(f"PRAGMA synchronous={self._synchronous}")

    def close(self) -> None:
        self._conn.close()


def sqlite_migrations(migrations: Sequence[Migration], migration_set: str) -> Migrations:
    """`migrations` as a sqlite-utils set: on SQLite, sqlite-utils applies them, each in a
    transaction with its record, and records them where every file made before this list
    was one (sqlite-utils' own migrations) has its own: `_sqlite_migrations`, under
    `migration_set`. So a file skips, by name, what it had."""
    from shared.db import Migrations  # noqa: PLC0415 - sqlite_utils, for SQLite only

    runner = Migrations(migration_set)
    for migration in migrations:
        runner(name=migration.name)(_sqlite_step(migration))
    return runner


def _sqlite_step(migration: Migration) -> Callable[[SqliteUtilsDatabase], None]:
    def apply(db: SqliteUtilsDatabase) -> None:
        for script in migration.scripts("sqlite"):
            for statement in _statements(script):
                db.execute(statement)

    return apply


def _statements(script: str) -> list[str]:
    """A script's statements, one by one: sqlite3 runs one a call (its `executescript`
    would commit first, outside the migration's transaction). A `;` inside a literal or a
    comment does not end one (`sqlite3.complete_statement` says when one is whole)."""
    statements: list[str] = []
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\n;"):
                statements.append(pending)
            pending = ""
    if pending.strip(" \t\n;"):
        raise ValueError(f"an unfinished statement: {pending.strip()}")
    return statements


def _sqlite_error(err: sqlite3.Error) -> DatabaseError:
    if isinstance(err, sqlite3.IntegrityError):
        return IntegrityError(str(err))
    return DatabaseError(str(err))


@functools.lru_cache(maxsize=1024)
def to_pyformat(sql: str) -> str:
    """`?` placeholders as psycopg's `%s` (and a literal `%` as `%%`), leaving quoted
    strings and identifiers alone."""
    out: list[str] = []
    quote: str | None = None
    for char in sql:
        if quote is not None:
            if char == quote:
                quote = None
            out.append("%%" if char == "%" else char)
        elif char in "'\"":
            quote = char
            out.append(char)
        elif char == "?":
            out.append("%s")
        elif char == "%":
            out.append("%%")
        else:
            out.append(char)
    return "".join(out)


MIGRATIONS_TABLE = "schema_migrations"
# Held by the replica that migrates, so replicas starting together migrate once.
_MIGRATION_LOCK = 0x6B766C  # "kvl"


class PostgresDatabase(Database):
    dialect = "postgres"
    for_update = " FOR UPDATE"

    def __init__(self, url: str, migrations: Sequence[Migration]) -> None:
        self._url = url
        self._conn = self._connect()
        self.migrate(migrations)

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg  # noqa: PLC0415 - only a hub on PostgreSQL loads the driver

        try:
            return psycopg.connect(self._url, autocommit=True, application_name="kvl-hub")
        except psycopg.Error as err:
            raise DatabaseError(f"cannot connect to PostgreSQL: {err}") from err

    def migrate(self, migrations: Sequence[Migration]) -> list[str]:
        """Apply the migrations not applied yet, in order, each with its record; the names
        of those applied now."""
        applied: list[str] = []
        with self.transaction():
            self.execute("SELECT pg_advisory_xact_lock(?)", [_MIGRATION_LOCK])
            self.execute(
                f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE}"
                " (name TEXT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
            )
            done = {r["name"] for r in self.query(f"SELECT name FROM {MIGRATIONS_TABLE}")}  # noqa: S608 - a constant
            for migration in migrations:
                if migration.name in done:
                    continue
                for script in migration.scripts("postgres"):
                    self._script(script)
                self.execute(
                    f"INSERT INTO {MIGRATIONS_TABLE} (name, applied_at) VALUES (?, ?)",  # noqa: S608 - a constant
                    [migration.name, time.time()],
                )
                applied.append(migration.name)
        return applied

    def _script(self, sql: str) -> None:
        """Statements as they are (no parameters: PostgreSQL's simple protocol, which runs
        several at once)."""
        import psycopg  # noqa: PLC0415

        try:
            self._ready().execute(sql.encode())
        except psycopg.Error as err:
            raise _postgres_error(err) from err

    def _ready(self) -> psycopg.Connection[Any]:
        # A connection the server dropped (a restart, a failover) is opened again, between
        # transactions only: one inside a transaction fails with it.
        if self._conn.closed and not self._depth:
            self._conn = self._connect()
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        import psycopg  # noqa: PLC0415

        try:
            return self._ready().execute(to_pyformat(sql), list(params))
        except psycopg.Error as err:
            raise _postgres_error(err) from err

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        import psycopg  # noqa: PLC0415

        try:
            with self._ready().cursor() as cursor:
                cursor.executemany(to_pyformat(sql), [list(r) for r in rows])
                return cursor.rowcount
        except psycopg.Error as err:
            raise _postgres_error(err) from err

    @contextmanager
    def _outermost(self, *, durable: bool) -> Iterator[None]:
        import psycopg  # noqa: PLC0415

        try:
            with self._ready().transaction():
                if not durable:
                    self.execute("SET LOCAL synchronous_commit TO OFF")
                yield
        except psycopg.Error as err:
            raise _postgres_error(err) from err

    def close(self) -> None:
        self._conn.close()


def _postgres_error(err: Exception) -> DatabaseError:
    import psycopg  # noqa: PLC0415

    if isinstance(err, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        return RetryableError(str(err))
    if isinstance(err, psycopg.IntegrityError):
        return IntegrityError(str(err))
    return DatabaseError(str(err))


def retrying(attempts: int = 5) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Run a transactional method again when the database rolled it back as retryable."""

    def wrap(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            for attempt in range(attempts):
                try:
                    return fn(*args, **kwargs)
                except RetryableError:
                    if attempt == attempts - 1:
                        raise
                    time.sleep(0.01 * 2**attempt)
            raise AssertionError("unreachable")  # pragma: no cover

        return run

    return wrap
