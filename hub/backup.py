"""A backup of the hub, taken while it serves, and its restore into a stopped hub's data
directory (`kvl hub backup`, `kvl hub restore`; the archive's format is shared/backup_archive.py's).

A backup holds what a working hub needs: its store (a consistent copy of `hub.db`, or a
`pg_dump` of its PostgreSQL database), its identity in `pki/` (the CA that nodes trust, its
key, the hub's own certificate) and `wireguard/private.key` (the key nodes know the hub's
tunnel by), and, unless left out, `artifacts/` (the model files and package archives it
serves to nodes). The database is copied first: every artifact it names was there before
it, and artifacts are never removed, so all of them are in the archive.

A restore refuses a running hub (the data directory's lock, and for PostgreSQL the hub's
connections to the database), a data directory or database that is not empty unless
forced (what is there is then set aside, never deleted), and an archive it cannot trust
(shared/backup_archive.py `read_archive`) or whose schema is newer than this code's. Once the
store is back, its serials jump forward (hub/state/dump.py says why and by how much), so
every node takes the restored state.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hub.state import dump as stored
from hub.state.store import open_database
from shared import __version__, db
from shared.backup_archive import (
    BackupError,
    DataDirBusyError,
    Kind,
    Made,
    Manifest,
    Source,
    aside_stamp,
    check_out,
    install,
    is_private,
    occupied,
    read_archive,
    refuse_occupied,
    restoring,
    set_aside,
    write_archive,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from hub.settings import HubSettings

KIND: Kind = "hub"
DATABASE = "hub.db"
DUMP = "hub.pgdump"
WIREGUARD_KEY = "wireguard/private.key"
_PKI = re.compile(r"^pki/[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # not the .tmp files of a write
_ARTIFACT = re.compile(r"^artifacts/([0-9a-f]{64})$")
# What the data directory holds that a backup takes (or needs not: SQLite's own files
# beside the database, the lock); anything else is named as left out.
_TAKEN = {DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", "pki", "wireguard", "artifacts"}
_STORES = {"sqlite": "SQLite", "postgres": "PostgreSQL"}


def allowed(path: str) -> bool:
    """The paths a hub's backup may hold: nothing else is ever restored."""
    return path in {DATABASE, DUMP, WIREGUARD_KEY} or bool(
        _PKI.match(path) or _ARTIFACT.match(path)
    )


@dataclass(frozen=True)
class Restored:
    manifest: Manifest
    serials: dict[str, tuple[int, int]]  # each serial: (as restored, moved on to)
    set_aside: Path | None  # where what the target held went (--force)


def backup(
    settings: HubSettings,
    out: Path,
    *,
    artifacts: bool = True,
    clock: Callable[[], float] = time.time,
) -> Made:
    """The hub's backup in the archive `out` (mode 0600), taken while it serves."""
    check_out(out)
    created = clock()
    with tempfile.TemporaryDirectory(prefix=".kvl-backup-", dir=out.parent) as work:
        if settings.database_url is None:
            if not settings.db_path.is_file():
                raise BackupError(f"no hub database at {settings.db_path}: nothing to back up")
            copy = Path(work) / DATABASE
            names, serials = stored.snapshot_sqlite(settings.db_path, copy)
            sources = [Source(DATABASE, copy, private=True)]
        else:
            copy = Path(work) / DUMP
            names, serials = stored.dump_postgres(settings.database_url, copy)
            sources = [Source(DUMP, copy, private=True)]
        sources += _identity(settings.data_dir)
        if artifacts:
            sources += _artifacts(settings.artifacts_dir)
        manifest = write_archive(
            out,
            kind=KIND,
            kvl_version=__version__,
            created_at=created,
            store="sqlite" if settings.database_url is None else "postgres",
            migrations=names,
            serials=serials,
            sources=sources,
        )
    left_out = [name for name in occupied(settings.data_dir) if name not in _TAKEN]
    if not artifacts and settings.artifacts_dir.is_dir():
        left_out.append("artifacts")
    return Made(manifest, sorted(left_out))


def _identity(data_dir: Path) -> list[Source]:
    """The CA's and the hub's keys and certificates and the WireGuard key, read whole, the
    same on two reads in a row (a CA rotation writes several files)."""
    for _ in range(5):
        try:
            first, second = _read_identity(data_dir), _read_identity(data_dir)
        except FileNotFoundError:  # replaced between the listing and the read
            continue
        if first == second:
            return [Source(path, body, private) for path, (body, private) in first.items()]
    raise BackupError("pki/ kept changing while it was read (a CA rotation?): run the backup again")


def _read_identity(data_dir: Path) -> dict[str, tuple[bytes, bool]]:
    files: dict[str, tuple[bytes, bool]] = {}
    pki = data_dir / "pki"
    candidates = sorted(pki.iterdir()) if pki.is_dir() else []
    candidates.append(data_dir / WIREGUARD_KEY)
    for path in candidates:
        name = path.relative_to(data_dir).as_posix()
        if path.is_symlink() or not path.is_file() or not allowed(name):
            continue
        files[name] = (path.read_bytes(), is_private(path))
    return files


def _artifacts(folder: Path) -> list[Source]:
    """Model files and package archives, each named by its sha256 (checked as it is
    written into the archive)."""
    if not folder.is_dir():
        return []
    return [
        Source(f"artifacts/{path.name}", path, private=is_private(path), sha256=path.name)
        for path in sorted(folder.iterdir())
        if _ARTIFACT.match(f"artifacts/{path.name}") and path.is_file() and not path.is_symlink()
    ]


def restore(
    settings: HubSettings,
    archive: Path,
    *,
    force: bool = False,
    clock: Callable[[], float] = time.time,
) -> Restored:
    """The hub in `archive` restored into this hub's data directory (and database), which
    no hub may be running on; BackupError when refused, with nothing of the target changed."""
    data_dir, url = settings.data_dir, settings.database_url
    with restoring(data_dir, "a hub"):
        present = occupied(data_dir)
        tables: list[str] = []
        if url is not None:
            tables, others = stored.postgres_occupancy(url)
            if others:
                raise DataDirBusyError(
                    f"{others} hub connection(s) are open on the database (database_url): "
                    "stop every replica, and every `kvl hub` command, before restoring"
                )
        if not force:
            refuse_occupied([*present, *(["the database's tables"] if tables else [])], data_dir)
        staging = Path(tempfile.mkdtemp(prefix=".restore-", dir=data_dir))
        try:
            manifest = read_archive(
                archive, staging, kind=KIND, allowed=allowed, check=lambda m: _check(m, url)
            )
            if manifest.store == "sqlite":
                _check_database(staging / DATABASE, manifest)
            # Everything checked: from here on the target changes.
            aside = None
            if present or tables:
                aside = set_aside(data_dir, present, aside_stamp(clock()))
                if url is not None and tables:
                    stored.pg_dump(url, aside / DUMP)
                    stored.drop_tables(url, tables)
            if url is not None:
                stored.restore_postgres(url, staging / DUMP)
                (staging / DUMP).unlink()
            install(staging, data_dir, sorted(p.name for p in staging.iterdir()))
            database = open_database(settings)  # an older schema is migrated forward here
            try:
                serials = stored.jump_serials(database, clock())
            finally:
                database.close()
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return Restored(manifest, serials, aside)


def _check(manifest: Manifest, url: str | None) -> None:
    """What a restore refuses of a manifest, before it reads a member."""
    want = "sqlite" if url is None else "postgres"
    if manifest.store != want:
        raise BackupError(
            f"the archive holds a hub's store on {_STORES[manifest.store]}; this hub's settings "
            f"put it on {_STORES[want]} (database_url): restore with settings like the ones it "
            "was made with"
        )
    known = stored.known_migrations()
    newer = [name for name in manifest.migrations if name not in known]
    if newer:
        raise BackupError(
            f"the archive's schema is newer than this hub's (migration {newer[0]}; made by kvl "
            f"{manifest.kvl_version}): restore it with that version of kvl or a later one"
        )
    wanted, other = (DATABASE, DUMP) if want == "sqlite" else (DUMP, DATABASE)
    if manifest.member(wanted) is None or manifest.member(other) is not None:
        raise BackupError(f"the archive holds no {_STORES[want]} store ({wanted})")
    for member in manifest.members:
        artifact = _ARTIFACT.match(member.path)
        if artifact is not None and artifact.group(1) != member.sha256:
            raise BackupError(f"{member.path} is not named by its digest")


def _check_database(path: Path, manifest: Manifest) -> None:
    problems = db.integrity_problems(path)
    if problems:
        raise BackupError(f"the archive's database is damaged: {problems[0]}")
    if stored.sqlite_migrations(path) != manifest.migrations:
        raise BackupError("the archive's database does not have the schema its manifest names")
