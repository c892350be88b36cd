"""`POST /v1/embeddings` in-process: a real aiohttp server on loopback, the real int8 model."""

from __future__ import annotations

import asyncio
import base64
import re
from typing import Any

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
from openai import AsyncOpenAI
from pytest_aiohttp import AiohttpClient

from appliance.app import create_app
from appliance.gateway.appkeys import EMBEDDINGS, SETTINGS
from appliance.serving.embeddings import DIMENSION, choose_providers
from appliance.settings import ApplianceSettings
from appliance.state.store import Store
from shared.errors import ErrorCode
from tests.conftest import Client
from tests.gateway import assert_error, auth, post

MODEL = "all-MiniLM-L6-v2"
PATH = "/v1/embeddings"

PAIRS = [
    ("A man is playing a guitar.", "Someone plays the guitar."),
    ("How do I reset my password?", "I forgot my password, how can I change it?"),
    ("The weather is lovely today.", "It is a beautiful sunny day."),
]
UNRELATED = "The central bank raised interest rates by half a point."
TEXTS = [
    "Hello, world!",
    "The cat sits on the mat.",
    "Embeddings map text to vectors for semantic search and clustering. " * 4,
    "short",
    "A quick brown fox jumps over the lazy dog.",
    "Héllo CAFÉ naïve 東京",
    "Quarterly revenue grew by twelve percent.",
    "x",
]


async def embed(client: Client, key: str, **body: Any) -> dict[str, Any]:
    status, reply, _ = await post(client, PATH, key, {"model": MODEL, **body})
    assert status == 200, reply
    return dict(reply)


def vectors(reply: dict[str, Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
    assert [item["index"] for item in reply["data"]] == list(range(len(reply["data"])))
    return np.array([item["embedding"] for item in reply["data"]], dtype=np.float32)


def _settings(settings: ApplianceSettings, **embeddings: object) -> ApplianceSettings:
    return ApplianceSettings.model_validate(
        {**settings.model_dump(), "embeddings": {**settings.embeddings.model_dump(), **embeddings}}
    )


def _metric(text: str, name: str, model: str) -> float:
    found = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.MULTILINE)
    assert found is not None, f"{name} for {model} is not in the metrics"
    return float(found.group(1))


# -- answers -----------------------------------------------------------------------------------


async def test_paraphrases_are_closer_than_unrelated_sentences(
    client: Client, api_key: str
) -> None:
    texts = [text for pair in PAIRS for text in pair] + [UNRELATED]
    reply = await embed(client, api_key, input=texts)
    assert reply["object"] == "list"
    assert reply["model"].startswith(f"{MODEL}@")
    assert all(item["object"] == "embedding" for item in reply["data"])
    found = vectors(reply)
    assert found.shape == (len(texts), DIMENSION)
    np.testing.assert_allclose(np.linalg.norm(found, axis=1), 1.0, atol=1e-5)
    other = found[-1]
    for i in range(len(PAIRS)):
        a, b = found[2 * i], found[2 * i + 1]
        assert float(a @ b) > float(a @ other) + 0.3
        assert float(a @ b) > float(b @ other) + 0.3
    usage = reply["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"]
    assert usage["prompt_tokens"] > 2 * len(texts)  # [CLS] and [SEP] at least, and words


async def test_a_string_input_is_one_vector(client: Client, api_key: str) -> None:
    one = await embed(client, api_key, input="Hello, world!")
    listed = await embed(client, api_key, input=["Hello, world!"])
    assert len(one["data"]) == 1
    np.testing.assert_allclose(vectors(one), vectors(listed), atol=1e-6)
    assert one["usage"]["prompt_tokens"] == 6  # [CLS] hello , world ! [SEP]


async def test_base64_decodes_to_the_same_floats(client: Client, api_key: str) -> None:
    floats = await embed(client, api_key, input=TEXTS[:3], encoding_format="float")
    encoded = await embed(client, api_key, input=TEXTS[:3], encoding_format="base64")
    decoded = np.array(
        [
            np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
            for item in encoded["data"]
        ]
    )
    assert decoded.shape == (3, DIMENSION)
    np.testing.assert_allclose(decoded, vectors(floats), atol=1e-6)
    assert encoded["usage"] == floats["usage"]


async def test_dimensions_of_the_model_and_a_versioned_name_are_accepted(
    client: Client, api_key: str
) -> None:
    plain = await embed(client, api_key, input="hi")
    versioned = await embed(client, api_key, input="hi", dimensions=DIMENSION, user="u1")
    assert versioned["model"] == plain["model"]
    status, again, _ = await post(client, PATH, api_key, {"model": plain["model"], "input": "hi"})
    assert status == 200, again
    np.testing.assert_allclose(vectors(again), vectors(plain), atol=1e-6)


async def test_long_texts_are_truncated_and_said_to_be(client: Client, api_key: str) -> None:
    response = await client.post(
        PATH, headers=auth(api_key), json={"model": MODEL, "input": ["word " * 400, "short"]}
    )
    assert response.status == 200
    assert response.headers["X-Kvl-Truncated-Inputs"] == "1"
    assert response.headers["X-Kvl-Model"].startswith(f"{MODEL}@")
    assert (await response.json())["usage"]["prompt_tokens"] == 256 + 3
    short = await client.post(PATH, headers=auth(api_key), json={"model": MODEL, "input": "hi"})
    assert "X-Kvl-Truncated-Inputs" not in short.headers


async def test_models_lists_the_embedding_model_and_its_provider(
    client: Client, api_key: str
) -> None:
    response = await client.get("/v1/models", headers=auth(api_key))
    models = {m["id"]: m for m in (await response.json())["data"]}
    model = models[MODEL]
    assert model["object"] == "model"
    assert model["format"] == "onnx"
    assert model["quantization"] == "int8"
    assert model["dimension"] == DIMENSION
    assert model["provider"] == choose_providers("auto", ort.get_available_providers())[0]
    assert model["ref"] == f"{MODEL}@{model['version']}"
    assert len(model["sha256"]) == 64
    ready = await (await client.get("/readyz")).json()
    assert model["ref"] in ready["models"]


async def test_usage_is_committed_before_the_response(
    client: Client, api_key: str, settings: ApplianceSettings
) -> None:
    reply = await embed(client, api_key, input=["one text", "and another"])
    store = Store(settings.db_path)  # a second connection sees it: it was committed
    try:
        events = store.usage_events("tester")
    finally:
        store.close()
    assert len(events) == 1
    assert events[0].route == PATH
    assert events[0].model == reply["model"]
    assert events[0].tokens_in == reply["usage"]["prompt_tokens"]
    assert events[0].tokens_out == 0
    assert events[0].status == 200


# -- batching ----------------------------------------------------------------------------------


async def test_concurrent_requests_are_batched_and_each_gets_its_own_vector(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    # A long window: the 16 requests below share runs however slowly this machine parses them.
    app = create_app(_settings(settings, max_wait_ms=500, max_batch_texts=16))
    client: Client = await aiohttp_client(app)
    await app[EMBEDDINGS].wait_loaded()
    texts = [f"{text} ({i})" for i, text in enumerate(TEXTS * 2)]
    replies = await asyncio.gather(*(embed(client, api_key, input=text) for text in texts))
    together = vectors(await embed(client, api_key, input=texts))  # one request, for reference
    for i, reply in enumerate(replies):
        np.testing.assert_allclose(vectors(reply)[0], together[i], atol=1e-5)

    metrics = await (await client.get("/metrics")).text()
    ref = replies[0]["model"]
    runs = _metric(metrics, "kvl_embedding_batch_requests_count", ref)
    assert _metric(metrics, "kvl_embedding_batch_requests_sum", ref) == len(texts) + 1
    assert runs < len(texts)  # fewer runs than requests: they were batched
    assert _metric(metrics, "kvl_embedding_batch_texts_sum", ref) == 2 * len(texts)
    assert _metric(metrics, "kvl_embedding_inputs_total", ref) == 2 * len(texts)
    provider = choose_providers("auto", ort.get_available_providers())[0]
    assert (
        f'kvl_embedding_model_info{{dimension="384",model="{ref}",provider="{provider}"}} 1.0'
        in metrics
    )
    assert _metric(metrics, "kvl_model_ready", ref) == 1.0


async def test_a_full_queue_is_429_with_retry_after(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    # The first request waits out the whole window alone in the queue; the others find it full.
    app = create_app(_settings(settings, max_wait_ms=1000, max_queue=1))
    client: Client = await aiohttp_client(app)
    await app[EMBEDDINGS].wait_loaded()
    outcomes = await asyncio.gather(
        *(post(client, PATH, api_key, {"model": MODEL, "input": f"text {i}"}) for i in range(3))
    )
    assert sorted(status for status, _, _ in outcomes) == [200, 429, 429]
    for status, body, headers in outcomes:
        if status == 429:
            assert_error(body, ErrorCode.queue_full)
            assert int(headers["Retry-After"]) >= 1


# -- errors ------------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[dict[str, Any], ErrorCode, str | None]] = [
    ({"input": ""}, ErrorCode.invalid_value, "input"),
    ({"input": []}, ErrorCode.invalid_value, "input"),
    ({"input": ["fine", ""]}, ErrorCode.invalid_value, "input[1]"),
    ({"input": 5}, ErrorCode.invalid_value, "input"),
    ({"input": None}, ErrorCode.invalid_value, "input"),
    ({"input": [{"text": "hi"}]}, ErrorCode.invalid_value, "input[0]"),
    ({"input": [101, 7592, 102]}, ErrorCode.unsupported_parameter, "input"),
    ({"input": [[101, 7592, 102]]}, ErrorCode.unsupported_parameter, "input"),
    ({"input": [[]]}, ErrorCode.invalid_value, "input[0]"),
    ({"input": ["a"] * 2049}, ErrorCode.invalid_value, "input"),
    ({"input": "hi", "model": "nope"}, ErrorCode.model_not_found, "model"),
    ({"input": "hi", "model": "gemma-3-270m"}, ErrorCode.model_not_found, "model"),
    ({"input": "hi", "model": f"{MODEL}@0.0.0"}, ErrorCode.model_not_found, "model"),
    ({"input": "hi", "model": ""}, ErrorCode.invalid_value, "model"),
    ({"input": "hi", "dimensions": 256}, ErrorCode.unsupported_parameter, "dimensions"),
    ({"input": "hi", "dimensions": 0}, ErrorCode.invalid_value, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, ErrorCode.invalid_value, "encoding_format"),
    ({"input": "hi", "prompt": "hi"}, ErrorCode.unknown_parameter, "prompt"),
    ({}, ErrorCode.missing_required_parameter, "input"),
]


@pytest.mark.parametrize(
    ("fields", "code", "param"), BAD_REQUESTS, ids=[repr(f)[:60] for f, _, _ in BAD_REQUESTS]
)
async def test_bad_requests_get_the_error_shape(
    client: Client, api_key: str, fields: dict[str, Any], code: ErrorCode, param: str | None
) -> None:
    status, body, _ = await post(client, PATH, api_key, {"model": MODEL, **fields})
    assert status == code.status, body
    assert_error(body, code, param)
    if code is ErrorCode.model_not_found:
        assert MODEL in body["error"]["message"]  # says what is served


async def test_bodies_that_are_not_json_objects_and_no_key(client: Client, api_key: str) -> None:
    for raw in [b"{", b"[]", b'{"model": "all-MiniLM-L6-v2", "input": "\\ud800"}']:
        response = await client.post(PATH, headers=auth(api_key), data=raw)
        assert response.status == 400
        assert_error(await response.json(), ErrorCode.invalid_json)
    response = await client.post(PATH, json={"model": MODEL, "input": "hi"})
    assert response.status == 401
    assert_error(await response.json(), ErrorCode.missing_api_key)


# -- the model's life --------------------------------------------------------------------------


async def test_the_appliance_answers_while_the_model_loads(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    app = create_app(settings)
    client: Client = await aiohttp_client(app)
    # The model loads in a thread in the background; right after start it is not loaded yet.
    assert (await client.get("/healthz")).status == 200
    status, body, headers = await post(client, PATH, api_key, {"model": MODEL, "input": "hi"})
    if not app[EMBEDDINGS].ready:
        assert status == 503
        assert_error(body, ErrorCode.model_not_ready)
        assert int(headers["Retry-After"]) >= 1
    await app[EMBEDDINGS].wait_loaded()
    assert (await post(client, PATH, api_key, {"model": MODEL, "input": "hi"}))[0] == 200


async def test_disabled_embeddings_are_model_not_found(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    app = create_app(_settings(settings, enabled=False))
    client: Client = await aiohttp_client(app)
    status, body, _ = await post(client, PATH, api_key, {"model": MODEL, "input": "hi"})
    assert status == 404
    assert_error(body, ErrorCode.model_not_found, "model")
    assert "embeddings.enabled" in body["error"]["message"]
    models = await (await client.get("/v1/models", headers=auth(api_key))).json()
    assert MODEL not in [m["id"] for m in models["data"]]


async def test_a_model_that_fails_to_load_is_503_and_not_ready(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime offers CUDA here, so provider `cuda` loads")
    app = create_app(_settings(settings, provider="cuda"))
    client: Client = await aiohttp_client(app)
    await app[EMBEDDINGS].wait_loaded()
    status, body, headers = await post(client, PATH, api_key, {"model": MODEL, "input": "hi"})
    assert status == 503
    assert_error(body, ErrorCode.model_not_ready)
    assert "onnxruntime-gpu" in body["error"]["message"]
    assert "Retry-After" not in headers  # retrying will not help: the settings must change
    ready = await client.get("/readyz")
    assert ready.status == 503
    assert_error(await ready.json(), ErrorCode.model_not_ready)
    assert (await client.get("/healthz")).status == 200


# -- the official SDK --------------------------------------------------------------------------


async def test_the_openai_sdk_embeds(client: Client, api_key: str) -> None:
    reference = vectors(await embed(client, api_key, input=["Hello, world!", "short"]))
    base_url = str(client.make_url("/v1"))
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as sdk:
        # The SDK asks for base64 unless told otherwise, and decodes it itself.
        default = await sdk.embeddings.create(model=MODEL, input=["Hello, world!", "short"])
        floats = await sdk.embeddings.create(model=MODEL, input="short", encoding_format="float")
    assert default.object == "list"
    assert [item.index for item in default.data] == [0, 1]
    np.testing.assert_allclose(
        np.array([item.embedding for item in default.data]), reference, atol=1e-6
    )
    np.testing.assert_allclose(floats.data[0].embedding, reference[1], atol=1e-6)
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0
    assert default.model.startswith(f"{MODEL}@")


async def test_similarities_to_a_topic_tell_on_topic_items_from_others(
    client: Client, api_key: str
) -> None:
    """What the packages' on_topic check relies on, with the real model: items about the
    topic score above the default minimum (0.25), items about something else below it;
    and it records no usage (it is the appliance's own call)."""
    service = client.app[EMBEDDINGS]
    await service.wait_loaded()
    on = ["Which fraction is larger, 2/3 or 3/4?", "What is one half plus one quarter?"]
    off = ["Which planet is closest to the Sun?", "What is the largest ocean?"]
    scores = await service.similarities("fractions", on + off)
    assert scores is not None
    assert min(scores[:2]) > 0.25 > max(scores[2:])
    store = Store(client.app[SETTINGS].db_path)
    try:
        assert store.outbox_lag() == 0
    finally:
        store.close()
