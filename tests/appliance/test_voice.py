"""Narration voices: the neural voice (a Piper voice file run by onnxruntime, the one the
`voice` extra installs) reads a text into a WAV that decodes whole with a plausible
duration, the same bytes every time; languages it does not speak go to espeak-ng."""

from __future__ import annotations

import io
import wave
from typing import TYPE_CHECKING

import pytest

from appliance.packages.checks import check_audio
from appliance.packages.voice import Espeak, Neural, Voices, phoneme_ids
from appliance.settings import PackageSettings
from shared.errors import ModelUnavailable

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.skipif(not Espeak.available(), reason="espeak-ng: run `just setup`")
TEXT = "Which planet is closest to the Sun? A: Mercury. B: Venus, or C: Mars."


def test_phoneme_ids_pad_every_phoneme_and_skip_unknown_ones() -> None:
    id_map = {"_": [0], "^": [1], "$": [2], "a": [5], "b": [6], " ": [3]}
    assert phoneme_ids("ab a", id_map) == [1, 0, 5, 0, 6, 0, 3, 0, 5, 0, 2]
    assert phoneme_ids("a?b", id_map) == [1, 0, 5, 0, 6, 0, 2]  # "?" unknown: left out
    assert phoneme_ids("", id_map) == [1, 0, 2]


async def test_the_neural_voice_reads_plausibly_and_reproducibly() -> None:
    model = Neural.bundled()
    assert model is not None, "the `voice` extra is part of `just setup`"
    voice = Neural(model)
    assert voice.speaks("en")
    assert voice.speaks("en-GB")
    assert not voice.speaks("de")
    first = await voice.speak(TEXT, "en")
    assert first == await voice.speak(TEXT, "en")  # the same bytes every time
    with wave.open(io.BytesIO(first)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (22050, 1, 2)
        frames = wav.getnframes()
    assert 3.0 < frames / 22050 < 8.0
    assert check_audio(first, text=TEXT, item="x").passed
    # Clause pauses count: the same words without punctuation read faster.
    with wave.open(
        io.BytesIO(await voice.speak(TEXT.replace(",", "").replace(".", ""), "en"))
    ) as w:
        assert w.getnframes() < frames
    slower = Neural(model, rate_wpm=100)
    with wave.open(io.BytesIO(await slower.speak(TEXT, "en"))) as wav:
        assert wav.getnframes() > frames * 1.3
    version = await voice.version()  # the voice's release and its file's digest
    assert version.startswith("1.0.0@")
    assert len(version.split("@")[1]) == 12


async def test_the_voice_for_a_language(tmp_path: Path) -> None:
    default = Voices(PackageSettings())
    assert default.for_language("en") is default.espeak
    neural = Voices(PackageSettings(voice="neural"))
    assert isinstance(neural.for_language("en"), Neural)
    assert neural.for_language("fr") is neural.espeak  # the voice speaks English only
    broken = tmp_path / "voice.onnx"
    broken.write_bytes(b"not a model")
    (tmp_path / "voice.onnx.json").write_text('{"language": {"family": "en"}}')
    chosen = Voices(PackageSettings(voice="neural", neural_voice_model=broken))
    with pytest.raises(ModelUnavailable, match="not a voice file"):
        await chosen.for_language("en").speak("Hello.", "en")
