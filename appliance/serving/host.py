"""The models this appliance serves, by name or `name@version`, and their loading."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from appliance.serving.catalog import DEFAULT_MODEL_NAME, ensure_default_model
from appliance.serving.engine import EngineOptions, LlamaEngine

if TYPE_CHECKING:
    from appliance.settings import ApplianceSettings
    from appliance.state.store import AsyncStore, ModelRecord
    from shared.telemetry import Metrics

log = logging.getLogger(__name__)


class UnknownModelError(LookupError):
    def __init__(self, model: str, known: list[str], registered: bool) -> None:
        if registered:
            msg = f"model {model!r} is registered but not served; serving: {', '.join(known)}"
        else:
            msg = f"model {model!r} does not exist; serving: {', '.join(known) or 'none yet'}"
        super().__init__(msg)


class ModelNotReadyError(RuntimeError):
    pass


def split_ref(ref: str) -> tuple[str, str | None]:
    name, sep, version = ref.partition("@")
    return name, (version if sep else None)


class ModelHost:
    """Loads the configured model in the background; resolves request model names."""

    def __init__(self, store: AsyncStore, settings: ApplianceSettings, metrics: Metrics) -> None:
        self._store = store
        self._settings = settings
        self._metrics = metrics
        self.engine: LlamaEngine | None = None
        self.load_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._load(), name="kvl-model-load")

    async def wait_loaded(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.engine is not None:
            await self.engine.close()

    async def _load(self) -> None:
        try:
            record = await self._record()
            engine = LlamaEngine(
                record,
                EngineOptions(
                    n_ctx=self._settings.model.n_ctx,
                    n_batch=self._settings.model.n_batch,
                    n_threads=self._settings.model.n_threads,
                    n_gpu_layers=self._settings.model.n_gpu_layers,
                    max_queue=self._settings.model.max_queue,
                    prompt_cache=self._settings.model.prompt_cache,
                    flash_attn=self._settings.model.flash_attn,
                ),
            )
            self._metrics.model_ready.labels(record.ref).set(0)
            await asyncio.to_thread(engine.load)
            self.engine = engine
            self._metrics.model_ready.labels(record.ref).set(1)
        except Exception as err:
            # Readiness reports this; the process stays up so /healthz and the logs explain.
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("model %s failed to load", self._settings.model.default)

    async def _record(self) -> ModelRecord:
        name, version = split_ref(self._settings.model.default)
        record = await self._store.run(self._store.sync.get_model, name, version)
        if record is None and name == DEFAULT_MODEL_NAME:
            store = self._store.sync
            record = await self._store.run(ensure_default_model, store, self._settings.models_dir)
        if record is None:
            raise LookupError(
                f"model.default {self._settings.model.default!r} is not registered; "
                "add it with `kvl appliance models add`"
            )
        return record

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready

    def served(self) -> list[ModelRecord]:
        return [self.engine.record] if self.engine is not None else []

    async def resolve(self, model: str) -> LlamaEngine:
        name, version = split_ref(model)
        engine = self.engine
        if (
            engine is not None
            and engine.record.name == name
            and version in (None, engine.record.version)
        ):
            return engine
        configured, _ = split_ref(self._settings.model.default)
        if engine is None and name == configured and self.load_error is None:
            raise ModelNotReadyError(f"model {model!r} is still loading")
        registered = await self._store.run(self._store.sync.get_model, name, version)
        raise UnknownModelError(model, [r.ref for r in self.served()], registered is not None)
