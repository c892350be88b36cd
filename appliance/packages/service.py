"""Content packages, end to end: a request in, one finished, validated package out,
kept in the local package cache.

1. The cache key is the normalised request's digest with the writing model's sha256, the
   voice's version and the prompt template's version: a repeated request is a cache hit,
   and a new model or voice makes a new version of the same package id.
2. Items come from the local model one at a time (generate.py), each constrained by its
   type's JSON schema (from one of the request's `sources` in turn, when it has them).
   The content checks (checks.py) run on the whole set, then each item that passes them
   is answered again without its key by the checking model (verify.py: `packages.
   check_model`, unset the writing model) and, with sources, its key is found in one;
   an item that fails any check is generated again with another seed, up to
   `packages.max_attempts` times. A package that still fails is never delivered: the
   error lists the failed checks.
3. Narration (espeak-ng) for the introduction and each item, each file checked to decode
   with a plausible duration; a cover made from the title.
4. The manifest lists every file with its sha256 and size, the lineage (model, voice,
   template, seed, appliance) and the validation report; the cache stores it all,
   content-addressed.

Two identical requests at once generate once (a lock per cache key). The tokens each
item's generation used are charged to the requesting key's account, as any completion.

Who sees a package: the accounts that asked for it (made, or a cache hit) and, for one the
hub seeded, every account; an admin key sees all (`visible`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import defaultdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from appliance.packages.cache import NotCachedError
from appliance.packages.checks import (
    check_audio,
    check_items,
    check_on_topic,
    report,
    topic_text,
)
from appliance.packages.generate import (
    TEMPLATE_VERSION,
    cover_svg,
    generate_item,
)
from appliance.packages.model import (
    INTRO_NARRATION,
    Check,
    FileEntry,
    Item,
    Lineage,
    Manifest,
    ModelLineage,
    PackageRequest,
    VoiceLineage,
)
from appliance.packages.verify import Checker, verify
from appliance.packages.voice import Voice, Voices
from appliance.state.store import EVERY_ACCOUNT
from shared.errors import OutputInvalid, PackageInvalid

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from appliance.inference.completions import CompletionService
    from appliance.packages.cache import CachedPackage, PackageCache
    from appliance.serving.registry import ModelRegistry
    from appliance.settings import PackageSettings
    from appliance.state.records import ModelRecord
    from appliance.state.store import ApiKey, AsyncStore
    from shared.protocol import PackageOverrides

    # The embedding model's similarity of each text to an anchor (None: not computed).
    Similarity = Callable[[str, Sequence[str]], Awaitable[list[float] | None]]

log = logging.getLogger(__name__)


def package_view(cached: CachedPackage) -> dict[str, Any]:
    """A package as the API answers it."""
    return {
        "object": "package",
        "id": cached.id,
        "version": cached.version,
        "pinned": cached.pinned,
        "size": cached.size,
        "manifest": cached.manifest.model_dump(mode="json"),
    }


def package_summary(cached: CachedPackage) -> dict[str, Any]:
    """A package in a list (the API's listing and search; the hub's report of it)."""
    m = cached.manifest
    return {
        "object": "package",
        "id": cached.id,
        "version": cached.version,
        "title": m.title,
        "topic": m.topic,
        "level": m.level.value,
        "items": len(m.items),
        "created_at": m.created_at,
        "size": cached.size,
        "pinned": cached.pinned,
    }


def package_event(cached: CachedPackage, origin: str) -> dict[str, Any]:
    """What the hub learns of a package this node holds ("made" here, or "seeded")."""
    return package_summary(cached) | {
        "digest": cached.digest,
        "lineage": cached.manifest.lineage.model_dump(mode="json"),
        "origin": origin,
    }


class PackageService:
    def __init__(
        self,
        completions: CompletionService,
        host: ModelRegistry,
        cache: PackageCache,
        settings: PackageSettings,
        *,
        model: str,
        node_id: str,
        store: AsyncStore,
    ) -> None:
        self._store = store
        self._completions = completions
        self._host = host
        self.cache = cache
        self._own_settings, self._own_model = settings, model
        self._own_max_bytes = cache.max_bytes
        self._settings = settings
        self._model = model  # the model that writes the items (name or name@version)
        self._node_id = node_id
        self._voices = Voices(settings)
        # The embedding model's similarity of texts to a topic (set once it exists; None:
        # the on_topic check is not run).
        self.similarity: Similarity | None = None
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._tasks: set[asyncio.Task[list[str]]] = set()

    @property
    def settings(self) -> PackageSettings:
        """The packages' settings in force: the node's own, with what the hub sets."""
        return self._settings

    @property
    def model(self) -> str:
        """The model that writes the items (name or name@version)."""
        return self._model

    def apply(self, hub: PackageOverrides) -> None:
        """What the hub sets of the packages' settings, over the node's own (each unset:
        the node's own again). The voice settings stay the node's: they name its files."""
        chosen = hub.model_dump(exclude_none=True, exclude={"model", "cache_max_mb"})
        self._settings = self._own_settings.model_copy(update=chosen)
        self._model = hub.model or self._own_model
        max_bytes = self._own_max_bytes if hub.cache_max_mb is None else hub.cache_max_mb << 20
        if max_bytes != self.cache.max_bytes:
            smaller = max_bytes < self.cache.max_bytes
            self.cache.max_bytes = max_bytes
            log.info("the package cache is capped at %d bytes", max_bytes)
            if smaller:  # what is over the new cap goes now, off the event loop
                task = asyncio.get_running_loop().create_task(asyncio.to_thread(self.cache.evict))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def create(self, req: PackageRequest, key: ApiKey) -> CachedPackage:
        record = (await self._host.resolve(self._model)).record
        checker = (await self._host.resolve(self._settings.check_model or self._model)).record
        narrator = self._voices.for_language(req.spec.language) if req.spec.narration else None
        voice = await narrator.version() if narrator is not None else None
        digest = req.digest()
        cache_key = hashlib.sha256(
            json.dumps([digest, record.sha256, checker.sha256, voice, TEMPLATE_VERSION]).encode()
        ).hexdigest()
        async with self._locks[cache_key]:
            hit = await asyncio.to_thread(self.cache.by_key, cache_key)
            if hit is not None:
                log.info("package %s@%s from the cache", hit.id, hit.version)
                await self._own(hit, key.account.id)  # asked for: now its account's too
                return hit
            manifest, files = await self._make(
                req, key, (record, checker), digest, cache_key, (narrator, voice)
            )
            stored = await asyncio.to_thread(self.cache.put, manifest, files, cache_key)
            await self._own(stored, key.account.id)
            await self._tell_hub(stored, origin="made")
        self._locks.pop(cache_key, None)
        return stored

    async def visible(self, key: ApiKey) -> set[tuple[str, str]] | None:
        """The (id, version) of the packages `key` may see: its account's and the ones the
        hub seeded; None (all of them) for an admin key."""
        if key.admin:
            return None
        return await self._store.run(self._store.sync.visible_packages, key.account.id)

    async def _own(self, cached: CachedPackage, account_id: int) -> None:
        await self._store.run(
            self._store.sync.add_package_owner, cached.id, cached.version, account_id
        )

    async def import_bundle(self, data: bytes, *, pinned: bool) -> CachedPackage:
        """Put a package archive (``PackageCache.bundle``) into the cache, pinned or not
        (CacheError when it is not one)."""
        stored = await asyncio.to_thread(self.cache.import_bundle, data)
        if stored.pinned != pinned:
            stored = await asyncio.to_thread(self.cache.pin, stored.id, stored.version, pinned)
        await self._own(stored, EVERY_ACCOUNT)  # the hub seeds a package for every account
        await self._tell_hub(stored, origin="seeded")
        return stored

    async def pin(self, package_id: str, version: str, *, pinned: bool) -> bool:
        """Pin or unpin a cached package version; False when it is not cached."""
        try:
            await asyncio.to_thread(self.cache.pin, package_id, version, pinned)
        except NotCachedError:
            return False
        return True

    async def _tell_hub(self, stored: CachedPackage, *, origin: str) -> None:
        """The package and its lineage, and whatever the cache evicted to make room, go to
        the hub through the outbox (committed before the client is answered)."""
        sync = self._store.sync
        await self._store.run(sync.record_event, "package", package_event(stored, origin))
        for ref in await asyncio.to_thread(self.cache.take_removed):
            package_id, _, version = ref.partition("@")
            await self._store.run(
                sync.record_event, "package_removed", {"id": package_id, "version": version}
            )

    async def _make(  # noqa: PLR0917 - the parts of one package
        self,
        req: PackageRequest,
        key: ApiKey,
        models: tuple[ModelRecord, ModelRecord],
        digest: str,
        cache_key: str,
        narration: tuple[Voice | None, str | None],
    ) -> tuple[Manifest, dict[str, bytes]]:
        spec = req.spec
        record, checker = models
        narrator, voice = narration
        seed = int(digest[:8], 16)
        verifier = Checker(self._completions, key, checker.ref, self._settings.verify_samples, seed)
        items, attempts, checks, audio = await self._items(req, key, record.ref, verifier, narrator)
        title = " ".join(req.topic.split())
        files: dict[str, bytes] = {}
        media: dict[str, str] = {}
        if narrator is not None:
            intro = f"{title}. {len(items)} questions."
            wav = await narrator.speak(intro, spec.language)
            check = check_audio(wav, text=intro, item="intro")
            checks.append(check)
            if not check.passed:  # the title itself cannot be read plausibly
                raise PackageInvalid(check.detail)
            files[INTRO_NARRATION] = wav
            for item_id, data in audio.items():
                files[f"audio/{item_id}.wav"] = data
            media |= dict.fromkeys(files, "audio/wav")
            items = [i.model_copy(update={"narration": f"audio/{i.id}.wav"}) for i in items]
        files["items.json"] = json.dumps(
            [i.model_dump(mode="json") for i in items], ensure_ascii=False, indent=2
        ).encode()
        media["items.json"] = "application/json"
        files["cover.svg"] = cover_svg(title, f"{req.level.value} · {len(items)} questions")
        media["cover.svg"] = "image/svg+xml"
        entries = [
            FileEntry(
                path=path,
                sha256=hashlib.sha256(data).hexdigest(),
                size=len(data),
                media_type=media[path],
            )
            for path, data in sorted(files.items())
        ]
        manifest = Manifest(
            id=f"pkg_{digest[:24]}",
            version=cache_key[:12],
            title=title,
            topic=req.topic,
            level=req.level,
            spec=spec,
            items=items,
            files=entries,
            lineage=Lineage(
                model=ModelLineage(name=record.name, version=record.version, sha256=record.sha256),
                voice=VoiceLineage(
                    engine=narrator.engine, voice=narrator.name(spec.language), version=voice
                )
                if narrator is not None and voice
                else None,
                prompt_template_version=TEMPLATE_VERSION,
                seed=seed,
                appliance_id=self._node_id,
            ),
            validation=report(checks, attempts).model_copy(
                update={"writer": record.ref, "checker": checker.ref}
            ),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            request_digest=digest,
        )
        return manifest, files

    async def _items(  # noqa: PLR0912 - one loop of attempts over the items' checks
        self,
        req: PackageRequest,
        key: ApiKey,
        model: str,
        checker: Checker,
        narrator: Voice | None,
    ) -> tuple[list[Item], int, list[Check], dict[str, bytes]]:
        """Every item, each generated again (another seed) while it fails a check, its
        answer verification or its narration; (items, attempts, checks, narration WAV by
        item id)."""
        spec, seed = req.spec, checker.seed
        audio: dict[str, bytes] = {}
        heard: dict[str, Check] = {}  # the check of each narration kept, for the report
        verified: dict[str, list[Check]] = {}  # each item's verification, kept likewise
        kinds = [spec.item_types[n % len(spec.item_types)] for n in range(spec.items)]
        items: list[Item | None] = [None] * spec.items
        redo = set(range(spec.items))
        for attempt in range(1, self._settings.max_attempts + 1):
            # Grouped by type: items of one type share their prompt's long prefix (the
            # worked examples), which the model then reuses from its cache.
            for n in sorted(redo, key=lambda n: (kinds[n].value, n)):
                items[n] = await self._one_item(
                    key,
                    model=model,
                    topic=req.topic,
                    level=req.level,
                    language=spec.language,
                    kind=kinds[n],
                    n=n + 1,
                    choices=spec.choices,
                    seed=seed + 7919 * attempt + n,
                    source=req.sources[n % len(req.sources)] if req.sources else None,
                )
            if any(i is None for i in items):  # an answer that broke its schema: again
                redo = {n for n, i in enumerate(items) if i is None}
                checks = [
                    Check(name="schema", passed=False, item=f"item-{n + 1}",
                          detail="the model's answer did not follow the item's JSON schema")
                    for n in sorted(redo)
                ]  # fmt: skip
                continue
            done = [i for i in items if i is not None]
            checks = check_items(done, spec, req.level) + await self._on_topic(req, done)
            failed = {c.item for c in checks if not c.passed}
            # Only items that pass every check of form are put to the checking model.
            fresh = [i for i in done if i.id not in failed and i.id not in verified]
            for item, judged in zip(fresh, await self._verify(req, checker, fresh), strict=True):
                verified[item.id] = judged
            for item in done:
                if item.id not in failed and item.id in verified:
                    checks += verified[item.id]
                    failed |= {c.item for c in verified[item.id] if not c.passed}
            if narrator is not None:
                # An item whose narration fails its check is generated again too.
                for item in done:
                    if item.id in failed:
                        continue
                    if item.id in audio:  # narrated in an earlier attempt: its check stands
                        checks.append(heard[item.id])
                        continue
                    spoken = _spoken(item)
                    wav = await narrator.speak(spoken, spec.language)
                    check = check_audio(wav, text=spoken, item=item.id)
                    checks.append(check)
                    if check.passed:
                        audio[item.id] = wav
                        heard[item.id] = check
                    else:
                        failed.add(item.id)
            for item in done:
                if item.id in failed:  # what was refused, for the operator (and the bench)
                    refused = {"attempt": attempt, "item": item.model_dump(mode="json"),
                               "failed": [c.name for c in checks
                                          if c.item == item.id and not c.passed]}  # fmt: skip
                    log.info("package item refused: %s", json.dumps(refused, ensure_ascii=False))
            if not failed:
                return done, attempt, list(checks), audio
            redo = {n for n, i in enumerate(done) if i.id in failed}
            if None in failed or not redo:  # a check of the whole set: all again
                redo = set(range(spec.items))
            for n in redo:
                audio.pop(f"item-{n + 1}", None)
                heard.pop(f"item-{n + 1}", None)
                verified.pop(f"item-{n + 1}", None)
            log.info("package attempt %d: %d items fail checks, again", attempt, len(redo))
        problems = "; ".join(
            f"{c.name} ({c.item or 'package'}): {c.detail}" for c in checks if not c.passed
        )
        raise PackageInvalid(
            f"the package failed its checks after {self._settings.max_attempts} attempts: "
            f"{problems}",
        )

    async def _verify(
        self, req: PackageRequest, checker: Checker, items: list[Item]
    ) -> list[list[Check]]:
        """Per item, its answer verification (and source support with sources)."""
        judged = await verify(
            checker,
            items,
            sources=req.sources,
            similarity=self.similarity,
            source_min_similarity=self._settings.source_min_similarity,
        )
        return [[c for c in judged if c.item == item.id] for item in items]

    async def _on_topic(self, req: PackageRequest, items: list[Item]) -> list[Check]:
        minimum = self._settings.topic_min_similarity
        if minimum <= 0:
            return []
        why_not, scores = "the embedding model is off or not loaded", None
        if not req.spec.language.lower().startswith("en"):
            why_not = f"the embedding model reads English, not {req.spec.language}"
        elif self.similarity is not None:
            scores = await self.similarity(req.topic, [topic_text(i) for i in items])
        return check_on_topic(items, scores, minimum=minimum, why_not=why_not)

    async def _one_item(self, key: ApiKey, **kwargs: Any) -> Item | None:
        """One item, or None when the model's answer broke its schema (it is asked again)."""
        try:
            return await generate_item(
                self._completions, key, max_tokens=self._settings.item_max_tokens, **kwargs
            )
        except OutputInvalid as err:
            log.info("an item broke its schema: %s", err)
            return None

    async def run_job_item(self, key: ApiKey, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A package job's one item (the job runner calls this)."""
        req = PackageRequest.model_validate({**body, "wait": True})
        cached = await self.create(req, key)
        return 200, package_view(cached)


def _spoken(item: Item) -> str:
    """What the narration reads: the prompt, then the choices in order."""
    if not item.choices or item.type.value == "true_false":
        return item.prompt
    options = ". ".join(f"{c.id.upper()}: {c.text}" for c in item.choices)
    return f"{item.prompt} {options}."
