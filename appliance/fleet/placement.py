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
import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from appliance.fleet.client import HubError
from appliance.fleet.downloads import CHUNK, DownloadError, fetch_checked
from appliance.packages.cache import CacheError
from appliance.serving.registry import (
    InsufficientMemoryError,
    ModelNotReadyError,
    ModelPinnedError,
    UnknownModelError,
)
from appliance.state.records import ModelRecord
from appliance.state.store import now_iso
from shared.supervise import Failures

if TYPE_CHECKING:
    from pathlib import Path

    from appliance.fleet.client import HubClient
    from appliance.packages.service import PackageService
    from appliance.serving.registry import ModelRegistry
    from appliance.state.store import AsyncStore

log = logging.getLogger(__name__)

MAX_BUNDLE = 1 << 30  # bytes: a package archive is held in memory while it is checked
REFUSALS = (UnknownModelError, ModelNotReadyError, InsufficientMemoryError, ModelPinnedError)


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
    ) -> None:
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
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def converge(self, client: HubClient) -> None:
        errors = await self._models(client)
        if self._packages is not None:
            errors |= await self._seed(client, self._packages)
        self.errors = errors

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

    async def _fetch(self, client: HubClient, model: dict[str, Any]) -> Path:
        sha256, size = str(model["sha256"]), int(model["size_bytes"])
        target = self._models_dir / f"{model['name']}-{model['version']}-{sha256[:12]}.gguf"
        partial = target.with_name(target.name + ".part")
        log.info(
            "fetching %s@%s from the hub (%d MiB)", model["name"], model["version"], size >> 20
        )
        try:
            await fetch_checked(client, sha256, size, partial)
        except DownloadError as err:
            raise PlacementError(str(err)) from err
        partial.replace(target)
        return target
