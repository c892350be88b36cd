"""Converging on the hub's placements: the models its desired state places on this node
are fetched, checked, registered, loaded and pinned; the ones it no longer places are
unpinned and unloaded. The content packages it seeds here are fetched as OCI layout
archives, put into the package cache and pinned; unseeded, they are unpinned.

A model file comes from the hub through the tunnel (`GET /v1/node/artifacts/SHA256`)
into the models folder: a cut download resumes where it stopped (HTTP Range), and a file
whose sha256 is not the one placed is deleted, never registered. A file this node holds
already (the same sha256 under another name) is used as it is. Loading goes through the
model registry, so the memory budget holds; a model that cannot load is retried at the
next heartbeat and named in the heartbeat (`placement_errors`), and the hub sees what
serves in the heartbeat's `models`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from pydantic import ValidationError

from appliance.fleet.client import HubError
from appliance.fleet.downloads import CHUNK, DownloadError, fetch_checked, fetch_checked_from
from appliance.packages.cache import CacheError
from appliance.serving.engine import NotLoadedError, QueueFullError
from appliance.serving.evaluation import evaluate
from appliance.serving.registry import (
    InsufficientMemoryError,
    ModelNotReadyError,
    ModelPinnedError,
    UnknownModelError,
)
from appliance.serving.supervisor import WorkerUnavailableError
from appliance.state.records import ModelRecord
from appliance.state.store import now_iso
from shared import protocol
from shared.peer_tickets import PEER_ARTIFACTS, PEER_TICKET_HEADER
from shared.supervise import Failures

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from appliance.fleet.client import HubClient
    from appliance.packages.service import PackageService
    from appliance.serving.registry import ModelRegistry
    from appliance.state.store import AsyncStore

log = logging.getLogger(__name__)

MAX_BUNDLE = 1 << 30  # bytes: a package archive is held in memory while it is checked
REFUSALS = (UnknownModelError, ModelNotReadyError, InsufficientMemoryError, ModelPinnedError)


@dataclass(frozen=True)
class _File:
    """A model file fetched from a peer: its digest and size, where it goes, the ticket."""

    sha256: str
    size: int
    partial: Path
    ticket: str


def _peers(model: dict[str, Any]) -> list[protocol.ModelPeer]:
    """The peers of a placed model as kept from the desired state (checked when it came)."""
    raw = model.get("peers")
    if not isinstance(raw, list):
        return []
    peers = []
    for entry in raw:
        with contextlib.suppress(ValidationError):
            peers.append(protocol.ModelPeer.model_validate(entry))
    return peers


def _hhmm(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


class PlacementError(Exception):
    """A placed model could not be fetched or loaded; retried at the next heartbeat."""


class Converger:
    def __init__(
        self,
        store: AsyncStore,
        registry: ModelRegistry,
        models_dir: Path,
        packages: PackageService | None = None,
        *,
        failures: Failures | None = None,
        evaluate: bool = True,
        clock: Callable[[], float] = time.time,
        peer_wait_s: float = 600.0,
        trust_file: Path | None = None,
    ) -> None:
        self._evaluate = evaluate
        # Fetching from the site's peers (protocol 10): how long to wait for the one that
        # fetches a file from the hub first, since when each file was waited for, and the
        # fleet's CA bundle, which a peer's LAN certificate chains to.
        self._peer_wait_s = peer_wait_s
        self._waiting_since: dict[str, float] = {}
        self._trust_file = trust_file
        self.fetching: set[str] = set()  # sha256 of the files being fetched now
        self._clock = clock
        # ref → the evaluation of the model placed here under its current preset (heartbeats
        # carry them); kept in the store, so a restart does not evaluate again.
        self.evaluations: dict[str, protocol.Evaluation] = {}
        self._evaluated: dict[str, str] = {}  # ref → the preset it was evaluated under
        self._evaluating: asyncio.Task[None] | None = None
        self._packages = packages
        self._failures = failures or Failures()
        self._store = store
        self._registry = registry
        self._models_dir = models_dir
        self.errors: dict[str, str] = {}  # ref -> why it is not serving yet
        self._task: asyncio.Task[None] | None = None

    def kick(self, client: HubClient) -> None:
        """Converge in the background (downloads take a while); one run at a time."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._guarded(client))

    async def _guarded(self, client: HubClient) -> None:
        with self._failures.guard("fleet.placement"):
            await self.converge(client)

    async def close(self) -> None:
        for task in (self._task, self._evaluating):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def converge(self, client: HubClient) -> None:
        errors = await self._models(client)
        if self._packages is not None:
            errors |= await self._seed(client, self._packages)
        self.errors = errors
        if self._evaluate and (self._evaluating is None or self._evaluating.done()):
            self._evaluating = asyncio.get_running_loop().create_task(self._evaluations())

    async def _evaluations(self) -> None:
        with self._failures.guard("fleet.evaluation"):
            await self._evaluate_placed()

    async def _evaluate_placed(self) -> None:
        """Evaluate each placed model that serves and has no evaluation under its preset
        (one at a time, in the background: a real model takes a while); forget those no
        longer placed. A failed evaluation is tried again after the next heartbeat."""
        store = self._store
        if not self._evaluated:
            stored = await store.run(store.sync.meta, "placed_evaluations")
            kept = json.loads(stored or "{}")
            for ref, entry in kept.items():
                with contextlib.suppress(ValidationError, KeyError, TypeError):
                    self.evaluations[ref] = protocol.Evaluation.model_validate(entry["score"])
                    self._evaluated[ref] = str(entry["preset"])
        raw = await store.run(store.sync.meta, "placed_models")
        placed = set(json.loads(raw or "[]"))
        for ref in set(self.evaluations) - placed:
            self.evaluations.pop(ref, None)
            self._evaluated.pop(ref, None)
        for deployment in self._registry.loaded_models():
            ref = deployment.record.ref
            preset = "" if deployment.preset is None else deployment.preset.model_dump_json()
            if ref not in placed or deployment.state != "ready":
                continue
            if self._evaluated.get(ref) == preset and ref in self.evaluations:
                continue
            try:
                score = await evaluate(deployment)
            except (*REFUSALS, QueueFullError, NotLoadedError, WorkerUnavailableError) as err:
                log.warning("evaluating %s: %s (tried again later)", ref, err)
                continue
            log.info(
                "%s followed %d of %d instructions (loaded in %.1f s, %d MiB)",
                ref, score.followed, score.total, score.load_s, score.memory_mib,
            )  # fmt: skip
            self.evaluations[ref], self._evaluated[ref] = score, preset
        kept = {
            ref: {"score": self.evaluations[ref].model_dump(), "preset": self._evaluated[ref]}
            for ref in self.evaluations
        }
        await store.run(store.sync.set_meta, "placed_evaluations", json.dumps(kept))

    async def _models(self, client: HubClient) -> dict[str, str]:
        raw = await self._store.run(self._store.sync.meta, "desired_models")
        if raw is None:
            return {}  # the hub has placed nothing here, ever
        desired: list[dict[str, Any]] = json.loads(raw)
        placed = await self._store.run(self._store.sync.meta, "placed_models")
        before = set(json.loads(placed or "[]"))
        wanted: list[str] = []
        errors: dict[str, str] = {}
        # Set before loading: each placed model loads with its own (a changed one reloads).
        self._registry.presets.set_desired(raw)
        for model in desired:
            ref = f"{model['name']}@{model['version']}"
            wanted.append(ref)
            try:
                await self._ensure(client, model)
                served = {r.ref for r in self._registry.served()}
                if ref not in served:
                    log.info("loading %s, placed here by the hub", ref)
                await self._registry.load(ref, replicas=None, pinned=True)
            except (PlacementError, HubError, OSError, *REFUSALS) as err:
                errors[ref] = str(err)
                log.warning("placed model %s: %s", ref, err)
        for ref in sorted(before - set(wanted)):
            try:
                await self._registry.release(ref)
                log.info("released %s: the hub placed it elsewhere", ref)
            except REFUSALS as err:  # already gone
                log.info("%s stays: %s", ref, err)
        await self._store.run(self._store.sync.set_meta, "placed_models", json.dumps(wanted))
        return errors

    async def _seed(self, client: HubClient, packages: PackageService) -> dict[str, str]:
        """The packages the hub seeds here: fetched as archives (their sha256 checked),
        put into the cache and pinned; the ones it no longer seeds are unpinned, left to
        the cache's eviction."""
        raw = await self._store.run(self._store.sync.meta, "desired_packages")
        if raw is None:
            return {}
        desired: list[dict[str, Any]] = json.loads(raw)
        seeded = await self._store.run(self._store.sync.meta, "seeded_packages")
        before = set(json.loads(seeded or "[]"))
        errors: dict[str, str] = {}
        wanted: list[str] = []
        for package in desired:
            package_id, version = str(package["id"]), str(package["version"])
            ref = f"{package_id}@{version}"
            wanted.append(ref)
            if await packages.pin(package_id, version, pinned=True):
                continue  # held already
            try:
                data = await self._fetch_bundle(client, package)
                stored = await packages.import_bundle(data, pinned=True)
                log.info("package %s seeded by the hub", stored.ref)
            except (PlacementError, HubError, CacheError, OSError) as err:
                errors[ref] = str(err)
                log.warning("seeded package %s: %s", ref, err)
        for ref in sorted(before - set(wanted)):
            package_id, _, version = ref.partition("@")
            if await packages.pin(package_id, version, pinned=False):
                log.info("package %s no longer seeded: unpinned", ref)
        await self._store.run(self._store.sync.set_meta, "seeded_packages", json.dumps(wanted))
        return errors

    async def _fetch_bundle(self, client: HubClient, package: dict[str, Any]) -> bytes:
        sha256, size = str(package["sha256"]), int(package["size"])
        if size > MAX_BUNDLE:
            raise PlacementError(f"the package archive is {size} bytes, above {MAX_BUNDLE}")
        response = await client.artifact(sha256)
        try:
            if response.status != 200:
                raise PlacementError(f"the hub answered {response.status} for the package")
            data = bytearray()
            async for chunk in response.content.iter_chunked(CHUNK):
                data += chunk
                if len(data) > size:
                    raise PlacementError(f"the package archive is larger than {size} bytes")
        finally:
            response.release()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise PlacementError(f"the package archive's sha256 is not {sha256}")
        return bytes(data)

    async def _ensure(self, client: HubClient, model: dict[str, Any]) -> None:
        """The model registered here, its file fetched and checked if need be."""
        store = self._store
        name, version, sha256 = str(model["name"]), str(model["version"]), str(model["sha256"])
        record = await store.run(store.sync.get_model, name, version)
        if record is not None:
            if record.sha256 != sha256:
                raise PlacementError(
                    f"{name}@{version} is registered here with another sha256 ({record.sha256})"
                )
            return
        same = await store.run(store.sync.model_by_sha256, sha256)
        if same is None:
            await self._within_window()
        path = same.path if same is not None else str(await self._fetch(client, model))
        await store.run(
            store.sync.add_model,
            ModelRecord(
                name=name,
                version=version,
                format=str(model.get("format") or "gguf"),
                path=path,
                sha256=sha256,
                size_bytes=int(model["size_bytes"]),
                quantization=None,
                source="hub",
                added_at=now_iso(),
            ),
        )

    async def _within_window(self) -> None:
        """A model file is fetched within the site's update window (as a release is): a
        site's link carries it when the site lets it (a school's nights, say)."""
        raw = await self._store.run(self._store.sync.meta, "desired_window")
        if not raw or raw == "null":
            return
        window = protocol.UpdateWindow.model_validate_json(raw)
        at = datetime.fromtimestamp(self._clock(), UTC)
        if not window.holds(at.hour * 60 + at.minute):
            raise PlacementError(
                f"waiting for the site's update window ({_hhmm(window.start_min)} to "
                f"{_hhmm(window.end_min)} UTC) to fetch the model file"
            )

    async def _fetch(self, client: HubClient, model: dict[str, Any]) -> Path:
        sha256, size = str(model["sha256"]), int(model["size_bytes"])
        target = self._models_dir / f"{model['name']}-{model['version']}-{sha256[:12]}.gguf"
        partial = target.with_name(target.name + ".part")
        ref = f"{model['name']}@{model['version']}"
        self.fetching.add(sha256)
        try:
            peers = _peers(model)
            ticket = model.get("ticket")
            if peers and isinstance(ticket, str):
                wait = await self._from_peers(peers, _File(sha256, size, partial, ticket))
                if wait is None:
                    self._waiting_since.pop(sha256, None)
                    partial.replace(target)
                    return target
                since = self._waiting_since.setdefault(sha256, self._clock())
                if wait and self._clock() - since < self._peer_wait_s:
                    raise PlacementError(
                        f"waiting for node {wait} of this site, which fetches the file "
                        "from the hub first (then this node fetches it from there)"
                    )
            log.info("fetching %s from the hub (%d MiB)", ref, size >> 20)
            try:
                await fetch_checked(client, sha256, size, partial)
            except DownloadError as err:
                raise PlacementError(str(err)) from err
            self._waiting_since.pop(sha256, None)
            partial.replace(target)
            return target
        finally:
            self.fetching.discard(sha256)

    async def _from_peers(self, peers: list[protocol.ModelPeer], file: _File) -> str | None:
        """The file from a peer of the site that holds it (None once it is in its partial
        file, checked); else the id of a peer to wait for (one fetching it now, or the one
        that fetches it from the hub first and has not yet), or "" when there is none."""
        wait = ""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=60)
        trusted = self._trust_file is not None and self._trust_file.is_file()
        context = ssl.create_default_context(cafile=self._trust_file) if trusted else None
        if context is not None:
            context.check_hostname = False  # a peer's certificate names it, not an address
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for peer in sorted(peers, key=lambda p: not p.first):
                for url in peer.urls:
                    found = await self._from_peer(session, context, url, peer, file)
                    if found == "fetched":
                        return None
                    if found == "wait" and not wait:
                        wait = peer.node_id
                    if found != "unreachable":
                        break  # the peer answered: its other addresses would say the same
        return wait

    async def _from_peer(
        self,
        session: aiohttp.ClientSession,
        context: ssl.SSLContext | None,
        url: str,
        peer: protocol.ModelPeer,
        file: _File,
    ) -> Literal["fetched", "wait", "none", "unreachable"]:
        sha256, ticket = file.sha256, file.ticket
        address = f"{url}{PEER_ARTIFACTS}/{sha256}"
        if url.startswith("https:") and context is None:
            return "unreachable"  # no CA bundle yet to check its certificate with

        async def source(offset: int) -> aiohttp.ClientResponse:
            headers = {PEER_TICKET_HEADER: ticket}
            if offset:
                headers |= {"Range": f"bytes={offset}-", "If-Range": f'"{sha256}"'}
            return await session.get(address, headers=headers, ssl=context or False)

        try:
            # One byte first: whether the peer holds the file, is fetching it, or neither.
            probe_headers = {PEER_TICKET_HEADER: ticket, "Range": "bytes=0-0"}
            async with session.get(address, headers=probe_headers, ssl=context or False) as probe:
                status = 200 if probe.status == 206 else probe.status
            if status == 409 or (status == 404 and peer.first):
                return "wait"  # fetching it now, or first to fetch it and not yet begun
            if status != 200:
                log.info("peer %s answered %d for %s", peer.node_id, status, sha256[:12])
                return "none"
            log.info("fetching %s from node %s of this site (%d MiB)", sha256[:12],
                     peer.node_id, file.size >> 20)  # fmt: skip
            await fetch_checked_from(
                source, sha256, file.size, file.partial, f"node {peer.node_id}"
            )
        except DownloadError as err:
            log.warning("from peer %s: %s", peer.node_id, err)
            return "none"
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            log.info("peer %s at %s: %s", peer.node_id, url, err)
            return "unreachable"
        return "fetched"
