"""The hub's store in a backup and after a restore (hub/backup.py has the rest): a
consistent copy of the database while the hub writes (SQLite's online backup API, or
`pg_dump`), its schema level, the database restored (`pg_restore`), and what a restored
store must do before it serves again.

Serials only move forward. A node pulls its desired state when the serial in a heartbeat
answer is greater than the one it applied, and applies a state only when its serial is
(appliance/fleet/link.py, appliance/state/store.py `apply_desired_state`). A restored hub
is back at the serial of the backup, and its nodes may have applied many since: they would
ignore the restored state as older. So a restore sets each serial to the restore's time in
microseconds, unless the backup's is greater already. A serial moves by one per committed
change, and no database commits a million changes a second, so no hub has ever handed out
a serial above its clock's microseconds, a restored one included: the jump passes every
serial any node may hold, with no protocol change, and nodes of any version take the
restored state at their next heartbeat. (This holds while the restoring machine's clock
is not behind the one of an earlier restore; a serial is an integer to 2**53 until the
year 2255.)
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

from hub.state import sql
from hub.state.migrations import MIGRATION_SET, MIGRATIONS
from hub.state.serials import AUTH_REVISION, DESIRED_SERIAL
from shared import db
from shared.backup_archive import BackupError

# The serials kept in `meta` that a restore moves forward: the desired state's, which nodes
# compare, and the authentication revision, which replicas compare to drop what they
# remember of node tokens.
SERIALS = (DESIRED_SERIAL, AUTH_REVISION)
MICROSECONDS = 1_000_000
# Debian's server and client programs, one folder per major version (not on PATH).
DEBIAN_POSTGRES = Path("/usr/lib/postgresql")
# How a hub names its connections to PostgreSQL (hub/state/sql.py): one that is connected
# to a database refuses a restore into it.
HUB_APPLICATION = "kvl-hub"
_RESTORE_APPLICATION = "kvl-hub-restore"
_TIMEOUT_S = 6 * 3600


def known_migrations() -> list[str]:
    """The schema migrations this code has, in order (one list for both databases)."""
    return [m.name for m in MIGRATIONS]


def snapshot_sqlite(source: Path, target: Path) -> tuple[list[str], dict[str, int]]:
    """A consistent copy of the hub's SQLite file, taken while it serves; the copy's
    schema migrations and serials (read from the copy: they are the copy's own)."""
    db.snapshot(source, target)
    conn = sqlite3.connect(f"{target.resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT key, value FROM meta WHERE key IN (?, ?)", list(SERIALS)
        ).fetchall()
    finally:
        conn.close()
    return sqlite_migrations(target), {str(k): int(v) for k, v in rows}


def sqlite_migrations(path: Path) -> list[str]:
    """The names of the schema migrations the SQLite file at `path` has had, oldest first."""
    return db.applied_migrations(path, sql.sqlite_migrations(MIGRATIONS, MIGRATION_SET))


def dump_postgres(url: str, target: Path) -> tuple[list[str], dict[str, int]]:
    """`pg_dump` of the hub's database (custom format) into `target`, while the replicas
    write; its schema migrations and serials. One snapshot for all three: a transaction
    here exports it, reads them, and holds it open while `pg_dump` dumps it."""
    import psycopg  # noqa: PLC0415 - only a hub on PostgreSQL loads the driver

    with _connect(url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.transaction():
            snapshot = str(conn.execute("SELECT pg_export_snapshot()").fetchone()[0])
            names = [
                str(r[0]) for r in conn.execute("SELECT name FROM schema_migrations ORDER BY name")
            ]
            rows = conn.execute(
                "SELECT key, value FROM meta WHERE key IN (%s, %s)", list(SERIALS)
            ).fetchall()
            pg_dump(url, target, snapshot=snapshot)
    return names, {str(k): int(v) for k, v in rows}


def pg_dump(url: str, target: Path, *, snapshot: str | None = None) -> None:
    """The whole database as `pg_dump` writes it, custom format, into `target` (as of an
    exported `snapshot`, if given)."""
    dbname, env = client_connection(url)
    _run(
        [postgres_program("pg_dump"), "--format=custom", "--no-owner", "--no-privileges",
         *([f"--snapshot={snapshot}"] if snapshot else []), f"--file={target}",
         f"--dbname={dbname}"],
        "pg_dump",
        env,
    )  # fmt: skip


def postgres_occupancy(url: str) -> tuple[list[str], int]:
    """(the tables of the database's schema, how many other hub connections it has)."""
    with _connect(url) as conn:
        tables = [
            str(r[0])
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
                " ORDER BY tablename"
            ).fetchall()
        ]
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s AND pid <> pg_backend_pid()",
            [HUB_APPLICATION],
        ).fetchone()
    return tables, int(row[0]) if row else 0


def drop_tables(url: str, tables: list[str]) -> None:
    """Drop the tables of the database's schema (a forced restore, once their content was
    dumped aside), in one transaction."""
    from psycopg import sql  # noqa: PLC0415 - only a hub on PostgreSQL loads the driver

    with _connect(url) as conn, conn.transaction():
        for table in tables:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(table)))


def restore_postgres(url: str, dump: Path) -> None:
    """`pg_restore` of a dump into the (empty) database, in one transaction."""
    dbname, env = client_connection(url)
    _run(
        [postgres_program("pg_restore"), "--no-owner", "--no-privileges", "--no-comments",
         "--single-transaction", "--exit-on-error", f"--dbname={dbname}", str(dump)],
        "pg_restore",
        env,
    )  # fmt: skip


def client_connection(url: str) -> tuple[str, dict[str, str]]:
    """How `pg_dump` and `pg_restore` are given the database: (the connection string for
    their command line, without a password; their environment, with it as PGPASSWORD). A
    command line is readable by every user of the machine (/proc/PID/cmdline), a process's
    environment by its own user alone; and libpq ranks PGPASSWORD as it did the URL's
    password, above any password file."""
    from psycopg import ProgrammingError, conninfo  # noqa: PLC0415

    try:
        params = conninfo.conninfo_to_dict(url)
    except ProgrammingError as err:
        raise BackupError(f"database_url is not a PostgreSQL URL: {err}") from err
    password = params.pop("password", None)
    env = dict(os.environ)
    if password is not None:
        env["PGPASSWORD"] = str(password)
    return conninfo.make_conninfo("", **params), env


def postgres_program(name: str) -> str:
    """`pg_dump` or `pg_restore`: the newest of Debian's versioned folders (a dump needs a
    client no older than the server), else the one on PATH."""
    found = sorted(
        (p for p in DEBIAN_POSTGRES.glob(f"*/bin/{name}") if p.is_file()),
        key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0,
    )
    if found:
        return str(found[-1])
    on_path = shutil.which(name)
    if on_path is None:
        raise BackupError(
            f"{name} is not installed: install PostgreSQL's client programs (Debian's "
            "`postgresql-client`), no older than the server"
        )
    return on_path


def _run(command: list[str], what: str, env: dict[str, str]) -> None:
    try:
        subprocess.run(  # noqa: S603 - our own arguments
            command, check=True, capture_output=True, text=True, timeout=_TIMEOUT_S, env=env
        )
    except subprocess.CalledProcessError as err:
        detail = (err.stderr or err.stdout or "").strip().splitlines()
        raise BackupError(f"{what} failed: {' '.join(detail[-3:]) or err}") from err
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BackupError(f"{what} failed: {err}") from err


def _connect(url: str) -> Any:
    import psycopg  # noqa: PLC0415

    try:
        # Not the store's connection: that one migrates a database as it connects, and a
        # restore must find the database as it is.
        return psycopg.connect(url, autocommit=True, application_name=_RESTORE_APPLICATION)
    except psycopg.Error as err:
        raise BackupError(f"cannot connect to PostgreSQL: {err} (database_url)") from err


def jump_serials(database: sql.Database, now: float) -> dict[str, tuple[int, int]]:
    """After a restore, before the hub serves: each serial past any a node may hold (the
    module's note says why the restore's time in microseconds is), and every console login
    ended (a session that logged out after the backup would be back otherwise). Each
    serial's (value restored, value now)."""
    floor = int(now * MICROSECONDS)
    moved: dict[str, tuple[int, int]] = {}
    with database.transaction():
        for key in SERIALS:
            row = database.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
            before = 0 if row is None else int(row[0])
            after = max(before + 1, floor)
            database.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                [key, str(after)],
            )
            moved[key] = (before, after)
        database.execute("DELETE FROM console_sessions")
    return moved
