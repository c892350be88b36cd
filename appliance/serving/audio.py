"""Speech audio, encoded as it is synthesised: 16-bit mono PCM in, the bytes of a response
format out, piece by piece, so a stream can send each piece as soon as it is read.

`wav` and `pcm` are written here; `mp3`, `opus` (Ogg) and `flac` by libsndfile (the
`soundfile` wheel bundles it with LAME, Opus and FLAC). libsndfile writes each piece as
it comes, except for what it goes back to fix at the end: a WAV's sizes, an MP3's
LAME tag, FLAC's stream info (length and MD5). A stream cannot take back what it sent, so:

- `wav` states "length unknown" (0xFFFFFFFF, as OpenAI's stream does): every reader
  reads such a file to its end.
- `mp3` is constant bitrate, whose length a reader takes from its size; the tag's
  frame, sent blank, decodes as silence.
- `flac` is sent whole once it is done: a FLAC stream of unknown length decodes in
  ffmpeg but not in libsndfile (`soundfile.read` refuses it).
- `opus` takes 8, 12, 16, 24 or 48 kHz only: each piece is resampled to 24 kHz
  (band-limited, by FFT; the pieces are utterances that begin and end in silence).

No aiohttp here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, NamedTuple

# libsndfile's settings for each format; `mime` as OpenAI answers.
_MP3_BITRATE = 0.7  # libsndfile's compression level 0..1: 0.7 is 56 kbit/s at 22 kHz, mono
OPUS_RATE = 24_000
STREAMING_SIZE = 0xFFFFFFFF


class Pcm(NamedTuple):
    """Audio as 16-bit little-endian mono samples at a sample rate."""

    samples: bytes
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / 2 / self.sample_rate


_OPTIONS: dict[str, dict[str, Any]] = {
    "mp3": {
        "format": "MP3",
        "subtype": "MPEG_LAYER_III",
        "bitrate_mode": "CONSTANT",
        "compression_level": _MP3_BITRATE,
    },
    "opus": {"format": "OGG", "subtype": "OPUS"},
    "flac": {"format": "FLAC", "subtype": "PCM_16"},
}


@dataclass(frozen=True)
class Format:
    name: str
    mime: str
    streams: bool  # its bytes go out as they are made, not once the whole is done


FORMATS: dict[str, Format] = {
    "wav": Format("wav", "audio/wav", streams=True),
    "pcm": Format("pcm", "audio/pcm", streams=True),
    "mp3": Format("mp3", "audio/mpeg", streams=True),
    "opus": Format("opus", "audio/ogg", streams=True),
    "flac": Format("flac", "audio/flac", streams=False),
}


def wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "as long as the stream"."""
    block = 2
    return b"".join(
        (
            b"RIFF",
            STREAMING_SIZE.to_bytes(4, "little"),
            b"WAVEfmt ",
            (16).to_bytes(4, "little"),
            (1).to_bytes(2, "little"),  # PCM
            (1).to_bytes(2, "little"),  # mono
            sample_rate.to_bytes(4, "little"),
            (sample_rate * block).to_bytes(4, "little"),
            block.to_bytes(2, "little"),
            (16).to_bytes(2, "little"),
            b"data",
            STREAMING_SIZE.to_bytes(4, "little"),
        )
    )


class Encoder:
    """One response's encoder: :meth:`feed` each piece of PCM, then :meth:`finish`; each
    returns the bytes ready to send (maybe none). Not thread-safe: one thread at a time
    (the encoders of libsndfile run off the event loop)."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"no encoder for {fmt!r}")
        self.format = FORMATS[fmt]
        self.sample_rate = sample_rate
        self._started = False
        self._file: _Tail | None = None
        self._sound: Any = None  # a soundfile.SoundFile (the package has no types)

    @property
    def output_rate(self) -> int:
        """The sample rate of the encoded audio."""
        return OPUS_RATE if self.format.name == "opus" else self.sample_rate

    def feed(self, pcm: bytes) -> bytes:
        head = self._start()
        if self._sound is None:
            return head + pcm
        import numpy as np  # noqa: PLC0415

        samples = np.frombuffer(pcm, dtype="<i2")
        if self.format.name == "opus" and self.sample_rate != OPUS_RATE:
            samples = resample(samples, self.sample_rate, OPUS_RATE)
        self._sound.write(samples)
        return head + self._take()

    def finish(self) -> bytes:
        head = self._start()
        if self._sound is None:
            return head
        self._sound.close()
        return head + self._take(whole=True)

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        name = self.format.name
        if name == "wav":
            return wav_header(self.sample_rate)
        if name == "pcm":
            return b""
        import soundfile  # type: ignore[import-untyped]  # noqa: PLC0415

        self._file = _Tail()
        options: dict[str, Any] = _OPTIONS[name]
        self._sound = soundfile.SoundFile(
            self._file, "w", samplerate=self.output_rate, channels=1, **options
        )
        return b""

    def _take(self, *, whole: bool = False) -> bytes:
        if self._file is None:  # pragma: no cover - set with the sound file
            return b""
        if not self.format.streams:
            return self._file.everything() if whole else b""
        return self._file.take()


class _Tail(io.RawIOBase):
    """A file libsndfile writes into, read from its end: :meth:`take` gives what was
    appended since the last call. What libsndfile goes back to rewrite lands in the
    buffer, so :meth:`everything` is the file as a seekable one would hold it."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = bytearray()
        self._position = 0
        self._sent = 0

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._buffer)}
        self._position = max(0, base[whence] + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        data = self._buffer[self._position : self._position + len(buffer)]
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._buffer[self._position : self._position + len(chunk)] = chunk
        self._position += len(chunk)
        return len(chunk)

    def take(self) -> bytes:
        out = bytes(self._buffer[self._sent :])
        self._sent = len(self._buffer)
        return out

    def everything(self) -> bytes:
        return bytes(self._buffer)


def resample(samples: Any, source: int, target: int) -> Any:
    """16-bit samples at another rate, band-limited (by FFT, zero-padded or cut)."""
    import numpy as np  # noqa: PLC0415

    if len(samples) == 0 or source == target:
        return samples
    length = round(len(samples) * target / source)
    spectrum = np.fft.rfft(samples.astype(np.float64))
    out = np.fft.irfft(spectrum, n=length) * (length / len(samples))
    return np.clip(np.round(out), -32768, 32767).astype("<i2")
