"""The model registry: which models are loaded, within a memory budget, and which replica
serves each request.

Models are registered in the store (name, version, format, file, sha256, quantisation);
the registry loads them into worker processes (appliance.serving.supervisor.Replica), one
or more replicas each. Clients name a model as ``name`` (the newest loaded version, else
the newest registered) or ``name@version``. A registered model that is not loaded is loaded
on first use. Every load must fit the memory budget: idle models are unloaded first, least
recently used first; pinned models and models with requests in flight never are. The model
named by ``model.default`` is loaded at start and pinned, and so is every model an admin
pinned (pins are kept in the store).

Memory is accounted by estimate (:func:`estimate_mb`: the file, a full-size KV cache for
every slot and a fixed overhead per worker): an upper bound known before the load, so the
budget holds however the workers' resident memory moves. The measured resident memory of
each worker is reported beside it.

The router sends each request to the ready replica of its model with the least outstanding
work (requests submitted and not yet finished); ties go round-robin.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import psutil

from appliance.serving import isolation
from appliance.serving.catalog import (
    EMBEDDED,
    ModelFileError,
    ensure_embedded,
    stamps_folder,
)
from appliance.serving.engine import (
    EngineOptions,
    Finished,
    GenerationRequest,
    Run,
    Vocabulary,
    default_threads,
)
from appliance.serving.predictor import Rates, StepCost, slowdown
from appliance.serving.presets import Presets
from appliance.serving.sampling_options import Sampling
from appliance.serving.supervisor import Replica, Restart, SupervisorOptions, WorkerStats
from shared import heap
from shared.chat import ChatTemplateError
from shared.gguf import GGUFError, read_gguf, replica_mib
from shared.supervise import wait_until_set

if TYPE_CHECKING:
    from collections.abc import Iterable

    from appliance.observability.metrics import Metrics
    from appliance.settings import ApplianceSettings
    from appliance.state.records import ModelRecord
    from appliance.state.store import AsyncStore
    from shared.classes import IsolationLevel
    from shared.protocol import ModelPreset

log = logging.getLogger(__name__)


# What a model worker runs (appliance.serving.worker's `engine_for`).
WORKER_FORMATS = frozenset({"gguf", "script"})


def _rank(level: IsolationLevel) -> int:
    return level.rank


MAX_REPLICAS = 8

State = Literal["loading", "ready", "failed"]


class UnknownModelError(LookupError):
    def __init__(self, model: str, known: list[str]) -> None:
        super().__init__(
            f"model {model!r} is not registered; registered: {', '.join(known) or 'none'}"
        )


class ModelNotReadyError(RuntimeError):
    """The model is loading (retry shortly) or failed to load (``failed``)."""

    def __init__(self, message: str, *, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


class InsufficientMemoryError(RuntimeError):
    """Loading would exceed the memory budget even after unloading every idle model."""


class ModelPinnedError(RuntimeError):
    pass


def split_ref(ref: str) -> tuple[str, str | None]:
    name, sep, version = ref.partition("@")
    return name, (version if sep else None)


# -- memory planning (pure) ------------------------------------------------------------------


@dataclass(frozen=True)
class Resident:
    """A loaded (or loading) model, as the memory planner sees it."""

    ref: str
    memory_mb: float
    last_used: float  # monotonic seconds; smaller is longer ago
    pinned: bool
    busy: bool  # loading, or requests in flight


def plan_eviction(
    residents: Iterable[Resident], need_mb: float, budget_mb: float
) -> tuple[str, ...] | None:
    """The models to unload, least recently used first, so ``need_mb`` more fits the
    budget: () when it fits already, None when it cannot fit even with every idle, unpinned
    model unloaded. Pinned and busy models are never chosen."""
    residents = list(residents)
    if math.fsum(r.memory_mb for r in residents) + need_mb <= budget_mb:
        return ()
    evict: list[str] = []
    idle = sorted((r for r in residents if not (r.pinned or r.busy)), key=lambda r: r.last_used)
    for resident in idle:
        evict.append(resident.ref)
        # What stays, summed afresh (not the total less each one: that leaves a rounding
        # residue, and every idle model gone would not fit a budget they filled exactly).
        kept = math.fsum(r.memory_mb for r in residents if r.ref not in evict)
        if kept + need_mb <= budget_mb:
            return tuple(evict)
    return None


def _load_options(
    preset: ModelPreset | None,
) -> tuple[int | None, int | None, str | None]:
    return (None, None, None) if preset is None else preset.load_options()


def estimate_mb(record: ModelRecord, options: EngineOptions) -> float:
    """One replica's resident memory (shared/gguf.py `replica_mib`): the weights, the KV
    cache its context is created with, and the worker's overhead."""
    try:
        shape = read_gguf(Path(record.path)).kv_shape()
    except (GGUFError, OSError):
        shape = None
    return replica_mib(
        shape,
        record.size_bytes,
        options.n_ctx,
        options.n_slots,
        n_batch=options.n_batch,
        # Without flash attention the V half stays f16: counted as f16 (an upper bound).
        kv_type=options.kv_type if options.flash_attn else "f16",
    )


# -- deployments -----------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """One model version and its replicas."""

    record: ModelRecord
    options: EngineOptions
    memory_mb: float  # the estimate the budget accounts, all replicas
    pinned: bool
    preset: ModelPreset | None = None  # the hub's, for a model it placed here
    load_s: float | None = None  # from the first worker's start to every replica's ready
    calibration: Rates | None = None  # its speed on this node, idle, measured at load
    # How much slower than that its llama_decode calls run now (1: as idle), from the
    # calls its workers report (`predictor.slowdown`).
    slowdown: float = 1.0
    replicas: list[Replica] = field(default_factory=list)
    state: State = "loading"
    error: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    loaded: asyncio.Event = field(default_factory=asyncio.Event)  # set: ready or failed
    task: asyncio.Task[None] | None = None  # the load
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas)

    @property
    def busy(self) -> bool:
        return self.state == "loading" or self.outstanding > 0

    def resident(self) -> Resident:
        return Resident(
            self.record.ref, self.memory_mb, self.last_used, self.pinned, busy=self.busy
        )

    @property
    def n_ctx(self) -> int:
        return self.options.n_ctx

    @property
    def waiting(self) -> int:
        return sum(r.waiting for r in self.replicas)

    def require_vocab(self) -> Vocabulary:
        # Every replica runs the same file: any one's vocabulary serves.
        return self.replicas[0].require_vocab()

    def submit(self, request: GenerationRequest) -> Run:
        """Route and submit in one step, so concurrent requests see each other's load."""
        return self.route().submit(request)

    def route(self) -> Replica:
        """The ready replica with the least outstanding work; ties in turn."""
        ready = [r for r in self.replicas if r.ready]
        if not ready:  # every worker is restarting: the first one says so on submit
            return self.replicas[0]
        least = min(r.outstanding for r in ready)
        tied = [r for r in ready if r.outstanding == least]
        return tied[next(self._turn) % len(tied)]

    def measured_mb(self) -> float | None:
        total = 0.0
        for replica in self.replicas:
            if replica.pid is None:
                return None
            try:
                total += psutil.Process(replica.pid).memory_info().rss / 2**20
            except psutil.Error:
                return None
        return total


# The calibration at load: a prompt of ordinary text prefilled and a few tokens decoded.
CALIBRATION_TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. "
CALIBRATION_PROMPT = 64  # tokens
CALIBRATION_STEPS = 6  # tokens generated
CALIBRATION_TIMEOUT_S = 120.0


async def calibrate(deployment: LoadedModel) -> Rates | None:
    """A model's speed on this node with nothing else running, measured once its replicas
    are up and before any request: its prefill speed and its time per token. The admission
    control's per-token allowances and its prediction start from it (appliance.inference
    .admission). None for a model script (its timings are the script's), or when the
    measurement fails (the model still serves; the defaults stand until traffic measures)."""
    if deployment.record.format != "gguf":
        return None
    replica = deployment.replicas[0]
    try:
        vocab = replica.require_vocab()
        # Its chat template compiled now, not while the first request (and the door's
        # answers behind it) waits: 30 ms.
        with contextlib.suppress(ChatTemplateError):
            vocab.chat_template.render([{"role": "user", "content": CALIBRATION_TEXT}])
        tokens = vocab.tokenize(CALIBRATION_TEXT * 8, chat=False)
        count = min(CALIBRATION_PROMPT, len(tokens), deployment.n_ctx // 2)
        request = GenerationRequest(
            tuple(tokens[:count]), CALIBRATION_STEPS, Sampling(temperature=0.0)
        )
        finished = None
        async with asyncio.timeout(CALIBRATION_TIMEOUT_S):
            async for event in replica.submit(request):
                if isinstance(event, Finished):
                    finished = event
    except Exception:  # noqa: BLE001 - measured or not, the model serves
        log.warning("model %s: its speed could not be measured", deployment.record.ref)
        return None
    if finished is None or finished.ttft_s is None:
        return None
    prefill_s = finished.ttft_s - (finished.queue_s or 0.0)
    decode_s = finished.duration_s - finished.ttft_s
    default = Rates()
    rates = Rates(
        finished.prompt_tokens / prefill_s if prefill_s > 0 else default.prefill_tok_s,
        decode_s / (finished.completion_tokens - 1)
        if finished.completion_tokens > 1 and decode_s > 0
        else default.token_s,
    )
    log.info(
        "model %s idle on this node: %.0f prompt tokens/s, %.1f ms per token",
        deployment.record.ref, rates.prefill_tok_s, rates.token_s * 1000,
    )  # fmt: skip
    return rates


class ModelRegistry:
    def __init__(
        self,
        store: AsyncStore,
        settings: ApplianceSettings,
        metrics: Metrics,
        presets: Presets | None = None,
    ) -> None:
        self.presets = presets or Presets()
        self._store = store
        self._settings = settings
        self._metrics = metrics
        self._deployments: dict[str, LoadedModel] = {}
        self._default_ref: str | None = None  # model.default, once resolved to a record
        self._start_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one memory plan at a time
        budget = settings.model.memory_budget_mb
        self.budget_mb = float(budget or psutil.virtual_memory().total / 2**20 * 0.75)
        # Where workers get cgroups with limits (I2), found once; I1 where nowhere.
        self.cgroups = isolation.find_cgroups()
        if self.cgroups.base is None:
            log.info("model workers run at isolation I1: %s", self.cgroups.why_not)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._start(), name="kvl-model-load")

    async def wait_loaded(self) -> None:
        """Wait until the default model has loaded (or failed to)."""
        if self._task is not None:
            await asyncio.shield(self._task)
        default = self._default
        if default is not None:
            await default.loaded.wait()

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        deployments, self._deployments = list(self._deployments.values()), {}
        await asyncio.gather(*(self._close(d, drain_s=0) for d in deployments))

    async def _start(self) -> None:
        try:
            # The hub's presets first: the pinned models it placed load with them.
            desired = await self._store.run(self._store.sync.meta, "desired_models")
            self.presets.set_desired(desired)
            record = await self._default_record()
            self._default_ref = record.ref
            await self._deploy(record, replicas=1, pinned=True)
            pinned = await self._store.run(self._store.sync.pinned_models)
            for other in pinned:
                if other.ref != record.ref:
                    await self._deploy(other, replicas=1, pinned=True)
        except Exception as err:
            # Readiness reports this; the process stays up so /healthz and the logs explain.
            self._start_error = f"{type(err).__name__}: {err}"
            log.exception("model %s failed to load", self._settings.model.default)

    async def _default_record(self) -> ModelRecord:
        name, version = split_ref(self._settings.model.default)
        record = await self._store.run(self._store.sync.get_model, name, version)
        if record is None:
            record = await self._embedded(name, version)
        if record is None:
            raise LookupError(
                f"model.default {self._settings.model.default!r} is not registered; "
                "add it with `kvl appliance models add`"
            )
        return record

    # -- state -------------------------------------------------------------------------------

    @property
    def _default(self) -> LoadedModel | None:
        return None if self._default_ref is None else self._deployments.get(self._default_ref)

    @property
    def ready(self) -> bool:
        """A model serves. At start that is the default model; an admin may unload it
        later and serve others."""
        return any(d.state == "ready" for d in self._deployments.values())

    @property
    def load_error(self) -> str | None:
        """Why the default model is not serving, if it failed."""
        if self._start_error is not None:
            return self._start_error
        default = self._default
        return default.error if default is not None else None

    def loaded_models(self) -> list[LoadedModel]:
        return list(self._deployments.values())

    def served(self) -> list[ModelRecord]:
        return [d.record for d in self._deployments.values() if d.state == "ready"]

    @property
    def isolation_max(self) -> IsolationLevel:
        """The highest level this node can run a worker at (I2 with cgroups, else I1)."""
        return self.cgroups.level

    def isolation_levels(self) -> dict[str, IsolationLevel]:
        """The level each served model runs at now: its least isolated replica's, each read
        back from the system (for the heartbeat's `Capacity.isolation`)."""
        levels: dict[str, IsolationLevel] = {}
        for d in self._deployments.values():
            if d.state == "ready" and d.replicas:
                levels[d.record.ref] = min((r.isolation for r in d.replicas), key=_rank)
        return levels

    def replicas(self) -> list[Replica]:
        return [r for d in self._deployments.values() if d.state == "ready" for r in d.replicas]

    def used_mb(self) -> float:
        return sum(d.memory_mb for d in self._deployments.values())

    # -- requests ----------------------------------------------------------------------------

    async def resolve(self, model: str) -> LoadedModel:
        """The deployment to serve a request for ``model`` (its ``submit`` picks the
        replica), loading the model if it must."""
        deployment = await self._find(model)
        if deployment is None:
            record = await self._registered(model)
            deployment = await self._deploy(record, replicas=1, pinned=False)
        if deployment.state == "loading":
            timeout = self._settings.model.load_wait_s
            if not await wait_until_set(deployment.loaded, timeout):
                raise ModelNotReadyError(f"model {model!r} is still loading")
        if deployment.state == "failed":
            raise ModelNotReadyError(
                f"model {deployment.record.ref} failed to load: {deployment.error}", failed=True
            )
        deployment.last_used = time.monotonic()
        return deployment

    async def _find(self, model: str) -> LoadedModel | None:
        name, version = split_ref(model)
        if version is not None:
            return self._deployments.get(f"{name}@{version}")
        loaded = [d for d in self._deployments.values() if d.record.name == name]
        if not loaded:
            return None
        # The newest version that serves; a loading one only if nothing of the name serves.
        ready = [d for d in loaded if d.state == "ready"] or loaded
        return max(ready, key=lambda d: d.record.added_at)

    async def _registered(self, model: str) -> ModelRecord:
        name, version = split_ref(model)
        record = await self._store.run(self._store.sync.get_model, name, version)
        if record is None:
            record = await self._embedded(name, version)
        if record is None:
            known = await self._store.run(self._store.sync.list_models)
            raise UnknownModelError(model, [r.ref for r in known])
        return record

    async def _embedded(self, name: str, version: str | None) -> ModelRecord | None:
        """An embedded model, registered on its first use (None: no such embedded model or
        version). Registering copies its file once, on the store's thread."""
        if name not in EMBEDDED:
            return None
        store, models_dir = self._store.sync, self._settings.models_dir
        try:
            record = await self._store.run(ensure_embedded, store, models_dir, name)
        except ModelFileError as err:
            raise ModelNotReadyError(
                f"model {name} cannot be registered: {err}", failed=True
            ) from err
        return record if version in (None, record.version) else None

    # -- admin -------------------------------------------------------------------------------

    async def load(self, model: str, *, replicas: int | None, pinned: bool | None) -> LoadedModel:
        """Load ``model`` (or change its replicas or pin) and wait until it serves."""
        record = await self._registered(model)
        deployment = self._deployments.get(record.ref)
        held = len(deployment.replicas) if deployment is not None else 0
        resized = replicas is not None and replicas != held
        if deployment is not None and (resized or self._preset_changed(deployment)):
            # A new replica count, or a preset that loads it otherwise, is a reload; the
            # replicas and the pin carry over unless given.
            replicas = replicas or len(deployment.replicas) or 1
            pinned = deployment.pinned if pinned is None else pinned
            await self.unload(record.ref, force=True)
            deployment = None
        if deployment is None:
            deployment = await self._deploy(record, replicas=replicas or 1, pinned=bool(pinned))
        elif pinned is not None:
            deployment.pinned = pinned
        if pinned is not None:
            await self._store.run(self._store.sync.set_model_pinned, record.ref, pinned)
        # What the preset says of serving (sampling, names, …) applies from the next request.
        deployment.preset = self.presets.of(record.ref)
        await deployment.loaded.wait()
        return deployment

    async def release(self, model: str) -> None:
        """Unpin a model and unload it once its requests are done (the hub placed it
        elsewhere); nothing when it is not loaded."""
        record = await self._registered(model)
        await self._store.run(self._store.sync.set_model_pinned, record.ref, pinned=False)
        deployment = self._deployments.get(record.ref)
        if deployment is not None:
            deployment.pinned = False
            await self.unload(record.ref)

    async def unload(self, model: str, *, force: bool = False) -> LoadedModel:
        """Unload a model, after the requests in flight finished (or a drain timeout)."""
        record = await self._registered(model)
        deployment = self._deployments.get(record.ref)
        if deployment is None:
            raise UnknownModelError(f"{record.ref} (registered, not loaded)", self._loaded_refs())
        if deployment.pinned and not force:
            raise ModelPinnedError(
                f'model {record.ref} is pinned; unpin it first (POST with "pinned": false)'
            )
        del self._deployments[record.ref]
        await self._close(deployment, drain_s=self._settings.model.drain_s)
        return deployment

    def _loaded_refs(self) -> list[str]:
        return list(self._deployments)

    # -- loading and unloading ---------------------------------------------------------------

    def _preset_changed(self, deployment: LoadedModel) -> bool:
        """Whether the hub's preset for a loaded model now loads it otherwise."""
        now = self.presets.of(deployment.record.ref)
        return _load_options(now) != _load_options(deployment.preset)

    def _options(self, replicas: int = 1, preset: ModelPreset | None = None) -> EngineOptions:
        m = self._settings.model
        # Replicas share the cores: llama.cpp's threads spin while they wait, so more
        # threads than cores slow every replica down many times over.
        threads = m.n_threads or max(1, default_threads() // replicas)
        n_ctx, n_slots, kv_type = _load_options(preset)
        return EngineOptions(
            n_ctx=n_ctx or m.n_ctx,
            n_batch=m.n_batch,
            n_threads=threads,
            n_gpu_layers=m.n_gpu_layers,
            max_queue=m.max_queue,
            n_slots=n_slots or m.n_slots,
            kv_type=kv_type or "f16",
            flash_attn=m.flash_attn,
            worker_nice=m.worker_nice,
            prefix_min_tokens=m.prefix_min_tokens,
            cache_prompt=m.cache_prompt,
            reserved_slots=self._settings.classes.reserved_slots,
            preemption=self._settings.classes.preemption,
            stamps_dir=str(stamps_folder(self._settings.models_dir)),
        )

    async def _deploy(self, record: ModelRecord, *, replicas: int, pinned: bool) -> LoadedModel:
        """Reserve memory (unloading idle models if needed) and start loading. Returns at
        once with the deployment loading; its ``loaded`` event says when it is done."""
        if record.format not in WORKER_FORMATS:
            raise ModelNotReadyError(
                f"model {record.ref} is {record.format}; only GGUF models and model scripts "
                "run in workers",
                failed=True,
            )
        async with self._lock:
            existing = self._deployments.get(record.ref)
            if existing is not None:
                return existing
            preset = self.presets.of(record.ref)
            options = self._options(replicas, preset)
            need = estimate_mb(record, options) * replicas
            evict = plan_eviction(
                (d.resident() for d in self._deployments.values()), need, self.budget_mb
            )
            if evict is None:
                raise InsufficientMemoryError(self._no_room(record, need))
            for ref in evict:
                log.info("unloading %s (least recently used) to make room for %s", ref, record.ref)
                victim = self._deployments.pop(ref)
                await self._close(victim, drain_s=0)
            deployment = LoadedModel(record, options, need, pinned, preset)
            self._deployments[record.ref] = deployment
        deployment.task = asyncio.create_task(
            self._bring_up(deployment, replicas), name=f"kvl-load-{record.ref}"
        )
        return deployment

    def _no_room(self, record: ModelRecord, need: float) -> str:
        held = ", ".join(
            f"{d.record.ref} {d.memory_mb:.0f} MiB ({'pinned' if d.pinned else 'busy'})"
            for d in self._deployments.values()
        )
        return (
            f"model {record.ref} needs about {need:.0f} MiB; the budget is "
            f"{self.budget_mb:.0f} MiB and {held or 'nothing'} cannot be unloaded now"
        )

    async def _bring_up(self, deployment: LoadedModel, count: int) -> None:
        ref = deployment.record.ref
        started = time.monotonic()
        try:
            for _ in range(count):
                replica = Replica(
                    deployment.record,
                    deployment.options,
                    SupervisorOptions(
                        memory_limit_mb=self._settings.model.worker_memory_limit_mb,
                        hang_timeout_s=self._settings.model.worker_hang_timeout_s,
                        cgroups=self.cgroups,
                        limits=self._limits(deployment, count),
                    ),
                    on_restart=self._restarted,
                    on_stats=lambda stats: self._observe(ref, stats),
                )
                deployment.replicas.append(replica)
            await asyncio.gather(*(r.start() for r in deployment.replicas))
        except Exception as err:
            deployment.state, deployment.error = "failed", f"{type(err).__name__}: {err}"
            log.exception("model %s failed to load", ref)
            if self._deployments.get(ref) is deployment and not deployment.pinned:
                # Nothing serves from it: give its memory back; the next request retries.
                del self._deployments[ref]
            await asyncio.gather(*(r.close() for r in deployment.replicas))
        else:
            deployment.calibration = await calibrate(deployment)
            deployment.state = "ready"
            deployment.load_s = time.monotonic() - started
            self._watch(deployment)
            # Its vocabulary and metadata, held until it unloads, kept out of the full
            # collections that would otherwise hold the door for tens of milliseconds.
            heap.freeze()
            log.info("model %s ready: %d replica(s)", ref, len(deployment.replicas))
        finally:
            deployment.loaded.set()

    def _limits(self, deployment: LoadedModel, count: int) -> isolation.Limits:
        """A worker's cgroup limits: `model.worker_memory_limit_mb`, else half again its
        share of the estimate and 256 MiB; its threads' worth of CPU."""
        memory = self._settings.model.worker_memory_limit_mb or int(
            deployment.memory_mb / max(1, count) * 1.5 + 256
        )
        threads = deployment.options.n_threads or default_threads()
        return isolation.Limits(memory_mib=memory, cpus=float(threads))

    def _watch(self, deployment: LoadedModel) -> None:
        m, ref = self._metrics, deployment.record.ref
        m.model_ready.labels(ref).set_function(
            lambda: 1.0 if any(r.ready for r in deployment.replicas) else 0.0
        )
        m.slots.labels(ref).set(deployment.options.n_slots * len(deployment.replicas))
        m.slots_busy.labels(ref).set_function(
            lambda: sum(r.busy_slots for r in deployment.replicas)
        )
        m.decode_tokens_per_second.labels(ref).set_function(
            lambda: sum(r.tokens_per_second for r in deployment.replicas)
        )

    async def _close(self, deployment: LoadedModel, *, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        # Polled: the count sums over replicas, and an unload is rare.
        while deployment.outstanding and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        await asyncio.gather(*(r.close() for r in deployment.replicas))
        ref = deployment.record.ref
        m = self._metrics
        for gauge in (m.model_ready, m.slots, m.slots_busy, m.decode_tokens_per_second):
            with contextlib.suppress(KeyError):
                gauge.remove(ref)

    # -- telemetry ---------------------------------------------------------------------------

    def _observe(self, model: str, stats: WorkerStats) -> None:
        m = self._metrics
        for size, _ in stats.steps:
            m.batch_tokens.labels(model).observe(size)
        deployment = self._deployments.get(model)
        if deployment is not None and deployment.calibration is not None and stats.steps:
            cost = StepCost.of(deployment.calibration)
            deployment.slowdown = slowdown(deployment.slowdown, stats.steps, cost)
        if stats.prefix_tokens_reused > 0:
            m.prefix_tokens_reused.labels(model).inc(stats.prefix_tokens_reused)
        if stats.preemptions > 0:
            m.preemptions.labels(model).inc(stats.preemptions)

    async def _restarted(self, restart: Restart) -> None:
        self._metrics.worker_restarts.labels(restart.model, restart.kind).inc()
        await self._store.run(
            self._store.sync.record_worker_restart,
            restart.model,
            restart.kind,
            restart.detail,
            restart.exit_code,
        )
