"""Site bundles brought to a node (shared/site_bundle.py), through its admin API: uploaded in
pieces, resumable (as the hub's model uploads, after the tus protocol's core), checked
whole offline against the node's keyring, then applied as the hub's path applies the same
things: models registered and loaded (pinned), packages put into the cache (pinned), the
settings overlay kept as the desired settings and applied, and the release kept where a
fetched one is and installed by the updater, with the same boot-counting rollback.

An upload's bytes are `DATA/bundles/ID.part`, its state `DATA/bundles/ID.json`: an upload
cut off goes on from its offset, after a restart too. A bundle that fails a check, or a
model that is registered here under its name with another file, changes nothing, and the
upload says which part failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from appliance.packages.cache import CacheError
from appliance.serving.catalog import sha256_file
from appliance.state.records import ModelRecord
from appliance.state.store import now_iso
from shared import protocol
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

    from appliance.fleet.release import Updater
    from appliance.packages.service import PackageService
    from appliance.serving.registry import ModelRegistry
    from appliance.state.store import AsyncStore
    from shared import site_bundle

log = logging.getLogger(__name__)

State = Literal["open", "checking", "applying", "applied", "failed"]
_ID = re.compile(r"^bnd_[0-9a-f]{24}$")
_CHUNK = 1 << 20
SPARE_BYTES = 1 << 30  # an upload never fills the disk the node writes to
MAX_OPEN = 4  # uploads not yet complete at once


@dataclass(frozen=True)
class Upload:
    id: str
    size: int
    created_at: float
    state: State = "open"
    error: str | None = None
    part: str | None = None  # the part that failed
    signer: str | None = None
    applied: dict[str, list[str]] = field(default_factory=dict)  # by kind: what was applied
    # Where it came from: "upload" (the admin API), or "usb NAME" (a stick at the node,
    # image/usb_import.py), with the file's sha256 (a bundle applied once is not again).
    source: str = "upload"
    sha256: str | None = None


@dataclass
class Targets:
    """What a bundle's parts are applied to."""

    store: AsyncStore
    registry: ModelRegistry
    packages: PackageService
    updater: Updater | None
    models_dir: Path
    apply_settings: Callable[[], Awaitable[None]]


class Bundles:
    """The uploads of one node, in `folder`; bundles checked against `keyring`."""

    def __init__(self, folder: Path, keyring: Path, targets: Targets) -> None:
        self.folder = folder
        self.keyring = keyring
        self.targets = targets
        self._lock = asyncio.Lock()  # one piece appended, or one bundle applied, at a time
        # Whole uploads being checked and applied, and bundles' releases being installed:
        # held here while they run (the loop keeps only a weak reference to a task).
        self._tasks: set[asyncio.Task[object]] = set()

    # -- the uploads ------------------------------------------------------------------

    def uploads(self) -> list[Upload]:
        """Every upload the node keeps, the newest first."""
        return sorted(self._all(), key=lambda u: u.created_at, reverse=True)

    @property
    def inbox(self) -> Path:
        """Where the image leaves the bundles it finds on a USB stick (image/usb_import.py)."""
        return self.folder / "inbox"

    async def take_inbox(self) -> list[Upload]:
        """The bundles in the inbox, each checked and applied as an upload whole (in the
        background); one applied before (by its sha256) is removed, not applied again."""
        taken = []
        for path in await asyncio.to_thread(self._inbox_files):
            try:
                upload = await self._take(path)
            except OSError as err:
                log.warning("site bundle %s from the inbox: %s", path.name, err)
                continue
            if upload is not None:
                taken.append(upload)
        return taken

    async def watch_inbox(self, every_s: float = 5.0) -> None:
        """Take the inbox's bundles now and every `every_s` (a stick can come at any time)."""
        while True:
            try:
                await self.take_inbox()
            except Exception:  # a bug: logged, and the watch goes on
                log.exception("the site bundle inbox")
            await asyncio.sleep(every_s)

    def _inbox_files(self) -> list[Path]:
        if not self.inbox.is_dir():
            return []
        return sorted(
            p for p in self.inbox.glob("*.kvlbundle")
            if not p.name.startswith(".") and p.is_file() and not p.is_symlink()
        )  # fmt: skip

    async def _take(self, path: Path) -> Upload | None:
        digest = await asyncio.to_thread(sha256_file, path)
        if digest in await asyncio.to_thread(self._applied_digests):
            log.info("site bundle %s (sha256 %s) was applied before: removed", path.name,
                     digest[:12])  # fmt: skip
            await asyncio.to_thread(path.unlink)
            return None
        size = (await asyncio.to_thread(path.stat)).st_size
        async with self._lock:
            upload = Upload(
                id=f"bnd_{secrets.token_hex(12)}",
                size=size,
                created_at=time.time(),
                state="checking",
                source=f"usb {path.name[:200]}",
                sha256=digest,
            )
            await asyncio.to_thread(path.replace, self._part(upload.id))
            await asyncio.to_thread(self._save, upload)
        log.info("site bundle %s from a USB stick: checking it as %s", path.name, upload.id)
        self._background(self._import(upload))
        return upload

    def _applied_digests(self) -> set[str]:
        return {u.sha256 for u in self._all() if u.state == "applied" and u.sha256}

    def get(self, upload_id: str) -> Upload:
        if not _ID.match(upload_id):
            raise _not_found(upload_id)
        state = self.folder / f"{upload_id}.json"
        try:
            return Upload(**json.loads(state.read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise _not_found(upload_id) from err

    def offset(self, upload: Upload) -> int:
        part = self._part(upload.id)
        return part.stat().st_size if upload.state == "open" and part.exists() else 0

    def create(self, size: int) -> Upload:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        open_now = [u for u in self._all() if u.state == "open"]
        if len(open_now) >= MAX_OPEN:
            raise ApiError(
                ErrorCode.upload_closed,
                f"{MAX_OPEN} uploads are open already: finish or cancel one first",
            )
        room = shutil.disk_usage(self.folder).free - SPARE_BYTES
        # The upload, then its parts as they are checked: twice its size.
        if 2 * size > room:
            raise ApiError(
                ErrorCode.request_too_large,
                f"a bundle of {size} bytes needs twice that free on the data disk, and "
                f"{max(0, room)} is (a gigabyte kept spare)",
            )
        upload = Upload(id=f"bnd_{secrets.token_hex(12)}", size=size, created_at=time.time())
        self._part(upload.id).touch(mode=0o600)
        self._save(upload)
        return upload

    async def append(self, upload_id: str, offset: int, chunks: AsyncIterator[bytes]) -> Upload:
        """The next piece, at `offset`: appended where the upload stands, never past its
        size; the last piece checks the bundle and applies it."""
        async with self._lock:
            upload = await asyncio.to_thread(self.get, upload_id)
            if upload.state != "open":
                raise ApiError(ErrorCode.upload_closed, f"upload {upload_id} is {upload.state}")
            at = await asyncio.to_thread(self.offset, upload)
            if offset != at:
                raise ApiError(
                    ErrorCode.upload_offset_mismatch,
                    f"the upload stands at {at}, not {offset}: send from there",
                )
            part = self._part(upload_id)
            with part.open("ab") as f:
                async for chunk in chunks:
                    at += len(chunk)
                    if at > upload.size:
                        await asyncio.to_thread(f.truncate, at - len(chunk))
                        raise ApiError(
                            ErrorCode.invalid_value,
                            f"the piece goes past the upload's {upload.size} bytes",
                        )
                    await asyncio.to_thread(f.write, chunk)
            if at < upload.size:
                return upload
            # Whole: checked and applied in the background (minutes for a large model on a
            # small node: longer than a proxy waits for an answer); GET says how it went.
            upload = replace(upload, state="checking")
            await asyncio.to_thread(self._save, upload)
            self._background(self._import(upload))
            return upload

    async def resume(self, inbox_every_s: float | None = 5.0) -> None:
        """After a restart: a whole upload that was being checked is checked again; one that
        was being applied is failed, saying so (its parts may be in part applied). Then the
        inbox is watched (every `inbox_every_s`; None: not)."""
        for upload in await asyncio.to_thread(self._all):
            if upload.state == "checking" and self._part(upload.id).is_file():
                self._background(self._import(upload))
            elif upload.state in {"checking", "applying"}:
                await self._failed(upload, "the node stopped while it was applied", None)
        if inbox_every_s is not None:
            self._background(self.watch_inbox(inbox_every_s))

    def _background(self, work: Coroutine[object, object, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """What runs in the background cancelled (the appliance stops)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel(self, upload_id: str) -> None:
        async with self._lock:
            upload = await asyncio.to_thread(self.get, upload_id)
            if upload.state in {"checking", "applying"}:
                raise ApiError(ErrorCode.upload_closed, f"upload {upload_id} is {upload.state}")
            await asyncio.to_thread(self._remove, upload_id)

    def _all(self) -> list[Upload]:
        found = []
        for path in self.folder.glob("bnd_*.json"):
            with contextlib.suppress(ApiError):
                found.append(self.get(path.stem))
        return found

    def _part(self, upload_id: str) -> Path:
        return self.folder / f"{upload_id}.part"

    def _save(self, upload: Upload) -> None:
        path = self.folder / f"{upload.id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(upload)))
        tmp.replace(path)

    def _remove(self, upload_id: str) -> None:
        self._part(upload_id).unlink(missing_ok=True)
        (self.folder / f"{upload_id}.json").unlink(missing_ok=True)

    # -- checked, then applied --------------------------------------------------------------

    async def _import(self, upload: Upload) -> Upload:
        async with self._lock:
            try:
                return await self._check_and_apply(upload)
            except Exception as err:  # a bug: the upload says so, and the node goes on
                log.exception("site bundle %s", upload.id)
                return await self._failed(upload, f"the node failed to apply it: {err!r}", None)

    async def _check_and_apply(self, upload: Upload) -> Upload:
        # cryptography (14 MiB) with it: loaded when a bundle comes, not at every start.
        from shared import site_bundle  # noqa: PLC0415

        with tempfile.TemporaryDirectory(prefix=".staging-", dir=self.folder) as staging:
            try:
                keyring = await asyncio.to_thread(self.keyring.read_bytes)
            except OSError as err:
                return await self._failed(upload, f"this node has no keyring ({err})", None)
            try:
                verified = await asyncio.to_thread(
                    site_bundle.read, self._part(upload.id), Path(staging), keyring
                )
                await self._refuse_conflicts(verified)
            except site_bundle.BundleError as err:
                return await self._failed(upload, str(err), err.part)
            await asyncio.to_thread(self._part(upload.id).unlink)
            upload = replace(upload, state="applying", signer=verified.signer)
            await asyncio.to_thread(self._save, upload)
            log.info(
                "site bundle %s (signed by %s, made %s): %d part(s)",
                upload.id,
                verified.signer,
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(verified.manifest.created_at)),
                len(verified.manifest.parts),
            )
            try:
                applied = await self._apply(verified)
            except site_bundle.BundleError as err:
                return await self._failed(upload, str(err), err.part)
        upload = replace(upload, state="applied", applied=applied)
        await asyncio.to_thread(self._save, upload)
        return upload

    async def _failed(self, upload: Upload, error: str, part: str | None) -> Upload:
        log.warning("site bundle %s refused: %s", upload.id, error)
        self._part(upload.id).unlink(missing_ok=True)
        upload = replace(upload, state="failed", error=error[:2000], part=part)
        await asyncio.to_thread(self._save, upload)
        return upload

    async def _refuse_conflicts(self, verified: site_bundle.Verified) -> None:
        """What would make the bundle apply in part, refused before anything is applied."""
        from shared.site_bundle import BundleError  # noqa: PLC0415

        store = self.targets.store
        for part in verified.manifest.parts:
            if part.kind == "release" and self.targets.updater is None:
                raise BundleError("this node has no image updater", part.path)
            if part.kind != "model":
                continue
            name, version = _model_of(part)
            record = await store.run(store.sync.get_model, name, version)
            if record is not None and record.sha256 != part.sha256:
                raise BundleError(
                    f"{name}@{version} is registered here with another file "
                    f"({record.sha256[:12]}…): give the bundle's another version",
                    part.path,
                )

    async def _apply(self, verified: site_bundle.Verified) -> dict[str, list[str]]:
        from shared.site_bundle import BundleError  # noqa: PLC0415

        targets, store = self.targets, self.targets.store
        applied: dict[str, list[str]] = {}
        parts = verified.manifest.parts
        for part in (p for p in parts if p.kind == "package"):
            data = await asyncio.to_thread(verified.files[part.path].read_bytes)
            try:
                stored = await targets.packages.import_bundle(data, pinned=True)
            except CacheError as err:
                raise BundleError(f"not a package archive: {err}", part.path) from err
            applied.setdefault("package", []).append(stored.ref)
        for part in (p for p in parts if p.kind == "model"):
            name, version = _model_of(part)
            ref = f"{name}@{version}"
            if await store.run(store.sync.get_model, name, version) is None:
                targets.models_dir.mkdir(parents=True, exist_ok=True)
                path = targets.models_dir / f"{name}-{version}-{part.sha256[:12]}.gguf"
                await asyncio.to_thread(shutil.move, verified.files[part.path], path)
                record = ModelRecord(
                    name=name, version=version, format="gguf", path=str(path),
                    sha256=part.sha256, size_bytes=part.size, quantization=None,
                    source="bundle", added_at=now_iso(),
                )  # fmt: skip
                await store.run(store.sync.add_model, record)
            loaded = await targets.registry.load(ref, replicas=None, pinned=True)
            if loaded.state == "failed":
                log.warning("model %s of a site bundle failed to load: %s", ref, loaded.error)
            applied.setdefault("model", []).append(ref)
        settings = next((p for p in parts if p.kind == "settings"), None)
        if settings is not None:
            raw = await asyncio.to_thread(verified.files[settings.path].read_text)
            given = protocol.NodeSettings.model_validate_json(raw)
            await store.run(store.sync.set_meta, "desired_settings", given.model_dump_json())
            await targets.apply_settings()
            applied["settings"] = ["settings.json"]
        release = next((p for p in parts if p.kind == "release"), None)
        if release is not None and targets.updater is not None:
            assert release.version is not None  # noqa: S101 - validated
            target = protocol.ReleaseTarget(
                version=release.version, sha256=release.sha256, size_bytes=release.size
            )
            applied["release"] = [release.version]
            # Out of the staging folder (removed when this returns), then installed in the
            # background: the node reboots once it is written.
            kept = self.folder / f"{release.sha256}.raucb"
            await asyncio.to_thread(shutil.move, verified.files[release.path], kept)
            self._background(targets.updater.take_local(target, kept))
        return applied


def _model_of(part: site_bundle.Part) -> tuple[str, str]:
    """A model part's name and version (its manifest was refused without them)."""
    return part.name or "", part.version or ""


def _not_found(upload_id: str) -> ApiError:
    return ApiError(ErrorCode.not_found, f"no bundle upload {upload_id[:100]!r}")
