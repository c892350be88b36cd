"""Converging on the image release the hub gives this node (protocol 6): the bundle streamed
by the updater (appliance/update/installer.py, RAUC) from the hub through the tunnel, only
the blocks neither root slot holds (adaptive; appliance/update/stream.py), or, where that
fails, fetched whole into the data directory (resumable, bounded, its sha256 checked) and
installed from there; within the site's update window; the node rebooted into it, and the
new image marked good once it is up and has reached the hub again. What happened is kept in
the database (meta `image_update`), so it survives the reboot it leads to, and reported in
every heartbeat (`Capacity.image`).

The states, as the hub's rollouts read them: `downloading`, `installing`,
`installed-pending-reboot`; after the reboot `booted-trial` if the new slot booted, then
`good` once marked; `rolled-back` if the previous slot booted instead (the bootloader
gave up on the new one); `failed` when the fetch's check or the install failed. A failed
or rolled-back release is tried again after `update.retry_s`, not at once.

Without the updater (no `rauc`: a development machine) the node reports no image, and a
release given to it is refused with the reason in the heartbeat (`release_error`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.fleet.client import HubError
from appliance.fleet.downloads import DownloadError, fetch_checked
from appliance.update.installer import ERROR_CHARS, InstallerError, Rauc
from appliance.update.stream import BundleStream
from shared import protocol
from shared.supervise import Failures

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from appliance.fleet.client import HubClient
    from appliance.state.store import AsyncStore

log = logging.getLogger(__name__)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot's id (a reboot changes it): how the updater knows a reboot happened."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def image_version(os_release: Path) -> str | None:
    """`IMAGE_VERSION` of os-release(5), where the image states its version."""
    try:
        lines = os_release.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "IMAGE_VERSION":
            return value.strip().strip("\"'") or None
    return None


@dataclass(frozen=True)
class Record:
    """The last update, as kept across restarts and reboots."""

    target: str  # the release version
    sha256: str
    state: protocol.ImageState
    error: str | None = None
    at: float = 0.0  # when it reached this state
    boot_id: str = ""  # the boot it was installed in
    slot: str | None = None  # the slot it was installed into (its bootname)


class Updater:
    def __init__(
        self,
        store: AsyncStore,
        rauc: Rauc,
        updates_dir: Path,
        *,
        os_release: Path,
        reboot: Sequence[str] = (),
        retry_s: float = 600.0,
        streaming: bool = True,
        failures: Failures | None = None,
        clock: Callable[[], float] = time.time,
        boot: Callable[[], str] = boot_id,
    ) -> None:
        self._store = store
        self._rauc = rauc
        self._dir = updates_dir
        self._os_release = os_release
        self._reboot = tuple(reboot)
        self._retry_s = retry_s
        self._streaming = streaming
        self._failures = failures or Failures()
        self._clock = clock
        self._boot = boot
        self._task: asyncio.Task[None] | None = None
        self.image: protocol.ImageStatus | None = None  # for the heartbeat
        self.release_error: str | None = None

    def kick(self, client: HubClient) -> None:
        """Converge in the background (a download takes a while); one run at a time."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._guarded(client))

    async def _guarded(self, client: HubClient) -> None:
        with self._failures.guard("fleet.release"):
            await self.converge(client)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _record(self) -> Record | None:
        raw = await self._store.run(self._store.sync.meta, "image_update")
        if not raw:
            return None
        try:
            return Record(**json.loads(raw))
        except (ValueError, TypeError):
            return None  # written by another version: start again

    async def _save(self, record: Record) -> Record:
        error = record.error[:ERROR_CHARS] if record.error else None
        record = replace(record, at=self._clock(), error=error)
        await self._store.run(self._store.sync.set_meta, "image_update", json.dumps(asdict(record)))
        if self.image is not None:
            # Heartbeats during a download or an install (minutes) say so, not the state
            # the last refresh read before it began.
            self.image = self.image.model_copy(
                update={"state": record.state, "target": record.target[:200], "error": error}
            )
        return record

    async def _target(self) -> protocol.ReleaseTarget | None:
        raw = await self._store.run(self._store.sync.meta, "desired_release")
        if not raw or raw == "null":
            return None
        return protocol.ReleaseTarget.model_validate_json(raw)

    async def refresh(self) -> Record | None:
        """The updater read again: after a reboot, whether the new slot booted (on trial)
        or the previous one (rolled back); the heartbeat's image status. None without
        the updater."""
        if not self._rauc.available():
            self.image = None
            return None
        status = await asyncio.to_thread(self._rauc.status)
        booted = status.booted_slot
        running = (booted.version if booted else None) or image_version(self._os_release) or ""
        record = await self._record()
        if (
            record is not None
            and record.state in {"installed-pending-reboot", "booted-trial"}
            and record.boot_id != self._boot()
        ):
            if running == record.target:
                if record.state != "booted-trial":
                    log.info("booted into release %s, on trial", record.target)
                    record = await self._save(replace(record, state="booted-trial"))
            else:
                log.warning("release %s did not come up: rolled back", record.target)
                record = await self._save(
                    replace(record, state="rolled-back",
                            error=f"booted the previous image ({running or 'unknown'}) again")
                )  # fmt: skip
        self.image = protocol.ImageStatus(
            version=running[:200],
            slot=(booted.name if booted else "")[:200],
            state=record.state if record is not None else "idle",
            target=record.target[:200] if record is not None else None,
            error=record.error if record is not None else None,
        )
        return record

    async def converge(self, client: HubClient | None) -> None:
        """One step toward the release the hub gives, after a heartbeat went through; or,
        without a client, toward the one a site bundle gave (its file is here already:
        `take_local`), as a node without a hub starts, and once the bundle is imported."""
        target = await self._target()
        if not self._rauc.available():
            self.image = None
            self.release_error = (
                None
                if target is None
                else f"this node has no image updater (`{self._rauc.binary}` is not installed): "
                f"it cannot install release {target.version}"
            )
            return
        self.release_error = None
        try:
            record = await self.refresh()
        except InstallerError as err:
            # An updater that cannot say what runs here (not set up on this machine):
            # no image to report, and a release refused, saying why.
            self.image = None
            if target is not None:
                self.release_error = f"the image updater does not answer: {err}"[:ERROR_CHARS]
            log.debug("the image updater does not answer: %s", err)
            return
        if target is None or self.image is None:
            return
        if self.image.version == target.version:
            await self._settle(target, record)
        elif self._due(target, record) and _in_window(target.window, self._clock()):
            await self._update(client, target)
        try:
            await self.refresh()
        except InstallerError as err:
            # After an install the machine reboots, and RAUC's service stops with it: the
            # status read after is refused (it was a traceback in the log of every update).
            log.info("the image updater does not answer (the node is rebooting?): %s", err)

    async def _settle(self, target: protocol.ReleaseTarget, record: Record | None) -> None:
        """The node runs the release: marked good (it booted, and reached the hub)."""
        if record is not None and record.target == target.version and record.state == "good":
            return
        if record is not None and record.state == "booted-trial":
            try:
                await asyncio.to_thread(self._rauc.mark_good)
            except InstallerError as err:
                log.warning("marking release %s good: %s", target.version, err)
                return
            log.info("release %s marked good", target.version)
        await self._save(Record(target.version, target.sha256, "good", boot_id=self._boot()))

    def _due(self, target: protocol.ReleaseTarget, record: Record | None) -> bool:
        """Whether to fetch and install now: not while a reboot is awaited, nor a release
        that rolled back; a failed one only after `retry_s`."""
        if record is None or record.sha256 != target.sha256:
            return True
        if record.state == "installed-pending-reboot":
            return False
        if record.state == "rolled-back":
            # It booted and failed its health check: another try would reboot the site
            # into it again, every `retry_s`. A fixed release is a new one.
            return False
        if record.state == "failed":  # a download or an install: worth another try
            return self._clock() - record.at >= self._retry_s
        return True

    async def take_local(self, target: protocol.ReleaseTarget, bundle: Path) -> None:
        """A release a site bundle brought (its file checked against `target` already): kept
        where a fetched one is, made the release to run, and installed as one from the hub
        is (the same boot-counting rollback)."""
        await asyncio.to_thread(_drop_others, self._dir, target.sha256)
        await asyncio.to_thread(bundle.replace, self._dir / f"{target.sha256}.raucb")
        await self._store.run(
            self._store.sync.set_meta, "desired_release", target.model_dump_json()
        )
        await self.converge(None)

    async def _update(self, client: HubClient | None, target: protocol.ReleaseTarget) -> None:
        base = Record(target.version, target.sha256, "downloading")
        await self._save(base)
        await asyncio.to_thread(_drop_others, self._dir, target.sha256)
        partial = self._dir / f"{target.sha256}.raucb.part"
        bundle = self._dir / f"{target.sha256}.raucb"
        try:
            streamed = False
            if (
                client is not None
                and self._streaming
                and not await asyncio.to_thread(lambda: bundle.exists() or partial.exists())
            ):
                await self._save(replace(base, state="installing"))
                streamed = await self._stream(client, target)
            if not streamed:
                if not await asyncio.to_thread(bundle.exists):
                    await self._save(base)
                    log.info(
                        "fetching release %s (%d MiB)", target.version, target.size_bytes >> 20
                    )
                    await _fetch(client, target, partial)
                    await asyncio.to_thread(partial.replace, bundle)
                await self._save(replace(base, state="installing"))
                log.info("installing release %s", target.version)
                await asyncio.to_thread(self._rauc.install, bundle)
            status = await asyncio.to_thread(self._rauc.status)
        except HubError as err:
            # Kept to resume from at the next heartbeat: still downloading.
            await self._save(replace(base, error=str(err)))
            return
        except (DownloadError, InstallerError, OSError) as err:
            log.warning("release %s: %s", target.version, err)
            await self._save(replace(base, state="failed", error=str(err)))
            return
        await asyncio.to_thread(bundle.unlink, missing_ok=True)
        await self._save(
            replace(base, state="installed-pending-reboot", boot_id=self._boot(),
                    slot=status.primary)
        )  # fmt: skip
        log.info("release %s installed into %s", target.version, status.primary or "the other slot")
        if self._reboot:
            log.warning("rebooting into release %s", target.version)
            process = await asyncio.create_subprocess_exec(*self._reboot)
            await process.wait()

    async def _stream(self, client: HubClient, target: protocol.ReleaseTarget) -> bool:
        """The release installed by RAUC as it streams the bundle from the hub (adaptive:
        only the blocks neither slot holds are fetched); False, with the reason logged, when
        that failed, for the whole bundle to be fetched instead."""
        async with BundleStream(
            lambda start, end: client.artifact(target.sha256, start, end),
            sha256=target.sha256,
            size=target.size_bytes,
        ) as stream:
            log.info("installing release %s, streamed from the hub", target.version)
            try:
                await asyncio.to_thread(self._rauc.install, stream.url)
            except InstallerError as err:
                why = f"{err} ({stream.error})" if stream.error else str(err)
                log.warning(
                    "streaming release %s failed after %d MiB, fetching it whole: %s",
                    target.version, stream.fetched >> 20, why,
                )  # fmt: skip
                return False
        log.info(
            "release %s installed, streamed: %d of its %d MiB fetched in %d ranges",
            target.version, stream.fetched >> 20, target.size_bytes >> 20, stream.requests,
        )  # fmt: skip
        return True


async def _fetch(client: HubClient | None, target: protocol.ReleaseTarget, partial: Path) -> None:
    if client is None:  # a bundle's release whose file is gone: nothing to fetch it from
        raise DownloadError(f"the file of release {target.version} is not here")
    await fetch_checked(client, target.sha256, target.size_bytes, partial)


def _in_window(window: protocol.UpdateWindow | None, now: float) -> bool:
    if window is None:
        return True
    at = datetime.fromtimestamp(now, UTC)
    return window.holds(at.hour * 60 + at.minute)


def _drop_others(folder: Path, sha256: str) -> None:
    """Bundles of other releases, fetched before: gone (an image is gigabytes)."""
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        return
    for path in folder.iterdir():
        if not path.name.startswith(sha256):
            path.unlink(missing_ok=True)
