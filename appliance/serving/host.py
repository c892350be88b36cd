"""The models this appliance serves, by name or `name@version`, and their loading."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from appliance.serving.catalog import DEFAULT_MODEL_NAME, ensure_default_model
from appliance.serving.engine import EngineOptions
from appliance.serving.supervisor import Replica, Restart, SupervisorOptions

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
        self.replica: Replica | None = None
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
        if self.replica is not None:
            await self.replica.close()

    async def _load(self) -> None:
        m = self._settings.model
        try:
            record = await self._record()
            replica = Replica(
                record,
                EngineOptions(
                    n_ctx=m.n_ctx,
                    n_batch=m.n_batch,
                    n_threads=m.n_threads,
                    n_gpu_layers=m.n_gpu_layers,
                    max_queue=m.max_queue,
                    n_slots=m.n_slots,
                    flash_attn=m.flash_attn,
                ),
                SupervisorOptions(
                    memory_limit_mb=m.worker_memory_limit_mb,
                    hang_timeout_s=m.worker_hang_timeout_s,
                ),
                on_restart=self._restarted,
            )
            self.replica = replica
            self._metrics.model_ready.labels(record.ref).set_function(
                lambda: 1.0 if replica.ready else 0.0
            )
            await replica.start()
        except Exception as err:
            # Readiness reports this; the process stays up so /healthz and the logs explain.
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("model %s failed to load", m.default)

    async def _restarted(self, restart: Restart) -> None:
        self._metrics.worker_restarts.labels(restart.model, restart.kind).inc()
        await self._store.run(
            self._store.sync.record_worker_restart,
            restart.model,
            restart.kind,
            restart.detail,
            restart.exit_code,
        )

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
        return self.replica is not None and self.replica.ready

    def served(self) -> list[ModelRecord]:
        return [self.replica.record] if self.replica is not None else []

    async def resolve(self, model: str) -> Replica:
        name, version = split_ref(model)
        engine = self.replica
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
