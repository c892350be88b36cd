"""The embedding service: the model loaded in the background, its batcher, and an API request
→ vectors, their usage record and the OpenAI response body.

No aiohttp here; the handler calls this. Failures of the engine and the batcher become
domain errors (shared.errors) here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from importlib.metadata import version as package_version
from typing import TYPE_CHECKING, Any

from appliance.inference.names import ModelNames
from appliance.serving.registry import split_ref
from appliance.state.store import UsageEvent
from shared.errors import (
    InternalError,
    InvalidRequest,
    ModelNotFound,
    ModelNotReady,
    QueueFull,
    UnsupportedParameter,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from appliance.inference.schemas import EmbeddingRequest
    from appliance.observability.metrics import Metrics
    from appliance.serving.embeddings import (
        BatchRun,
        EmbeddingBatcher,
        EmbeddingResult,
    )
    from appliance.settings import EmbeddingSettings
    from appliance.state.store import ApiKey, AsyncStore

log = logging.getLogger(__name__)

# Seconds a client waits before asking again while the model loads (it takes about one).
LOADING_RETRY_S = 2


@dataclass(frozen=True)
class LoadedModel:
    """The embedding model as served: what `/v1/models` says about it."""

    name: str
    version: str
    provider: str  # onnxruntime's execution provider actually running it
    dimension: int
    sha256: str
    created: int = 0  # when its file was installed, in Unix seconds

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class Embedded:
    """A request's vectors and what they cost."""

    model: LoadedModel
    result: EmbeddingResult
    encoding_format: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class EmbeddingService:
    """Loads the embedding model in a thread in the background (the appliance answers
    meanwhile), then embeds requests through one :class:`EmbeddingBatcher`."""

    def __init__(
        self,
        settings: EmbeddingSettings,
        store: AsyncStore,
        metrics: Metrics,
        names: ModelNames | None = None,
    ) -> None:
        self._names = names if names is not None else ModelNames(embedding=settings.model)
        self._settings = settings
        self._store = store
        self._metrics = metrics
        self.model: LoadedModel | None = None
        self.load_error: str | None = None
        self._batcher: EmbeddingBatcher | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self._settings.enabled

    @property
    def ready(self) -> bool:
        return self._batcher is not None

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.create_task(self._load(), name="kvl-embeddings-load")

    async def wait_loaded(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a load in progress finishes in its thread, unused
        if self._batcher is not None:
            await self._batcher.close()

    async def _load(self) -> None:
        # appliance.serving.embeddings (numpy, about 18 MiB; onnxruntime on load) only
        # where embeddings are on: the gateway of the default configuration never loads it.
        from appliance.serving.embeddings import (  # noqa: PLC0415
            MODEL_FILE,
            BatcherOptions,
            EmbeddingBatcher,
            EmbeddingEngine,
            EmbeddingOptions,
        )

        s = self._settings
        options = EmbeddingOptions(
            threads=s.threads,
            provider=s.provider,
            max_tokens=s.max_tokens,
            max_batch_texts=s.max_batch_texts,
        )
        try:
            engine = await asyncio.to_thread(EmbeddingEngine.load, options)
            model = LoadedModel(
                name=s.model,
                version=package_version(MODEL_FILE.distribution),
                provider=engine.provider,
                dimension=engine.dimension,
                sha256=MODEL_FILE.sha256,
                created=int(MODEL_FILE.locate().stat().st_mtime),
            )
        except Exception as err:
            # Readiness and requests report this; the process stays up for the LLM routes.
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("embedding model %s failed to load", s.model)
            return
        batcher = EmbeddingBatcher(
            engine,
            BatcherOptions(window_s=s.max_wait_ms / 1000, max_queue=s.max_queue),
            on_run=self._observe,
        )
        await batcher.start()
        self.model, self._batcher = model, batcher
        m = self._metrics
        m.embedding_model.labels(model.ref).info(
            {"provider": model.provider, "dimension": str(model.dimension)}
        )
        m.model_ready.labels(model.ref).set(1)
        m.queue_waiting.labels(model.ref).set_function(lambda: batcher.waiting)

    def _observe(self, run: BatchRun) -> None:
        if self.model is not None:
            self._metrics.embedding_batch_requests.labels(self.model.ref).observe(run.requests)
            self._metrics.embedding_batch_texts.labels(self.model.ref).observe(run.texts)

    def served(self) -> list[LoadedModel]:
        return [self.model] if self.model is not None else []

    async def similarities(self, anchor: str, texts: Sequence[str]) -> list[float] | None:
        """The cosine similarity of each text to ``anchor``, for the appliance's own use
        (no usage recorded); None while the model is off, loading, or busy."""
        if self._batcher is None:
            return None
        from appliance.serving.embeddings import (  # noqa: PLC0415 - loaded (see _load)
            BatcherClosedError,
            EmbeddingRunError,
            QueueFullError,
        )

        try:
            result = await self._batcher.embed([anchor, *texts])
        except (QueueFullError, BatcherClosedError, EmbeddingRunError) as err:
            log.info("similarities not computed: %s", err)
            return None
        vectors = [_unit(v) for v in result.to_lists()]
        return [sum(a * b for a, b in zip(vectors[0], v, strict=True)) for v in vectors[1:]]

    async def embed(self, req: EmbeddingRequest, key: ApiKey, route: str) -> Embedded:
        """The vectors for a parsed request; its usage is committed before this returns."""
        batcher, model = self._resolve(self._names.embedding_model(req.model))
        from appliance.serving.embeddings import (  # noqa: PLC0415 - loaded (see _load)
            BatcherClosedError,
            EmbeddingRunError,
            QueueFullError,
        )

        texts = self._texts(req)
        if req.dimensions is not None and req.dimensions != model.dimension:
            raise UnsupportedParameter(
                f"`dimensions` is {req.dimensions}; {model.name} gives {model.dimension} "
                "dimensions only (omit `dimensions`, or send it as "
                f"{model.dimension})",
                param="dimensions",
            )
        started = time.perf_counter()
        try:
            result = await batcher.embed(texts)
        except QueueFullError as err:
            raise QueueFull(str(err), retry_after=err.retry_after) from err
        except BatcherClosedError as err:
            raise ModelNotReady(str(err), retry_after=LOADING_RETRY_S) from err
        except EmbeddingRunError as err:
            raise InternalError(str(err)) from err
        embedded = Embedded(model, result, req.encoding_format)
        await self._record(embedded, key, route, time.perf_counter() - started)
        return embedded

    def _resolve(self, requested: str) -> tuple[EmbeddingBatcher, LoadedModel]:
        s = self._settings
        if not s.enabled:
            raise ModelNotFound(
                f"model {requested!r}: this appliance serves no embedding model "
                "(embeddings.enabled is false)",
                param="model",
            )
        name, version = split_ref(requested)
        current = None if self.model is None else self.model.version
        if name != s.model or (version is not None and current is not None and version != current):
            serving = s.model if self.model is None else f"{s.model} ({self.model.ref})"
            raise ModelNotFound(
                f"model {requested!r} is not an embedding model this appliance serves; "
                f"embeddings: {serving}",
                param="model",
            )
        if self._batcher is None or self.model is None:
            if self.load_error is not None:
                raise ModelNotReady(
                    f"the embedding model failed to load: {self.load_error}",
                )
            raise ModelNotReady(
                f"the embedding model {s.model} is loading",
                retry_after=LOADING_RETRY_S,
            )
        return self._batcher, self.model

    def _texts(self, req: EmbeddingRequest) -> list[str]:
        if isinstance(req.input, str):
            return [req.input]
        if not all(isinstance(item, str) for item in req.input):
            raise UnsupportedParameter(
                "`input` as token ids is not supported: this model's tokenizer is not "
                "OpenAI's; send the text",
                param="input",
            )
        texts = [item for item in req.input if isinstance(item, str)]
        limit = self._settings.max_inputs
        if len(texts) > limit:
            raise InvalidRequest(
                f"`input` holds {len(texts)} texts; this appliance takes at most {limit} per "
                "request (embeddings.max_inputs): split it",
                param="input",
            )
        return texts

    async def _record(self, embedded: Embedded, key: ApiKey, route: str, seconds: float) -> None:
        ref = embedded.model.ref
        result = embedded.result
        self._metrics.embedding_inputs.labels(ref).inc(len(result))
        self._metrics.prompt_tokens.labels(ref).inc(result.prompt_tokens)
        event = UsageEvent(
            account_id=key.account.id,
            key_prefix=key.prefix,
            route=route,
            model=ref,
            tokens_in=result.prompt_tokens,
            tokens_out=0,
            ttft_ms=None,
            duration_ms=seconds * 1000,
            status=200,
            finish_reason=None,
            id=embedded.id,
        )
        await self._store.run(self._store.sync.record_usage, event)


# -- OpenAI response shape ----------------------------------------------------------------


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def response_body(embedded: Embedded) -> dict[str, Any]:
    """OpenAI's embeddings list. Builds a list of every float: call it off the event loop
    for large requests."""
    result = embedded.result
    vectors: list[str] | list[list[float]] = (
        result.to_base64() if embedded.encoding_format == "base64" else result.to_lists()
    )
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": vector}
            for i, vector in enumerate(vectors)
        ],
        "model": embedded.model.ref,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }
