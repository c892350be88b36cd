"""A backup as one archive file, the hub's and the appliance's alike, and the lock that
keeps a restore away from a data directory a process serves from.

The archive is a tar (gzipped when its name ends in `.gz` or `.tgz`) whose first member is
`manifest.json`: the format and its version, what was backed up (`hub` or `appliance`),
the kvl version, when, the store's kind and the schema migrations it had, and every other
member with its size, sha256 and whether it is a secret. The manifest comes first so a
restore knows what it is reading before it reads anything else.

A restore trusts nothing in the archive (`read_archive`). The manifest is checked whole
before any other member is read: each path is relative, normalised and one the caller
allows (a whitelist per kind, so no name can reach outside the data directory), each
appears once, and their sizes fit the free disk. Then each member, as it comes, must be a
regular file (no link, directory, device or sparse file) the manifest names, of the size
it names, and its bytes must hash to its digest; it is written into a staging directory
the restore made, never by the archive's own names or modes: a secret is written 0600,
anything else 0644. Anything else is refused with a BackupError that names it. Nothing
of the target changes until every member has been checked.

Memory stays bounded whatever the archive holds. The tar headers are read block by block
(`shared.tarstream`), not by tarfile, which reads a PAX extended header or a GNU long name
whole at whatever size its header claims (a few hundred KiB of gzip hold hundreds of MiB
of one) and follows a chain of them by recursion: an extended header's size is checked
before its body is read, and so is how many come before one member. The manifest's size
is checked before it is read, and its nesting as it is parsed (`shared.jsonlimits`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import hashlib
import io
import os
import re
import secrets
import shutil
import tarfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared import jsonlimits, tarstream

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

FORMAT: Literal["kvl-backup"] = "kvl-backup"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20
MAX_MEMBERS = 200_000
# How many objects and arrays, and values, a manifest may hold: counted in its bytes before
# it is parsed, since a parsed value takes tens of bytes (16 MiB of `{},` took 800 MiB). A
# member is one object of four values; the migrations and serials are a few thousand more.
_MAX_MANIFEST_CONTAINERS = MAX_MEMBERS + 16
_MAX_MANIFEST_VALUES = 6 * MAX_MEMBERS + 20_000
# The body of one PAX extended header or GNU long name or link. Ours hold a path of at most
# 1 KiB (a Member's); GNU tar's, a name up to PATH_MAX (4 KiB).
MAX_HEADER_BYTES = 64 << 10
# Extended headers before one member: ours write one PAX header, GNU tar a long link, a
# long name and a PAX header at most.
MAX_EXTENDED_HEADERS = 4
# Held by every process that serves from a data directory (shared); a restore takes it
# alone. Never part of a backup.
LOCK_FILE = "serving.lock"
# Kept free on the disk a restore writes to, beyond what the archive's members take.
SPARE_BYTES = 64 << 20
_CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

Kind = Literal["hub", "appliance"]
StoreKind = Literal["sqlite", "postgres"]


class BackupError(Exception):
    """A backup or a restore that cannot be made; the message says why, and what to do."""


class DataDirBusyError(BackupError):
    """The data directory is held by another process: a server, or a restore."""


class Member(BaseModel):
    """A file of the backup: its path in the archive (and under the data directory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, max_length=1024)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=_SHA256.pattern)
    private: bool  # a secret: restored mode 0600, anything else 0644


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["kvl-backup"] = FORMAT
    version: int = Field(FORMAT_VERSION, ge=1)
    kind: Kind
    kvl_version: str = Field(max_length=100)
    created_at: float = Field(ge=0, allow_inf_nan=False)  # unix seconds
    store: StoreKind
    # The store's schema: the names of the migrations it had, oldest first.
    migrations: list[str] = Field(max_length=10_000)
    # Serials and epochs as they were, for the record (what a restore moved on from).
    serials: dict[str, int] = Field(default_factory=dict, max_length=100)
    members: list[Member] = Field(max_length=MAX_MEMBERS)

    @property
    def size(self) -> int:
        return sum(m.size for m in self.members)

    def member(self, path: str) -> Member | None:
        return next((m for m in self.members if m.path == path), None)


@dataclass(frozen=True)
class Source:
    """What goes into a backup under `path`: a file, or bytes read already. `sha256` when
    known before (a content-addressed file, named by it): checked as it is written."""

    path: str
    content: Path | bytes
    private: bool
    sha256: str | None = None


@dataclass(frozen=True)
class Made:
    """A backup written: its manifest, and what the data directory holds that it does not."""

    manifest: Manifest
    left_out: list[str]


def check_out(out: Path) -> None:
    """Refuse to write a backup over a file, or into a folder that is not there."""
    if out.exists() or out.is_symlink():
        raise BackupError(f"{out} exists already: name another file")
    if not out.parent.is_dir():
        raise BackupError(f"{out.parent} is not a folder")


def refuse_occupied(held: Sequence[str], data_dir: Path) -> None:
    """Refuse a restore into a target that holds something (`held`, what it names)."""
    if held:
        named = ", ".join(held[:4]) + (", …" if len(held) > 4 else "")
        raise BackupError(
            f"the target is not empty ({named} in {data_dir}): restore into an empty one, or "
            "pass --force to set what is there aside first"
        )


def aside_stamp(now: float) -> str:
    """The name of the folder a forced restore sets the target's files aside in."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(2)}"


def is_private(path: Path) -> bool:
    """Whether a file is a secret: readable by its owner alone (shared.files.write_private)."""
    return path.stat().st_mode & 0o077 == 0


def safe_path(path: str) -> bool:
    """A relative POSIX path, written the one way (no `.`, `..`, empty part, backslash,
    NUL or trailing slash): one that stays under the directory it is joined to."""
    if not path or path.startswith("/") or "\\" in path or "\0" in path:
        return False
    parts = path.split("/")
    return all(p not in {"", ".", ".."} and len(p.encode()) <= 255 for p in parts)


def write_archive(
    out: Path,
    *,
    kind: Kind,
    kvl_version: str,
    created_at: float,
    store: StoreKind,
    migrations: Sequence[str],
    serials: dict[str, int],
    sources: Sequence[Source],
) -> Manifest:
    """The archive at `out` (mode 0600: it holds keys), written beside it and linked into
    place once whole, so `out` is never half a backup; BackupError when `out` exists, or a
    file changed while it was read."""
    if out.exists() or out.is_symlink():
        raise BackupError(f"{out} exists already: name another file")
    members = [_member(source) for source in sources]
    manifest = Manifest(
        kind=kind,
        kvl_version=kvl_version,
        created_at=created_at,
        store=store,
        migrations=list(migrations),
        serials=serials,
        members=members,
    )
    body = manifest.model_dump_json(indent=1).encode()
    partial = out.with_name(f".{out.name}.{secrets.token_hex(4)}.partial")
    compressed = out.name.endswith((".gz", ".tgz"))
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as raw:
            os.fchmod(fd, 0o600)
            with contextlib.ExitStack() as stack:
                gz = (
                    stack.enter_context(
                        gzip.GzipFile(
                            fileobj=raw, mode="wb", compresslevel=6, mtime=int(created_at)
                        )
                    )
                    if compressed
                    else None
                )
                tar = stack.enter_context(
                    tarfile.open(fileobj=gz or raw, mode="w", format=tarfile.PAX_FORMAT)
                )
                _add(tar, MANIFEST, io.BytesIO(body), size=len(body), at=created_at, private=False)
                for source, member in zip(sources, members, strict=True):
                    _add_checked(tar, source, member, created_at)
            raw.flush()
            os.fsync(fd)
        try:
            os.link(partial, out)  # never over a file that appeared meanwhile
        except FileExistsError as err:
            raise BackupError(f"{out} exists already: name another file") from err
        _sync_dir(out.parent)
    except OSError as err:
        raise BackupError(f"cannot write {out}: {err}") from err
    finally:
        partial.unlink(missing_ok=True)
    return manifest


def _member(source: Source) -> Member:
    if not safe_path(source.path):  # pragma: no cover - the callers name their own paths
        raise BackupError(f"{source.path!r} is not a path a backup may hold")
    if isinstance(source.content, bytes):
        digest, size = hashlib.sha256(source.content).hexdigest(), len(source.content)
    elif source.sha256 is not None:
        digest, size = source.sha256, source.content.stat().st_size
    else:
        digest, size = _hash_file(source.content)
    return Member(path=source.path, size=size, sha256=digest, private=source.private)


def _hash_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class _Hashing:
    """A file read through, hashed as it is read."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        chunk = self._file.read(size)
        self.digest.update(chunk)
        return chunk


def _add_checked(tar: tarfile.TarFile, source: Source, member: Member, at: float) -> None:
    if isinstance(source.content, bytes):
        _add(
            tar, member.path, io.BytesIO(source.content),
            size=member.size, at=at, private=member.private,
        )  # fmt: skip
        return
    with source.content.open("rb") as file:
        hashing = _Hashing(file)
        try:
            _add(
                tar, member.path, cast("IO[bytes]", hashing),
                size=member.size, at=at, private=member.private,
            )  # fmt: skip
        except OSError as err:  # shorter than it was: tarfile's "unexpected end of data"
            raise BackupError(f"{source.content} changed while it was backed up: {err}") from err
    if hashing.digest.hexdigest() != member.sha256:
        raise BackupError(
            f"{source.content} changed while it was backed up (or does not match the "
            "digest it is named by): run the backup again"
        )


def _add(
    tar: tarfile.TarFile, name: str, file: IO[bytes], *, size: int, at: float, private: bool
) -> None:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(at)
    info.mode = 0o600 if private else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, file)


def read_archive(
    archive: Path,
    staging: Path,
    *,
    kind: Kind,
    allowed: Callable[[str], bool],
    check: Callable[[Manifest], None],
) -> Manifest:
    """Every member of `archive` checked and written under `staging` (an empty directory
    the caller made, and removes when this raises); the manifest. `allowed`: the paths a
    backup of `kind` may hold; `check`: what else the caller refuses of the manifest
    (raising BackupError), before any other member is read."""
    try:
        # A stream: one pass, members in order, the manifest first.
        with tarstream.TarStream.open(
            archive, max_header_bytes=MAX_HEADER_BYTES, max_extended_headers=MAX_EXTENDED_HEADERS
        ) as tar:
            manifest = _read_manifest(tar, archive, kind, allowed)
            check(manifest)
            free = shutil.disk_usage(staging).free
            if manifest.size + SPARE_BYTES > free:
                raise BackupError(
                    f"{archive} holds {manifest.size} bytes; {staging.parent} has "
                    f"{free} free (and keeps {SPARE_BYTES} spare): make room first"
                )
            expected = {m.path: m for m in manifest.members}
            seen: set[str] = set()
            while (info := tar.next()) is not None:
                member = _admitted(info, expected, seen)
                _extract(tar, member, staging)
                seen.add(member.path)
    except tarstream.TarStreamError as err:
        raise _refused(err, archive) from err
    except (EOFError, zlib.error, OSError) as err:  # a damaged gzip, or the file's own
        raise BackupError(f"{archive} is not a readable backup: {err}") from err
    missing = sorted(set(expected) - seen)
    if missing:
        raise BackupError(
            f"{archive} is missing {len(missing)} member(s) its manifest names ({missing[0]}, "
            "…): a truncated or altered archive"
        )
    _sync_dir(staging)
    return manifest


def _refused(err: tarstream.TarStreamError, archive: Path) -> BackupError:
    """What the tar reader refused, in the words a restore has always said it."""
    if isinstance(err, tarstream.UnreadableError):
        return BackupError(f"{archive} is not a readable backup: {err}")
    if isinstance(err, tarstream.ExtendedHeaderTooLargeError):
        return BackupError(
            f"{archive}: an extended tar header of {err.size} bytes (refused: a backup's are "
            f"at most {err.limit})"
        )
    if isinstance(err, tarstream.TooManyExtendedHeadersError):
        return BackupError(
            f"{archive}: more than {err.limit} extended tar headers before one member "
            "(refused: a backup has one at most)"
        )
    if isinstance(err, tarstream.SparseMemberError):
        return BackupError(
            f"{err.name!r} is not a regular file (a sparse one: a backup holds regular files only)"
        )
    return BackupError(f"{archive}: {err}")


def _read_manifest(
    tar: tarstream.TarStream, archive: Path, kind: Kind, allowed: Callable[[str], bool]
) -> Manifest:
    first = tar.next()
    if first is None or first.name != MANIFEST or not _plain(first):
        raise BackupError(f"{archive} is not a kvl backup: it does not begin with {MANIFEST}")
    if first.size > MAX_MANIFEST_BYTES:
        raise BackupError(
            f"{archive}: a manifest of {first.size} bytes is too large (at most "
            f"{MAX_MANIFEST_BYTES})"
        )
    body = tar.read(first.size)
    # Upper bounds (a bracket or comma inside a string counts too), in C, without a copy.
    containers = body.count(b"{") + body.count(b"[")
    if (
        containers > _MAX_MANIFEST_CONTAINERS
        or containers + body.count(b",") > _MAX_MANIFEST_VALUES
    ):
        raise BackupError(
            f"{archive}: its manifest holds more objects, arrays or values than a backup of "
            f"{MAX_MEMBERS} members"
        )
    try:
        # Nesting bounded: a deep one would end in a RecursionError, here or in pydantic.
        raw = jsonlimits.loads(body)
    except jsonlimits.JsonLimitError as err:
        raise BackupError(f"{archive}: its manifest is refused: {err}") from err
    except ValueError as err:
        raise BackupError(f"{archive}: its manifest is not JSON ({err})") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise BackupError(f"{archive} is not a kvl backup (its manifest names no {FORMAT})")
    version = raw.get("version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise BackupError(
            f"{archive} is a backup of format {version}, made by a newer kvl (this one reads "
            f"format {FORMAT_VERSION}): restore it with that version"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as err:
        raise BackupError(f"{archive}: its manifest is malformed: {err}") from err
    if manifest.kind != kind:
        raise BackupError(f"{archive} is a backup of {manifest.kind}, not of {kind}")
    _check_paths(manifest, archive, allowed)
    return manifest


def _check_paths(manifest: Manifest, archive: Path, allowed: Callable[[str], bool]) -> None:
    """Each path of the manifest once, safe, and one a backup of its kind holds."""
    kind = manifest.kind
    paths: set[str] = set()
    for member in manifest.members:
        path = member.path
        if path in paths:
            raise BackupError(f"{archive}: its manifest names {path!r} twice")
        if not safe_path(path) or path == MANIFEST or not allowed(path):
            raise BackupError(
                f"{archive}: its manifest names {path!r}, which a backup of {kind} never "
                "holds (refused: nothing is written outside the data directory)"
            )
        paths.add(path)
    # A file and a folder of the same name cannot both be restored.
    for path in paths:
        parents = PurePosixPath(path).parents
        clash = next((str(p) for p in parents if str(p) in paths), None)
        if clash is not None:
            raise BackupError(f"{archive}: its manifest names {clash!r} as a file and a folder")


def _plain(info: tarfile.TarInfo) -> bool:
    # isfile() is true of GNU sparse members too, whose holes read back as zeros: a few
    # bytes of archive could stand for terabytes.
    return info.type in {tarfile.REGTYPE, tarfile.AREGTYPE} and not info.issparse()


def _admitted(info: tarfile.TarInfo, expected: dict[str, Member], seen: set[str]) -> Member:
    """The manifest's entry for a member, from its header alone; BackupError for anything
    the manifest does not name exactly as it is."""
    name = info.name
    member = expected.get(name)
    if member is None:
        raise BackupError(
            f"{name!r}: a member the manifest does not name (refused: nothing is written "
            "outside the data directory)"
        )
    if name in seen:
        raise BackupError(f"{name!r} appears twice in the archive")
    if info.issym() or info.islnk():
        raise BackupError(f"{name!r} is a link (a backup holds regular files only)")
    if not _plain(info):
        raise BackupError(f"{name!r} is not a regular file (a backup holds regular files only)")
    if info.size != member.size:
        raise BackupError(
            f"{name!r} holds {info.size} bytes; its manifest says {member.size} (refused: an "
            "oversized or altered member)"
        )
    return member


def _extract(tar: tarstream.TarStream, member: Member, staging: Path) -> None:
    """The member's bytes into a file of our own making under `staging`, hashed as they
    are written; BackupError when they do not match the manifest's digest."""
    target = staging.joinpath(*PurePosixPath(member.path).parts)
    # Folders as the services make them (the umask's); the secrets in them are 0600.
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    digest = hashlib.sha256()
    left = member.size
    with os.fdopen(fd, "wb") as out:
        os.fchmod(fd, 0o600 if member.private else 0o644)
        while left > 0:
            chunk = tar.read(min(_CHUNK, left))
            if not chunk:
                raise BackupError(f"{member.path!r} ends before its {member.size} bytes")
            digest.update(chunk)
            out.write(chunk)
            left -= len(chunk)
        out.flush()
        os.fsync(fd)
    if digest.hexdigest() != member.sha256:
        raise BackupError(f"{member.path!r} does not match its digest in the manifest")


def occupied(data_dir: Path) -> list[str]:
    """What the data directory holds, the lock file aside (a fresh directory: nothing)."""
    if not data_dir.is_dir():
        return []
    return sorted(p.name for p in data_dir.iterdir() if p.name != LOCK_FILE)


def set_aside(data_dir: Path, names: Sequence[str], stamp: str) -> Path:
    """Move `names` of the data directory into `data_dir/replaced-<stamp>/` (a rename on
    one disk: nothing is copied, nothing deleted); that folder."""
    aside = data_dir / f"replaced-{stamp}"
    aside.mkdir(mode=0o700)
    for name in names:
        (data_dir / name).rename(aside / name)
    return aside


def install(staging: Path, data_dir: Path, names: Sequence[str]) -> None:
    """Move the staged top-level `names` into the data directory (renames on one disk)."""
    for name in names:
        (staging / name).rename(data_dir / name)
    _sync_dir(data_dir)


def _sync_dir(path: Path) -> None:
    """The directory's entries durable (a rename survives a power cut)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def serving(data_dir: Path, what: str) -> Iterator[None]:
    """Held while a process serves from `data_dir` (shared: servers of one directory do
    not exclude each other); DataDirBusyError while a restore into it runs."""
    with _locked(data_dir, fcntl.LOCK_SH) as taken:
        if not taken:
            raise DataDirBusyError(
                f"a restore into {data_dir} is under way: start the {what} once it has finished"
            )
        yield


@contextlib.contextmanager
def restoring(data_dir: Path, running: str, doing: str = "restoring") -> Iterator[None]:
    """Held (alone) while a restore writes into `data_dir`; DataDirBusyError while a
    process serves from it (`running`: "a hub", say) or another restore runs."""
    with _locked(data_dir, fcntl.LOCK_EX) as taken:
        if not taken:
            raise DataDirBusyError(
                f"{running} is running on {data_dir} (it holds {data_dir / LOCK_FILE}), or a "
                f"restore into it: stop it before {doing}"
            )
        yield


@contextlib.contextmanager
def _locked(data_dir: Path, how: int) -> Iterator[bool]:
    data_dir.mkdir(parents=True, exist_ok=True)
    # The lock is flock(2) on an open file: the kernel drops it when the process ends,
    # however it ends, so a crashed server never leaves its data directory locked.
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in {errno.EWOULDBLOCK, errno.EAGAIN}:
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)  # and with it the lock
