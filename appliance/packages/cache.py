"""The appliance's package cache: an OCI image layout on local disk.

Layout under ``root`` (image-spec ``image-layout.md``)::

    oci-layout              {"imageLayoutVersion":"1.0.0"}
    blobs/sha256/<hex>      every blob, named by its own digest
    index.json              an image index: one descriptor per package version (a ref)

A package version ("<id>@<version>") is an OCI artifact manifest: ``artifactType``
PACKAGE_ARTIFACT, the empty config, one layer per file titled by its path, ``manifest.json``
first. ``put()`` serialises ``manifest.json`` from the Manifest, so ``Manifest.files`` lists
every file *but* ``manifest.json`` (a file cannot hold its own digest) and ``files`` holds
exactly those paths. Pin and last use, which change, live in the index descriptor; id,
version, cache key and creation time are also in the manifest blob, which never changes.

API (each method takes one lock: worker threads may share an instance; one process owns a
directory). Errors: CacheError, and its CorruptBlobError and NotCachedError.

- ``put(manifest, files, cache_key)`` checks every file's sha256 and size, stores the
  package, then evicts, never the package just put. A version is immutable: the same ref
  with other content or another key raises CacheError; identical content writes nothing.
- ``by_key(key)`` the hit path: the newest package stored under ``key`` (marked used) or None.
- ``get(id, version=None, visible=None)`` a package, the newest version when None.
- ``list(query=, limit=, offset=, visible=None)`` newest first; ``query`` matches id,
  title or topic, ignoring case. ``visible``: only those (id, version) pairs (the ones the
  caller's account may see), for both.
- ``open_file(id, version, path)`` the FileEntry and blob path to serve (marked used). The
  blob is checked first and CorruptBlobError raised rather than a damaged or missing one
  served; it is hashed again only when its (size, mtime_ns) changed since it last passed.
- ``open_blob(id, version, path)`` the FileEntry and the blob opened for reading, checked
  like ``open_file`` but through the open descriptor, so the bytes served are the bytes
  checked. ``try_open_blob`` is the same but never blocks (for the event loop): it answers
  None when the lock is busy, the blob must be hashed, or the index is due to be written.
- ``pin(id, version, pinned)``; ``delete(id, version)``.
- ``bundle(id, version)`` the package as one OCI layout archive (shared.oci), and
  ``import_bundle(data)`` puts what such an archive holds: how the hub pre-seeds packages.
- ``take_removed()`` the refs evicted or deleted since it was last called.
- ``evict()`` removes least recently used unpinned packages until the distinct blobs total
  at most ``max_bytes`` (pinned ones stay even above it); returns the refs removed.
- ``total_bytes()`` the distinct blobs' bytes: a blob shared by packages counts once and
  is deleted with its last user. ``verify()`` re-hashes everything: refs with bad blobs.

Crash safety: every file is written to a temporary file, synced and renamed; blobs are
written before index.json names them and deleted after it stops, so a crash leaves at worst
unreferenced blobs, deleted at the next start. Use is written to the index at most once a
minute per package, so a crash forgets at most a minute of it. An unreadable index.json is
moved aside and, like a missing one, rebuilt from the manifest blobs (pins and last use are
lost; logged). An index entry whose manifest blob is missing or damaged is dropped (logged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from appliance.packages.model import FileEntry, Manifest
from shared import jsonlimits
from shared.files import write_private
from shared.oci import (
    CACHE_KEY,
    MANIFEST_PATH,
    PACKAGE_ARTIFACT,
    PKG_ID,
    PKG_VERSION,
    TITLE,
    LayoutError,
    package_layers,
    read_layout,
    write_layout,
)

if TYPE_CHECKING:
    import builtins
    from collections.abc import Callable, Collection, Iterable, Mapping
    from io import BufferedReader
    from pathlib import Path

log = logging.getLogger(__name__)

INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
PACKAGE_MANIFEST_TYPE = "application/vnd.kovenlab.package.manifest.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_HEX = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"  # sha256 of {}
REF_NAME = "org.opencontainers.image.ref.name"
CREATED = "org.opencontainers.image.created"
PINNED = "dev.kovenlab.pinned"
LAST_USED = "dev.kovenlab.last-used"
_TOUCH_PERSIST_S = 60.0
_MAX_MANIFEST = 4 << 20  # bytes; a rebuild skips bigger blobs unread


class CacheError(Exception):
    """The cache refused an operation or found its store damaged."""


class CorruptBlobError(CacheError):
    """A blob is missing or does not match its digest; it is never served."""


class NotCachedError(CacheError):
    """No such package, version or file in the cache."""


@dataclass(frozen=True)
class CachedPackage:
    id: str
    version: str
    cache_key: str
    manifest: Manifest
    pinned: bool
    last_used: datetime
    size: int  # bytes of its distinct blobs, OCI manifest and config included
    created: datetime  # Manifest.created_at
    digest: str  # of its OCI manifest blob, "sha256:<hex>"

    @property
    def ref(self) -> str:
        return f"{self.id}@{self.version}"


@dataclass
class _Entry:
    manifest: Manifest
    digest: str  # hex of the OCI manifest blob
    oci: dict[str, Any]  # that blob, parsed
    size: int  # of that blob
    pinned: bool
    last_used: float
    persisted_used: float = -1.0
    files: dict[str, FileEntry] = field(init=False)  # by path, manifest.json included
    created: datetime = field(init=False)

    def __post_init__(self) -> None:
        self.files = _files(self.oci)
        self.created = _parse_time(self.manifest.created_at)

    @property
    def ref(self) -> str:
        return f"{self.manifest.id}@{self.manifest.version}"

    @property
    def cache_key(self) -> str:
        return str(self.oci["annotations"][CACHE_KEY])

    def blobs(self) -> dict[str, int]:
        sizes = {f.sha256: f.size for f in self.files.values()}
        return sizes | {self.digest: self.size, EMPTY_HEX: 2}


class PackageCache:
    def __init__(
        self, root: Path, *, max_bytes: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.root, self.max_bytes, self._clock = root, max_bytes, clock
        self._blob_dir = blob_dir(root)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._verified: dict[str, tuple[int, int]] = {}  # hex -> (size, mtime_ns) hashed ok
        self._removed: builtins.list[str] = []  # refs evicted or deleted, not yet taken
        self._blob_dir.mkdir(parents=True, exist_ok=True)
        if not (root / "oci-layout").exists():
            write_private(root / "oci-layout", _canonical({"imageLayoutVersion": "1.0.0"}))
        with self._lock:
            self._load()

    def put(self, manifest: Manifest, files: Mapping[str, bytes], cache_key: str) -> CachedPackage:
        expected = {f.path: f for f in manifest.files}
        if MANIFEST_PATH in expected or len(expected) != len(manifest.files):
            raise CacheError("manifest.files must not list manifest.json, nor a path twice")
        if set(files) != set(expected):
            raise CacheError(f"files differ from manifest.files: {set(files) ^ set(expected)}")
        for path, data in files.items():
            if len(data) != expected[path].size or _sha256(data) != expected[path].sha256:
                raise CacheError(f"{path}: content does not match its sha256 and size")
        try:
            _parse_time(manifest.created_at)
        except ValueError as err:
            raise CacheError(f"created_at is not ISO 8601: {manifest.created_at!r}") from err
        body = manifest.model_dump_json().encode()
        own = FileEntry(
            path=MANIFEST_PATH,
            sha256=_sha256(body),
            size=len(body),
            media_type=PACKAGE_MANIFEST_TYPE,
        )
        layers = [
            _descriptor(f.media_type, f.sha256, f.size, annotations={TITLE: f.path})
            for f in [own, *manifest.files]
        ]
        about = {PKG_ID: manifest.id, PKG_VERSION: manifest.version, CACHE_KEY: cache_key}
        oci = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": PACKAGE_ARTIFACT,
            "config": _descriptor(EMPTY_TYPE, EMPTY_HEX, 2),
            "layers": layers,
            "annotations": about | {CREATED: manifest.created_at},
        }
        raw = _canonical(oci)
        digest, ref = _sha256(raw), f"{manifest.id}@{manifest.version}"
        with self._lock:
            if (existing := self._entries.get(ref)) is None:
                blobs = {own.sha256: body, EMPTY_HEX: b"{}"}
                blobs |= {expected[p].sha256: data for p, data in files.items()}
                for hex_digest, data in [*blobs.items(), (digest, raw)]:  # the manifest last
                    if not self._blob_ok(hex_digest):  # absent, or damaged and now repaired
                        # Owner-only: the appliance serves blobs, or lets the TLS front
                        # send one it decided on (made readable to its workers then).
                        write_private(self._blob_dir / hex_digest, data)
                self._entries[ref] = _Entry(
                    manifest, digest, oci, len(raw), pinned=False, last_used=self._clock()
                )
                self._save()
            elif existing.digest != digest:
                raise CacheError(f"{ref} is cached with other content; versions are immutable")
            self._evict(keep=ref)
            return self._public(self._entries[ref])

    def by_key(self, cache_key: str) -> CachedPackage | None:
        with self._lock:
            hits = [e for e in self._entries.values() if e.cache_key == cache_key]
            if not hits:
                return None
            entry = max(hits, key=_newest)
            self._touch(entry)
            return self._public(entry)

    def get(
        self,
        package_id: str,
        version: str | None = None,
        *,
        visible: Collection[tuple[str, str]] | None = None,
    ) -> CachedPackage:
        """A package; `visible` (None: all): only these (id, version), the newest of them
        when `version` is None (NotCachedError for the others, as if not cached)."""
        with self._lock:
            if visible is None:
                return self._public(self._find(package_id, version))
            mine = [
                e
                for e in self._entries.values()
                if e.manifest.id == package_id
                and (e.manifest.id, e.manifest.version) in visible
                and version in {None, e.manifest.version}
            ]
            if not mine:
                raise NotCachedError(f"package {package_id!r} is not cached")
            return self._public(max(mine, key=_newest))

    def list(
        self,
        *,
        query: str | None = None,
        limit: int = 50,
        offset: int = 0,
        visible: Collection[tuple[str, str]] | None = None,
    ) -> builtins.list[CachedPackage]:
        """Newest first; `visible` (None: all): only these (id, version)."""
        if limit < 0 or offset < 0:
            raise ValueError("limit and offset must not be negative")
        needle = (query or "").casefold()
        with self._lock:
            found = [
                e
                for e in self._entries.values()
                if needle in f"{e.manifest.id}\n{e.manifest.title}\n{e.manifest.topic}".casefold()
                and (visible is None or (e.manifest.id, e.manifest.version) in visible)
            ]
            found.sort(key=_newest, reverse=True)
            return [self._public(e) for e in found[offset : offset + limit]]

    def open_file(self, package_id: str, version: str | None, path: str) -> tuple[FileEntry, Path]:
        with self._lock:
            entry = self._find(package_id, version)
            if (file := entry.files.get(path)) is None:
                raise NotCachedError(f"{entry.ref} has no file {path!r}")
            if not self._blob_ok(file.sha256):
                raise CorruptBlobError(f"{entry.ref}: the blob of {path!r} is missing or corrupt")
            self._touch(entry)
            return file, self._blob_dir / file.sha256

    def open_blob(
        self, package_id: str, version: str | None, path: str
    ) -> tuple[FileEntry, BufferedReader]:
        opened = self._open_blob(package_id, version, path, wait=True)
        if opened is None:  # waiting, it answers or raises
            raise CacheError(f"{package_id}: {path!r} could not be opened")
        return opened

    def try_open_blob(
        self, package_id: str, version: str | None, path: str
    ) -> tuple[FileEntry, BufferedReader] | None:
        return self._open_blob(package_id, version, path, wait=False)

    def _open_blob(
        self, package_id: str, version: str | None, path: str, *, wait: bool
    ) -> tuple[FileEntry, BufferedReader] | None:
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            entry = self._find(package_id, version)
            if (file := entry.files.get(path)) is None:
                raise NotCachedError(f"{entry.ref} has no file {path!r}")
            if not wait and self._touch_due(entry):
                return None
            try:
                blob = (self._blob_dir / file.sha256).open("rb")
            except FileNotFoundError as err:
                raise CorruptBlobError(f"{entry.ref}: the blob of {path!r} is missing") from err
            try:
                ok = self._open_blob_ok(file.sha256, blob, hash_it=wait)
            except BaseException:
                blob.close()
                raise
            if not ok:
                blob.close()
                if ok is None:
                    return None
                raise CorruptBlobError(f"{entry.ref}: the blob of {path!r} is corrupt")
            self._touch(entry)
            return file, blob
        finally:
            self._lock.release()

    def pin(self, package_id: str, version: str, pinned: bool) -> CachedPackage:
        with self._lock:
            entry = self._find(package_id, version)
            if entry.pinned != pinned:
                entry.pinned = pinned
                self._save()
            return self._public(entry)

    def bundle(self, package_id: str, version: str | None = None) -> bytes:
        """The package version as one OCI layout archive (shared.oci), every blob checked."""
        with self._lock:
            entry = self._find(package_id, version)
            blobs = {}
            for hex_digest in entry.blobs():
                if not self._blob_ok(hex_digest):
                    raise CorruptBlobError(f"{entry.ref}: blob {hex_digest[:12]} is corrupt")
                blobs[hex_digest] = (self._blob_dir / hex_digest).read_bytes()
            descriptor = _descriptor(
                MANIFEST_TYPE,
                entry.digest,
                entry.size,
                artifactType=PACKAGE_ARTIFACT,
                annotations=entry.oci["annotations"] | {REF_NAME: entry.ref},
            )
        return write_layout({"schemaVersion": 2, "mediaType": INDEX_TYPE,
                             "manifests": [descriptor]}, blobs)  # fmt: skip

    def import_bundle(self, data: bytes) -> CachedPackage:
        """Put the package an archive from ``bundle()`` holds (CacheError when it is not
        one, or its files do not match its manifest). The archive is a peer's (the hub
        seeds it): read_layout has checked the shape of its every JSON document, and
        whatever else is off is a CacheError here, never an exception of another kind."""
        try:
            layout = read_layout(data, max_bytes=max(self.max_bytes, 1 << 20))
            if len(layout.manifests) != 1:
                raise CacheError("a package archive holds exactly one package")
            oci = layout.manifest(layout.manifests[0])
            if oci.artifactType != PACKAGE_ARTIFACT:
                raise CacheError("the archive's manifest is not a content package")
            layers = package_layers(oci)
            # Depth-limited like every JSON of the layout, then read as the Manifest.
            layout.json_blob(layers[MANIFEST_PATH])
            files = {path: layout.blobs[layer.hex] for path, layer in layers.items()}
            manifest = Manifest.model_validate_json(files.pop(MANIFEST_PATH))
            cache_key = oci.annotations[CACHE_KEY]
        except LayoutError as err:
            raise CacheError(f"not a package archive: {err}") from err
        except KeyError as err:
            raise CacheError(f"not a package archive: no {err}") from err
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise CacheError(f"{MANIFEST_PATH}: {where:.200}: {first['msg']}") from err
        return self.put(manifest, files, cache_key)

    def take_removed(self) -> builtins.list[str]:
        """The refs evicted or deleted since the last call (to tell the hub)."""
        with self._lock:
            removed, self._removed = self._removed, []
            return removed

    def delete(self, package_id: str, version: str) -> None:
        with self._lock:
            ref = self._find(package_id, version).ref
            del self._entries[ref]
            self._removed.append(ref)
            self._save()
            self._collect()

    def evict(self) -> builtins.list[str]:
        with self._lock:
            return self._evict(keep=None)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(_distinct(self._entries.values()).values())

    def verify(self) -> builtins.list[str]:
        with self._lock:
            self._verified.clear()
            return [e.ref for e in self._entries.values() if not all(map(self._blob_ok, e.blobs()))]

    # Internals: the lock is held.

    def _find(self, package_id: str, version: str | None) -> _Entry:
        if version is not None:
            if (entry := self._entries.get(f"{package_id}@{version}")) is None:
                raise NotCachedError(f"{package_id}@{version} is not cached")
            return entry
        versions = [e for e in self._entries.values() if e.manifest.id == package_id]
        if not versions:
            raise NotCachedError(f"{package_id} is not cached")
        return max(versions, key=_newest)

    def _public(self, e: _Entry) -> CachedPackage:
        return CachedPackage(
            id=e.manifest.id,
            version=e.manifest.version,
            cache_key=e.cache_key,
            manifest=e.manifest,
            pinned=e.pinned,
            last_used=datetime.fromtimestamp(e.last_used, UTC),
            size=sum(e.blobs().values()),
            created=e.created,
            digest=f"sha256:{e.digest}",
        )

    def _touch(self, entry: _Entry) -> None:
        entry.last_used = self._clock()
        if abs(entry.last_used - entry.persisted_used) >= _TOUCH_PERSIST_S:
            self._save()

    def _touch_due(self, entry: _Entry) -> bool:
        """Whether marking the entry used now would write the index."""
        return abs(self._clock() - entry.persisted_used) >= _TOUCH_PERSIST_S

    def _evict(self, keep: str | None) -> builtins.list[str]:
        refs = Counter(h for e in self._entries.values() for h in e.blobs())
        sizes = _distinct(self._entries.values())
        total = sum(sizes.values())
        candidates = sorted(
            (e for e in self._entries.values() if not e.pinned and e.ref != keep),
            key=lambda e: (e.last_used, *_newest(e)),
        )
        evicted = []
        for entry in candidates:
            if total <= self.max_bytes:
                break
            evicted.append(entry.ref)
            del self._entries[entry.ref]
            for hex_digest in entry.blobs():
                refs[hex_digest] -= 1
                total -= sizes[hex_digest] if refs[hex_digest] == 0 else 0
        if evicted:
            self._removed.extend(evicted)
            log.info("evicted %s to stay within %d bytes", evicted, self.max_bytes)
            self._save()
            self._collect()
        return evicted

    def _blob_ok(self, hex_digest: str) -> bool:
        path = self._blob_dir / hex_digest
        try:
            stat = path.stat()
            seen = (stat.st_size, stat.st_mtime_ns)
            if self._verified.get(hex_digest) != seen:
                with path.open("rb") as blob:
                    if hashlib.file_digest(blob, "sha256").hexdigest() != hex_digest:
                        return False
                self._verified[hex_digest] = seen
        except FileNotFoundError:
            return False
        return True

    def _open_blob_ok(self, hex_digest: str, blob: BufferedReader, *, hash_it: bool) -> bool | None:
        """Whether the open blob is good: known good by its (size, mtime_ns), else hashed
        through the descriptor when ``hash_it`` (None when it would have to be)."""
        stat = os.fstat(blob.fileno())
        seen = (stat.st_size, stat.st_mtime_ns)
        if self._verified.get(hex_digest) == seen:
            return True
        if not hash_it:
            return None
        good = hashlib.file_digest(blob, "sha256").hexdigest() == hex_digest
        blob.seek(0)
        if good:
            self._verified[hex_digest] = seen
        return good

    def _save(self) -> None:
        manifests = []
        for e in sorted(self._entries.values(), key=lambda e: e.ref):
            annotations = e.oci["annotations"] | {
                REF_NAME: e.ref,
                PINNED: "true" if e.pinned else "false",
                LAST_USED: datetime.fromtimestamp(e.last_used, UTC).isoformat(),
            }
            extra = {"artifactType": PACKAGE_ARTIFACT, "annotations": annotations}
            manifests.append(_descriptor(MANIFEST_TYPE, e.digest, e.size, **extra))
            e.persisted_used = e.last_used
        index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": manifests}
        write_private(self.root / "index.json", _canonical(index))

    def _collect(self) -> None:
        """Delete blobs no entry references, and temporary files a crash left behind."""
        live = _distinct(self._entries.values())
        for path in self._blob_dir.iterdir():
            if path.name not in live:
                path.unlink(missing_ok=True)
                self._verified.pop(path.name, None)

    def _load(self) -> None:
        index = self.root / "index.json"
        try:
            descriptors = [
                (d["digest"].removeprefix("sha256:"), d["annotations"])
                for d in jsonlimits.loads(index.read_bytes())["manifests"]
            ]
        except FileNotFoundError:
            descriptors = None
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            aside = index.with_name(f"index.json.corrupt-{int(self._clock())}")
            index.replace(aside)
            log.warning("index.json is unreadable (%s), moved to %s", err, aside.name)
            descriptors = None
        if descriptors is None and (blobs := [p.name for p in self._blob_dir.iterdir()]):
            log.warning("rebuilding index.json from %d blobs; pins are lost", len(blobs))
            descriptors = [(name, {}) for name in blobs]
        for leftover in self.root.glob(".index.json.*.tmp"):  # an index write a crash cut short
            leftover.unlink()
        for hex_digest, notes in descriptors or []:
            if (entry := self._read_entry(hex_digest, notes)) is not None:
                self._entries[entry.ref] = entry
            elif notes:
                log.warning("dropped %s: its manifest is missing or damaged", notes.get(REF_NAME))
        self._save()
        self._collect()

    def _read_entry(self, hex_digest: str, notes: dict[str, str]) -> _Entry | None:
        path = self._blob_dir / hex_digest
        try:
            if path.stat().st_size > _MAX_MANIFEST or not self._blob_ok(hex_digest):
                return None
            raw = path.read_bytes()
            oci = jsonlimits.loads(raw) if raw[:1] == b"{" else {}
            if oci.get("artifactType") != PACKAGE_ARTIFACT:
                return None
            own = _files(oci)[MANIFEST_PATH]
            if not self._blob_ok(own.sha256):
                return None
            manifest = Manifest.model_validate_json((self._blob_dir / own.sha256).read_bytes())
            used = _parse_time(notes[LAST_USED]).timestamp() if LAST_USED in notes else None
            entry = _Entry(manifest, hex_digest, oci, len(raw), notes.get(PINNED) == "true", 0.0)
            entry.last_used = entry.persisted_used = self._clock() if used is None else used
            _ = entry.cache_key  # must be there
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError):
            return None
        return entry


def blob_dir(root: Path) -> Path:
    """The folder of a cache's blobs, each named by its sha256 (the TLS front sends them)."""
    return root / "blobs" / "sha256"


def _files(oci: dict[str, Any]) -> dict[str, FileEntry]:
    """The package's files by path, manifest.json included, from its OCI manifest."""
    return {
        layer["annotations"][TITLE]: FileEntry(
            path=layer["annotations"][TITLE],
            sha256=layer["digest"].removeprefix("sha256:"),
            size=layer["size"],
            media_type=layer["mediaType"],
        )
        for layer in oci["layers"]
    }


def _newest(e: _Entry) -> tuple[datetime, str]:
    return e.created, e.ref


def _descriptor(media_type: str, hex_digest: str, size: int, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": f"sha256:{hex_digest}", "size": size, **extra}


def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _parse_time(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)  # naive means UTC


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _distinct(entries: Iterable[_Entry]) -> dict[str, int]:
    """Each blob any entry references, with its size, counted once."""
    sizes: dict[str, int] = {}
    for entry in entries:
        sizes |= entry.blobs()
    return sizes
