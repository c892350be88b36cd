"""`POST /v1/audio/speech`: the real voices (espeak-ng, and the neural voice the `voice`
extra installs) read into every format the appliance makes, decoded here by `wave` and
libsndfile; the audio streams as it is read; errors in the one shape; usage recorded.

The in-process appliance here serves no language model (`model.default` names none, so
its load fails at start): speech needs none, and the tests stay fast. The last test
drives a real appliance process (serving the scripted model, for it to be ready) with the
official `openai` package."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from typing import TYPE_CHECKING, Any

import openai
import pytest
import soundfile  # type: ignore[import-untyped]

from appliance.app import create_app
from appliance.gateway.speech import SPEECH
from appliance.inference.speech import OPENAI_VOICES, pieces
from appliance.packages.voice import Espeak, Neural
from appliance.serving.audio import STREAMING_SIZE, resample
from appliance.state.store import Store
from tests.conftest import SCRIPTED, ApplianceProcess, Client, make_settings, running_appliance

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from appliance.settings import ApplianceSettings
    from appliance.state.records import ModelRecord

pytestmark = pytest.mark.skipif(not Espeak.available(), reason="espeak-ng: run `just setup`")

PATH = "/v1/audio/speech"
TEXT = "Which planet is closest to the Sun? Mercury is, and it is the smallest one."
# Many sentences: reading them all takes the neural voice seconds.
LONG = " ".join(f"This is sentence number {n} of a long text, read aloud." for n in range(1, 13))


def settings_for(tmp_path: Path, **speech: object) -> ApplianceSettings:
    return make_settings(
        tmp_path / "data",
        model={"default": "no-language-model"},
        embeddings={"enabled": False},
        speech=speech,
    )


async def start(aiohttp_client: AiohttpClient, settings: ApplianceSettings) -> tuple[Client, str]:
    store = Store(settings.db_path)
    try:
        key = store.create_key("tester").plaintext
    finally:
        store.close()
    return await aiohttp_client(create_app(settings)), key


@pytest.fixture
def settings(tmp_path: Path) -> ApplianceSettings:
    return settings_for(tmp_path)


@pytest.fixture
async def appliance(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings
) -> tuple[Client, str]:
    return await start(aiohttp_client, settings)


async def speak(client: Client, key: str, **body: Any) -> tuple[int, dict[str, str], bytes]:
    response = await client.post(
        PATH, headers={"Authorization": f"Bearer {key}"}, json={"input": TEXT, **body}
    )
    return response.status, dict(response.headers), await response.read()


def usage(settings: ApplianceSettings) -> list[Any]:
    store = Store(settings.db_path)  # a second connection: what was committed
    try:
        return store.usage_events("tester")
    finally:
        store.close()


def wav_frames(data: bytes) -> tuple[int, bytes]:
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
        return wav.getframerate(), wav.readframes(wav.getnframes())


# -- the text in pieces -----------------------------------------------------------------------


def test_the_text_is_read_in_sentences_and_long_ones_at_clauses() -> None:
    assert pieces("  One. Two!  Three?\n\nFour; five 3.14 six  ") == [
        "One.",
        "Two!",
        "Three?",
        "Four;",
        "five 3.14 six",
    ]
    clause = "a clause of some length that goes on and on for quite a while"
    long = ", ".join([clause] * 8) + "."
    parts = pieces(long)
    assert len(parts) > 1
    assert all(len(part) <= 240 for part in parts)
    assert " ".join(parts) == long  # nothing lost, nothing added
    words = " ".join(["word"] * 200)
    assert " ".join(pieces(words)) == words
    assert all(len(part) <= 240 for part in pieces(words))


def test_resampling_keeps_the_length_and_the_tone() -> None:
    import numpy as np  # noqa: PLC0415

    t = np.arange(22050) / 22050
    tone = (np.sin(2 * np.pi * 440 * t) * 10000).astype("<i2")
    out = resample(tone, 22050, 24000)
    assert len(out) == 24000
    spectrum = np.abs(np.fft.rfft(out.astype(np.float64)))
    assert abs(int(np.argmax(spectrum)) - 440) <= 1  # 1 s long: a bin is 1 Hz


# -- formats ----------------------------------------------------------------------------------


async def test_wav_streams_with_an_unknown_length_header_and_decodes(
    appliance: tuple[Client, str],
) -> None:
    client, key = appliance
    status, headers, body = await speak(
        client, key, model="tts-1", voice="alloy", response_format="wav"
    )
    assert status == 200, body
    assert headers["Content-Type"] == "audio/wav"
    assert headers["Transfer-Encoding"] == "chunked"
    assert headers["X-Kvl-Model"].startswith("neural@1.0.0-")  # tts-1: the default voice
    assert headers["X-Kvl-Voice"] == "joe"
    assert body[4:8] == body[40:44] == STREAMING_SIZE.to_bytes(4, "little")
    rate, frames = wav_frames(body)
    assert rate == int(headers["X-Kvl-Sample-Rate"]) == 22050
    assert 2.5 < len(frames) / 2 / rate < 10


async def test_pcm_is_the_wav_without_its_header(appliance: tuple[Client, str]) -> None:
    client, key = appliance
    request = {"model": "espeak-ng", "voice": "en-us+f3"}
    status, headers, pcm = await speak(client, key, **request, response_format="pcm")
    assert status == 200, pcm
    assert headers["Content-Type"] == "audio/pcm"
    assert headers["X-Kvl-Sample-Rate"] == "22050"
    assert headers["X-Kvl-Model"].startswith("espeak-ng@1.")
    _, _, wav = await speak(client, key, **request, response_format="wav")
    assert len(pcm) > 22050
    assert len(pcm) % 2 == 0
    assert pcm == wav[44:]  # espeak-ng reads the same text the same way


@pytest.mark.parametrize(
    ("fmt", "rate", "mime"),
    [("flac", 22050, "audio/flac"), ("mp3", 22050, "audio/mpeg"), ("opus", 24000, "audio/ogg")],
)
async def test_compressed_formats_decode_to_the_length_of_the_wav(
    appliance: tuple[Client, str], fmt: str, rate: int, mime: str
) -> None:
    client, key = appliance
    request = {"model": "espeak-ng", "voice": "nova"}
    _, _, wav = await speak(client, key, **request, response_format="wav")
    wav_rate, frames = wav_frames(wav)
    seconds = len(frames) / 2 / wav_rate
    status, headers, body = await speak(client, key, **request, response_format=fmt)
    assert status == 200, body
    assert headers["Content-Type"] == mime
    assert headers["X-Kvl-Sample-Rate"] == str(rate)
    if fmt == "flac":  # made whole: its length is in its header and the response's
        assert headers["Content-Length"] == str(len(body))
    else:
        assert headers["Transfer-Encoding"] == "chunked"
    audio, decoded_rate = soundfile.read(io.BytesIO(body), dtype="int16")
    assert decoded_rate == rate
    # The encoders add a few ms of padding (mp3's delay, opus's pre-skip), never a piece.
    assert abs(len(audio) / rate - seconds) < 0.2
    if fmt == "flac":  # lossless
        assert audio.tobytes() == frames


async def test_speed_scales_both_voices(appliance: tuple[Client, str]) -> None:
    client, key = appliance
    for model, voice in (("espeak-ng", "echo"), ("neural", "joe")):
        lengths = {}
        for speed in (0.25, 1.0, 2.0):
            status, _, body = await speak(
                client, key, model=model, voice=voice, response_format="pcm", speed=speed
            )
            assert status == 200, body
            lengths[speed] = len(body)
        assert lengths[2.0] < lengths[1.0] * 0.7, (model, lengths)
        assert lengths[0.25] > lengths[1.0] * 2, (model, lengths)


async def test_every_openai_voice_and_an_espeak_language(appliance: tuple[Client, str]) -> None:
    client, key = appliance
    seen = set()
    for voice in (*OPENAI_VOICES, "de", "en-gb-x-rp+m1"):
        status, _, body = await speak(
            client, key, model="espeak-ng", voice=voice, response_format="pcm", input="Hallo."
        )
        assert status == 200, (voice, body)
        assert len(body) > 0
        seen.add(body)
    assert len(seen) > 10  # the voices sound different


async def test_sse_sends_base64_audio_then_the_usage(appliance: tuple[Client, str]) -> None:
    client, key = appliance
    response = await client.post(
        PATH,
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": "gpt-4o-mini-tts",
            "input": TEXT,
            "voice": "coral",
            "response_format": "wav",
            "stream_format": "sse",
            "instructions": "Speak cheerfully.",  # accepted, and ignored
        },
    )
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = [
        json.loads(line.removeprefix(b"data: "))
        async for line in response.content
        if line.startswith(b"data: ")
    ]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    rate, frames = wav_frames(audio)
    assert rate == 22050
    assert len(frames) > rate
    assert events[-1]["usage"] == {
        "input_tokens": len(TEXT),
        "output_tokens": 0,
        "total_tokens": len(TEXT),
    }


# -- streaming, usage and bounds ----------------------------------------------------------------


async def test_the_first_audio_goes_out_before_the_text_is_read(
    appliance: tuple[Client, str], settings: ApplianceSettings
) -> None:
    client, key = appliance
    response = await client.post(
        PATH,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "neural", "voice": "joe", "input": LONG, "response_format": "pcm"},
    )
    assert response.status == 200
    first = await response.content.readany()
    assert first
    # The usage is committed once the whole text is read: not yet.
    assert usage(settings) == []
    assert client.app[SPEECH].in_progress == 1
    rest = await response.read()
    assert len(first) < len(first) + len(rest)
    events = usage(settings)
    assert len(events) == 1
    event = events[0]
    assert (event.route, event.tokens_in, event.tokens_out, event.status) == (
        PATH,
        len(LONG),
        0,
        200,
    )
    assert event.model == response.headers["X-Kvl-Model"]
    assert event.ttft_ms is not None
    assert event.ttft_ms < event.duration_ms
    assert client.app[SPEECH].in_progress == 0
    metrics = await (await client.get("/metrics")).text()
    assert f'kvl_speech_characters_total{{engine="neural"}} {len(LONG)}.0' in metrics


async def test_a_client_that_leaves_is_charged_what_was_read(
    appliance: tuple[Client, str], settings: ApplianceSettings
) -> None:
    client, key = appliance
    response = await client.post(
        PATH,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "neural", "voice": "joe", "input": LONG, "response_format": "wav"},
    )
    assert await response.content.readany()
    response.close()
    # The server notices at its next write, and commits the usage as the request ends.
    await asyncio.wait_for(client.app[SPEECH].drained(), 60)
    events = usage(settings)
    assert len(events) == 1
    assert events[0].status == 499
    assert 0 < events[0].tokens_in < len(LONG)


async def test_requests_past_the_bound_get_429(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    client, key = await start(aiohttp_client, settings_for(tmp_path, max_concurrent=1, max_queue=0))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "neural", "voice": "joe", "response_format": "pcm"}
    held = await client.post(PATH, headers=headers, json={**body, "input": LONG})
    assert held.status == 200
    assert await held.content.readany()
    refused = await client.post(PATH, headers=headers, json={**body, "input": "Hello."})
    assert refused.status == 429
    assert refused.headers["Retry-After"] == "1"
    assert (await refused.json())["error"]["code"] == "queue_full"
    held.close()  # its slot comes free as it ends (not read whole: seconds of synthesis)
    await asyncio.wait_for(client.app[SPEECH].drained(), 60)
    after = await client.post(PATH, headers=headers, json={**body, "input": "Hello."})
    assert after.status == 200


async def test_characters_count_against_the_daily_tokens(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    settings = make_settings(
        tmp_path / "data",
        model={"default": "no-language-model"},
        embeddings={"enabled": False},
        classes={"s1": {"tokens_per_day": len(TEXT) + 10}},
    )
    client, key = await start(aiohttp_client, settings)
    body = {"model": "espeak-ng", "voice": "alloy", "response_format": "pcm"}
    status, _, _ = await speak(client, key, **body)
    assert status == 200
    status, _, _ = await speak(client, key, **body, input="Ten chars.")  # to the limit
    assert status == 200
    status, headers, raw = await speak(client, key, **body)
    assert status == 429
    assert json.loads(raw)["error"]["code"] == "insufficient_quota"
    assert "Retry-After" in headers


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        ({"input": ""}, 400, "invalid_value", "input"),
        ({"input": " \n "}, 400, "invalid_value", "input"),
        ({"input": "x" * 4097}, 400, "invalid_value", "input"),
        ({"voice": "nobody"}, 400, "invalid_value", "voice"),
        ({"voice": "en-us+nosuchvariant"}, 400, "invalid_value", "voice"),
        ({"voice": "xx-yy"}, 400, "invalid_value", "voice"),
        ({"model": "espeak-ng", "voice": "joe"}, 400, "invalid_value", "voice"),
        ({"model": "neural", "voice": "de"}, 400, "invalid_value", "voice"),
        ({"response_format": "aac"}, 400, "unsupported_parameter", "response_format"),
        ({"response_format": "ogg"}, 400, "invalid_value", "response_format"),
        ({"speed": 4.5}, 400, "invalid_value", "speed"),
        ({"speed": 0.1}, 400, "invalid_value", "speed"),
        ({"stream_format": "chunks"}, 400, "invalid_value", "stream_format"),
        ({"model": "whisper-1"}, 404, "model_not_found", "model"),
        ({"language": "en"}, 400, "unknown_parameter", "language"),
        ({"voice": None}, 400, "invalid_value", "voice"),
    ],
)
async def test_bad_requests_get_the_error_shape(
    appliance: tuple[Client, str],
    settings: ApplianceSettings,
    case: tuple[dict[str, Any], int, str, str],
) -> None:
    client, key = appliance
    body, status, code, param = case
    got, _, raw = await speak(client, key, **{"model": "tts-1", "voice": "alloy", **body})
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert usage(settings) == []


async def test_a_missing_voice_is_named(appliance: tuple[Client, str]) -> None:
    client, key = appliance
    status, _, raw = await speak(client, key, model="tts-1")
    assert status == 400
    assert json.loads(raw)["error"]["code"] == "missing_required_parameter"
    assert json.loads(raw)["error"]["param"] == "voice"


async def test_speech_needs_a_valid_key(appliance: tuple[Client, str]) -> None:
    client, _ = appliance
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT}
    for headers, code in (
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer kvl_not-a-key"}, "invalid_api_key"),
    ):
        response = await client.post(PATH, headers=headers, json=body)
        assert response.status == 401
        assert (await response.json())["error"]["code"] == code


async def test_speech_off_is_no_model(aiohttp_client: AiohttpClient, tmp_path: Path) -> None:
    client, key = await start(aiohttp_client, settings_for(tmp_path, enabled=False))
    status, _, raw = await speak(client, key, model="tts-1", voice="alloy")
    assert status == 404
    assert json.loads(raw)["error"]["code"] == "model_not_found"


async def test_the_default_voice_is_a_setting(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    client, key = await start(aiohttp_client, settings_for(tmp_path, default_model="espeak-ng"))
    status, headers, _ = await speak(client, key, model="tts-1-hd", voice="alloy")
    assert status == 200
    assert headers["X-Kvl-Model"].startswith("espeak-ng@")
    assert headers["X-Kvl-Voice"] == "en-us"
    status, headers, _ = await speak(client, key, model="tts-1-hd", voice="joe")
    assert status == 200
    assert headers["X-Kvl-Voice"] == "joe"  # the neural voice, by its own name


# -- the official SDK against a real appliance process ---------------------------------------------


@pytest.fixture(scope="module")
def speech_process(
    tmp_path_factory: pytest.TempPathFactory, scripted_model: ModelRecord
) -> Iterator[ApplianceProcess]:
    """`kvl appliance serve` as a real process on loopback, serving the scripted model: a
    process is ready only once its language model is, and speech needs no real one."""
    data_dir = tmp_path_factory.mktemp("speech-appliance")
    store = Store(data_dir / "appliance.db")
    try:
        store.add_model(scripted_model)
        key = store.create_key("sdk").plaintext
    finally:
        store.close()
    env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_MODEL__DEFAULT": SCRIPTED,
        "KVL_MODEL__CHAT_DEFAULT": SCRIPTED,
    }
    with running_appliance(data_dir, key, env) as appliance:
        yield appliance


def test_the_openai_sdk_reads_speech(speech_process: ApplianceProcess) -> None:
    assert Neural.bundled() is not None
    sdk = openai.OpenAI(
        base_url=f"{speech_process.base_url}/v1", api_key=speech_process.key, max_retries=0
    )
    whole = sdk.audio.speech.create(
        model="tts-1", voice="alloy", input=TEXT, response_format="wav", speed=1.25
    )
    rate, frames = wav_frames(whole.content)
    assert rate == 22050
    assert len(frames) > rate
    with sdk.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="nova", input=TEXT, response_format="mp3"
    ) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        chunks = list(response.iter_bytes())
    audio, decoded_rate = soundfile.read(io.BytesIO(b"".join(chunks)), dtype="int16")
    assert decoded_rate == 22050
    assert len(audio) > decoded_rate
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="aac")
    assert refused.value.code == "unsupported_parameter"
