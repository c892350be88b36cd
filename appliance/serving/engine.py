"""What a generation is, on both sides of the worker boundary: requests, events, runs.

Also the model's :class:`Vocabulary` (tokenizer, token pieces, chat template), which the
gateway loads without weights and the worker uses for decoding: a GGUF model's is
:class:`LlamaVocabulary`, a scripted model's (appliance.serving.scripted) its bytes. The
decoding itself is in
appliance.serving.batching; llama-cpp-python's high-level ``create_completion`` is not
used: it cannot report a grammar that fails to compile (it would hand llama.cpp a NULL
sampler), counts no tokens while streaming, and measures no first-token time.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from appliance.serving.sampling_options import Sampling
from shared.chat import select_template
from shared.gguf import GGUFInfo, read_gguf

if TYPE_CHECKING:
    import asyncio

    from appliance.serving.predictor import InFlight
    from appliance.state.records import ModelRecord
    from shared.chat import ChatTemplate

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "cancelled"]


class EngineError(Exception):
    """Generation could not run."""


class QueueFullError(EngineError):
    def __init__(self, waiting: int, retry_after: float) -> None:
        super().__init__(f"{waiting} requests are already waiting for this model")
        self.waiting = waiting
        self.retry_after = retry_after


class NotLoadedError(EngineError):
    pass


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    grammar: str | None = None
    # Higher is admitted to a batch slot first (the service class: S0 = 0 … S4 = 4).
    priority: int = 0
    # None: no logprobs; k (0..20): each generated token's logprob and its k most likely
    # alternatives (TextDelta.logprobs).
    logprobs: int | None = None
    # Siblings with this exact prompt (OpenAI's ``n``) are submitted together: its KV is
    # computed once and copied to the others, however short it is (appliance.serving.prefix).
    share_prompt: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model (log-softmax of its raw logits,
    before any sampler), and the ``top`` most likely tokens there, most likely first. Token
    ids, not text: the gateway holds the vocabulary and renders the pieces."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    text: str
    # The tokens whose text this delta completes (only when the request asked for logprobs;
    # the text of a token may be held back and arrive with a later delta, and the last delta
    # of a generation may carry logprobs with no text). The end-of-generation token has none.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    duration_s: float
    text: str
    queue_s: float | None = None  # arrival to a slot; None if it never got one
    # Prompt tokens whose KV was not computed: copied from the shared prefix store, or kept
    # in the slot from the request before (cache_prompt).
    cached_tokens: int = 0


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = TextDelta | Finished


@dataclass(frozen=True)
class SlotChange:
    """The sequence took a batch slot (``holds``) or yielded it to a higher class. For the
    gateway's admission control; never part of a request's event stream."""

    holds: bool


Emit = Callable[[Event | Failed | SlotChange], None]


@dataclass(frozen=True)
class Job:
    """A generation handed to a worker's engine: its events go to ``emit`` (on the engine's
    thread); ``cancel`` set stops it at its next token."""

    request: GenerationRequest
    emit: Emit
    cancel: threading.Event


def _nowhere() -> InFlight | None:
    return None


class Run:
    """One submitted generation: an async iterator of its events, ending with Finished.

    ``cancel()`` stops the sequence at its next token; the iterator still ends with a
    Finished event (reason "cancelled") so the tokens spent can be counted.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_cancel: Callable[[], None] | None = None
    ) -> None:
        # The gateway's side of a generation: the model worker, which imports this module
        # too, never makes one, nor loads asyncio (about 7 MiB with ssl and its kin).
        import asyncio  # noqa: PLC0415

        self._loop = loop
        self._queue: asyncio.Queue[Event | Failed] = asyncio.Queue()
        self.cancelled = threading.Event()  # set by cancel(); read by the engine thread
        self._on_cancel = on_cancel
        self._done = False
        # It has held a batch slot (the worker says when): being served, not queued.
        self.seated = False
        # Where it stands now, for the door (set by its supervisor): queued or running, and
        # its place; None once it finished.
        self.flight: Callable[[], InFlight | None] = _nowhere

    def emit(self, event: Event | Failed) -> None:
        """Hand an event to the consumer; called from the engine thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def cancel(self) -> None:
        if not self.cancelled.is_set() and self._on_cancel is not None:
            self._on_cancel()
        self.cancelled.set()

    def fail(self, error: BaseException) -> None:
        """End the run with an error (from any thread)."""
        self.emit(Failed(error))

    def __aiter__(self) -> Run:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, Failed):
            self._done = True
            raise event.error
        if isinstance(event, Finished):
            self._done = True
        return event

    async def aclose(self) -> None:
        """Abandon the run: stop the sequence; nobody waits for its events."""
        self.cancel()
        self._done = True


@dataclass(frozen=True)
class EngineOptions:
    n_ctx: int = 4096  # per sequence
    n_slots: int = 1
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0
    max_queue: int = 16
    flash_attn: bool = True
    # The KV cache's element type: f16, or q8_0 / q4_0 (half or a quarter of the memory;
    # llama.cpp quantises the V half only with flash attention).
    kv_type: str = "f16"
    worker_nice: int = 10  # added to the worker's niceness (appliance.serving.worker)
    # A prompt prefix shared by at least this many tokens is computed once and its KV
    # copied to each sequence that starts with it (appliance.serving.prefix); 0: only for
    # requests that say they share their prompt (GenerationRequest.share_prompt).
    prefix_min_tokens: int = 64
    # Keep a slot's KV when its sequence ends, for a later prompt that starts with the same
    # tokens (a chat's next turn) to skip them (appliance.serving.scheduler, retain).
    cache_prompt: bool = False
    # Service classes: slots only S2 may take, and S0 sequences yielding to higher classes.
    reserved_slots: int = 0
    preemption: bool = True
    # Where the model file's last good check is noted (catalog.verify): a file unchanged
    # since is not hashed again at load. None: hashed at every load.
    stamps_dir: str | None = None


class Vocabulary(Protocol):
    """What the gateway needs of a model's vocabulary: prompts to tokens, tokens to text."""

    n_vocab: int
    chat_template: ChatTemplate

    def tokenize(self, text: str, *, chat: bool) -> list[int]: ...

    def piece(self, token: int, *, special: bool = False) -> bytes: ...

    def close(self) -> None: ...


class LlamaVocabulary:
    """A model's tokenizer and chat template, from its GGUF vocabulary.

    The gateway loads one with ``vocab_only`` (no weights) so it can render chat templates
    and count tokens without a round trip to the worker; the worker takes the one of the
    model it loaded (`of_model`), not a second copy: llama.cpp's vocabulary of Gemma 3's
    262,144 tokens is 44 MiB. llama.cpp's tokenizer only reads the vocabulary: thread-safe.
    """

    def __init__(self, handle: Any, info: GGUFInfo, release: Callable[[], None]) -> None:
        import llama_cpp  # noqa: PLC0415

        self.handle = handle
        self._release = release
        self._pieces: dict[int, bytes] = {}
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.handle))
        self._add_bos = bool(info.metadata.get("tokenizer.ggml.add_bos_token", True))
        bos = self.piece_text(llama_cpp.llama_vocab_bos(self.handle), special=True)
        eos = self.piece_text(llama_cpp.llama_vocab_eos(self.handle), special=True)
        self.chat_template = select_template(info.chat_template, info.architecture, bos, eos)

    @classmethod
    def load(cls, record: ModelRecord) -> LlamaVocabulary:
        """The vocabulary alone (no weights), through llama.cpp's C API as the worker loads
        its model: llama-cpp-python's ``Llama`` would bring the package's high-level half
        into the gateway (numpy, diskcache: see appliance/serving/llama_package.py).
        Blocking."""
        import llama_cpp  # noqa: PLC0415

        from appliance.serving import llama_log  # noqa: PLC0415

        # llama.cpp's log (the loader reports every key it reads, and warns of the
        # vocabulary's oddities) to the appliance's log, at debug level.
        llama_log.route()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        llama_cpp.llama_backend_init()
        model = llama_cpp.llama_model_load_from_file(record.path.encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not read the vocabulary of {record.path}")
        freed = False

        def release() -> None:
            nonlocal freed
            if not freed:
                freed = True
                llama_cpp.llama_model_free(model)

        return cls(llama_cpp.llama_model_get_vocab(model), read_gguf(Path(record.path)), release)

    @classmethod
    def of_model(cls, model: Any, record: ModelRecord) -> LlamaVocabulary:
        """The vocabulary of a model loaded whole (`llama_model_load_from_file`), which
        must outlive it. Blocking (reads the file's header)."""
        import llama_cpp  # noqa: PLC0415

        return cls(llama_cpp.llama_model_get_vocab(model), read_gguf(Path(record.path)), _nothing)

    def tokenize(self, text: str, *, chat: bool) -> list[int]:
        """Tokens of a prompt. Chat prompts come from the template, which writes BOS and
        control tokens itself, so they are parsed as special tokens; raw completion prompts
        are not (client text cannot forge control tokens) and get BOS if the model wants it.
        """
        data = text.encode("utf-8")
        if chat:
            return self._tokenize(data, add_special=False, parse_special=True)
        return self._tokenize(data, add_special=self._add_bos, parse_special=False)

    def _tokenize(self, data: bytes, *, add_special: bool, parse_special: bool) -> list[int]:
        import llama_cpp  # noqa: PLC0415

        size = len(data) + 2  # never more tokens than bytes, and BOS/EOS
        while True:
            tokens = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(
                self.handle, data, len(data), tokens, size, add_special, parse_special
            )
            if n >= 0:
                return list(tokens[:n])
            size = -n  # too small: llama.cpp says how many it needs

    def is_eog(self, token: int) -> bool:
        import llama_cpp  # noqa: PLC0415

        return bool(llama_cpp.llama_vocab_is_eog(self.handle, token))

    def piece(self, token: int, *, special: bool = False) -> bytes:
        cached = self._pieces.get(token) if not special else None
        if cached is not None:
            return cached
        import llama_cpp  # noqa: PLC0415

        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self.handle, token, buf, size, 0, special)
            if n >= 0:
                piece = buf.raw[:n]
                break
            size = -n
        if not special:
            self._pieces[token] = piece
        return piece

    def piece_text(self, token: int, *, special: bool) -> str:
        return self.piece(token, special=special).decode("utf-8", errors="replace")

    def close(self) -> None:
        self._release()


def _nothing() -> None:
    """What closing a loaded model's vocabulary does: the model owns it."""


def default_threads() -> int:
    """Physical cores, as llama-server picks; llama-cpp-python's own default is half the CPUs."""
    import psutil  # noqa: PLC0415 - the worker is given its threads, and needs no psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1
