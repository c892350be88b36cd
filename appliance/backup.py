"""A backup of the appliance, taken while it serves, and its restore into a stopped
appliance's data directory (`kvl appliance backup`, `kvl appliance restore`; the archive's
format is shared/backup_archive.py's).

A backup holds the appliance's state: a consistent copy of `appliance.db` (accounts, API
key hashes, usage events and the outbox with its checkpoints, jobs and their webhook
deliveries, webhook secrets, model records and pins, who sees which package, quota leases,
stored responses), its identity in `fleet/` (the node's token, WireGuard key, certificate
and key, the hub's CA bundle: a restored node is the same node to its hub, and enrolls no
more), and, unless left out, the package cache in `packages/`. Not the models: the
embedded ones are assembled again on first use, the hub places its own again, and a model
registered by path stays where it is.

A restore refuses a running appliance (the data directory's lock), a data directory that
is not empty unless forced (what is there is then set aside, never deleted), and an archive
it cannot trust (shared/backup_archive.py `read_archive`) or whose schema is newer than this
code's; then makes the restored store ready (appliance/state/dump.py says what it
changes, and why).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.state import dump as stored
from appliance.state.store import Store
from shared import __version__, db
from shared.backup_archive import (
    BackupError,
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

    from appliance.settings import ApplianceSettings

KIND: Kind = "appliance"
DATABASE = "appliance.db"
_FLEET = re.compile(r"^fleet/[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # not the .tmp files of a write
_BLOB = re.compile(r"^packages/blobs/sha256/([0-9a-f]{64})$")
_LAYOUT = {"packages/oci-layout", "packages/index.json"}
_TAKEN = {DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", "fleet", "packages"}


def allowed(path: str) -> bool:
    """The paths an appliance's backup may hold: nothing else is ever restored."""
    return path == DATABASE or path in _LAYOUT or bool(_FLEET.match(path) or _BLOB.match(path))


@dataclass(frozen=True)
class Restored:
    manifest: Manifest
    epoch: str  # the live objectives' new epoch
    set_aside: Path | None  # where what the target held went (--force)


def backup(
    settings: ApplianceSettings,
    out: Path,
    *,
    packages: bool = True,
    clock: Callable[[], float] = time.time,
) -> Made:
    """The appliance's backup in the archive `out` (mode 0600), taken while it serves."""
    check_out(out)
    if not settings.db_path.is_file():
        raise BackupError(f"no appliance database at {settings.db_path}: nothing to back up")
    created = clock()
    with tempfile.TemporaryDirectory(prefix=".kvl-backup-", dir=out.parent) as work:
        copy = Path(work) / DATABASE
        names, serials = stored.snapshot(settings.db_path, copy)
        sources = [Source(DATABASE, copy, private=True), *_fleet(settings.fleet_dir)]
        if packages:
            sources += _packages(settings.packages_dir)
        manifest = write_archive(
            out,
            kind=KIND,
            kvl_version=__version__,
            created_at=created,
            store="sqlite",
            migrations=names,
            serials=serials,
            sources=sources,
        )
    left_out = [name for name in occupied(settings.data_dir) if name not in _TAKEN]
    if not packages and settings.packages_dir.is_dir():
        left_out.append("packages")
    return Made(manifest, sorted(left_out))


def _fleet(folder: Path) -> list[Source]:
    """The node's identity files, read whole (each is written whole, by a rename)."""
    if not folder.is_dir():
        return []
    sources = []
    for path in sorted(folder.iterdir()):
        name = f"fleet/{path.name}"
        if _FLEET.match(name) and path.is_file() and not path.is_symlink():
            sources.append(Source(name, path.read_bytes(), private=is_private(path)))
    return sources


def _packages(folder: Path) -> list[Source]:
    """The package cache: its index first, then its blobs, each named by its sha256 (a
    package evicted while this runs may lack a blob; the cache refuses such a package,
    and one the hub seeds is fetched again)."""
    sources = [
        Source(name, (folder / name.removeprefix("packages/")).read_bytes(), private=True)
        for name in sorted(_LAYOUT)
        if (folder / name.removeprefix("packages/")).is_file()
    ]
    blobs = folder / "blobs" / "sha256"
    if blobs.is_dir():
        sources += [
            Source(f"packages/blobs/sha256/{p.name}", p, private=is_private(p), sha256=p.name)
            for p in sorted(blobs.iterdir())
            if _BLOB.match(f"packages/blobs/sha256/{p.name}") and p.is_file() and not p.is_symlink()
        ]
    return sources


def restore(
    settings: ApplianceSettings,
    archive: Path,
    *,
    force: bool = False,
    clock: Callable[[], float] = time.time,
) -> Restored:
    """The appliance in `archive` restored into this appliance's data directory, which no
    appliance may be serving from; BackupError when refused, with nothing of it changed."""
    data_dir = settings.data_dir
    with restoring(data_dir, "an appliance"):
        present = occupied(data_dir)
        if not force:
            refuse_occupied(present, data_dir)
        staging = Path(tempfile.mkdtemp(prefix=".restore-", dir=data_dir))
        try:
            manifest = _read(archive, staging)
            aside = None
            if present:
                aside = set_aside(data_dir, present, aside_stamp(clock()))
            install(staging, data_dir, sorted(p.name for p in staging.iterdir()))
            store = Store(settings.db_path)  # an older schema is migrated forward here
            try:
                epoch = stored.after_restore(store)
            finally:
                store.close()
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return Restored(manifest, epoch, aside)


# A restore the admin API received and checked, applied when the appliance next starts
# (`apply_pending`, before it serves), since no appliance may serve from the data
# directory a restore writes into.
PENDING = "restore-pending.tar"


def verify(settings: ApplianceSettings, archive: Path) -> Manifest:
    """Everything a restore checks of `archive` (every member against its digest, the
    database's integrity and schema), written to a scratch folder of the data directory
    and removed: nothing of the appliance's changes. BackupError when it would refuse."""
    staging = Path(tempfile.mkdtemp(prefix=".verify-", dir=settings.data_dir))
    try:
        return _read(archive, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def apply_pending(
    settings: ApplianceSettings, clock: Callable[[], float] = time.time
) -> Restored | None:
    """The restore the admin API left in `PENDING`, applied (what the data directory held
    set aside, as `restore --force` does); None when there is none. An archive refused now
    is kept as `restore-refused-<stamp>.tar`, the data directory as it was."""
    pending = settings.data_dir / PENDING
    if not pending.is_file():
        return None
    try:
        restored = restore(settings, pending, force=True, clock=clock)
    except BackupError:
        pending.rename(settings.data_dir / f"restore-refused-{aside_stamp(clock())}.tar")
        raise
    if restored.set_aside is not None:  # the archive itself went aside with the rest
        (restored.set_aside / PENDING).unlink(missing_ok=True)
    return restored


def _read(archive: Path, staging: Path) -> Manifest:
    manifest = read_archive(archive, staging, kind=KIND, allowed=allowed, check=_check)
    problems = db.integrity_problems(staging / DATABASE)
    if problems:
        raise BackupError(f"the archive's database is damaged: {problems[0]}")
    if stored.sqlite_migrations(staging / DATABASE) != manifest.migrations:
        raise BackupError("the archive's database does not have the schema its manifest names")
    return manifest


def _check(manifest: Manifest) -> None:
    """What a restore refuses of a manifest, before it reads a member."""
    known = stored.known_migrations()
    newer = [name for name in manifest.migrations if name not in known]
    if newer:
        raise BackupError(
            f"the archive's schema is newer than this appliance's (migration {newer[0]}; made "
            f"by kvl {manifest.kvl_version}): restore it with that version of kvl or a later one"
        )
    if manifest.store != "sqlite" or manifest.member(DATABASE) is None:
        raise BackupError(f"the archive holds no appliance database ({DATABASE})")
    for member in manifest.members:
        blob = _BLOB.match(member.path)
        if blob is not None and blob.group(1) != member.sha256:
            raise BackupError(f"{member.path} is not named by its digest")
