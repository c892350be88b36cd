"""What OpenAI clients expect of the LAN API beyond one plain choice: fields it does not
know, a missing or aliased `model`, the model list, several choices, logprobs, samplers,
CORS and keep-alives. A real appliance in process, on the scripted models (the API is the
subject); the samplers' effect on the real default model."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any

import pytest

from appliance.app import create_app
from appliance.gateway.appkeys import EMBEDDINGS, REGISTRY
from appliance.serving.catalog import CHAT_MODEL_NAME, DEFAULT_MODEL_NAME
from appliance.state.store import Store
from shared.errors import ErrorCode
from tests.conftest import SCRIPTED, SLOW, make_settings

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp.test_utils import TestClient
    from pytest_aiohttp import AiohttpClient

    from appliance.state.records import ModelRecord

    Client = TestClient[Any, Any]

MODEL = SCRIPTED
CHAT_MODEL = "scripted-chat"  # the scripted model under another name, the chat default
GEMMA = DEFAULT_MODEL_NAME
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
HELLO = [{"role": "user", "content": "Say hello."}]


async def appliance(
    aiohttp_client: AiohttpClient,
    data: Path,
    records: list[ModelRecord],
    **sections: dict[str, object],
) -> tuple[Client, str]:
    settings = make_settings(data, **sections)
    store = Store(settings.db_path)
    for record in records:
        store.add_model(record)
    key = store.create_key("tester").plaintext
    store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    await app[EMBEDDINGS].wait_loaded()
    assert app[REGISTRY].ready, app[REGISTRY].load_error
    return client, key


@pytest.fixture
async def lan(
    aiohttp_client: AiohttpClient, tmp_path: Path, scripted_models: list[ModelRecord]
) -> tuple[Client, str]:
    chat = dataclasses.replace(scripted_models[0], name=CHAT_MODEL)
    return await appliance(
        aiohttp_client,
        tmp_path / "data",
        [*scripted_models, chat],
        model={
            "chat_default": CHAT_MODEL,
            "aliases": {"gpt-4o-mini": MODEL, "text-embedding-3-small": EMBEDDING_MODEL},
        },
        server={"cors_origins": ["http://app.example:3000"], "sse_keepalive_s": 0.005},
    )


async def post(client: Client, key: str, path: str, body: dict[str, Any]) -> Any:
    response = await client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
    return response, await response.json()


async def test_fields_it_does_not_know_are_ignored_and_named(lan: tuple[Client, str]) -> None:
    client, key = lan
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 4,
        "cache_prompt": True,  # llama-server's
        "store": False,  # OpenAI's, meaningless here
        "mirostat": 0,
    }
    response, out = await post(client, key, "/v1/chat/completions", body)
    assert response.status == 200, out
    assert response.headers["Kvl-Ignored-Parameters"] == "cache_prompt, mirostat, store"
    assert out["system_fingerprint"].startswith("fp_")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


async def test_strict_mode_refuses_what_it_does_not_know(
    aiohttp_client: AiohttpClient, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    client, key = await appliance(
        aiohttp_client, tmp_path / "data", [scripted_model], server={"strict_parameters": True}
    )
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "mirostat": 0}
    response, out = await post(client, key, "/v1/chat/completions", body)
    assert response.status == 400
    assert out["error"]["code"] == ErrorCode.unknown_parameter
    assert out["error"]["param"] == "mirostat"


async def test_model_may_be_omitted_or_an_alias(lan: tuple[Client, str]) -> None:
    client, key = lan
    # Without `model`, chat goes to the chat model (loaded on first use), text to the default.
    for path, model, served in (
        ("/v1/chat/completions", None, CHAT_MODEL),
        ("/v1/chat/completions", "gpt-4o-mini", MODEL),
        ("/v1/completions", None, MODEL),
    ):
        body: dict[str, Any] = {"max_tokens": 3, "temperature": 0}
        body |= {"messages": HELLO} if "chat" in path else {"prompt": "Hello"}
        if model is not None:
            body["model"] = model
        response, out = await post(client, key, path, body)
        assert response.status == 200, out
        assert out["model"].startswith(served + "@")
    response, out = await post(
        client, key, "/v1/embeddings", {"model": "text-embedding-3-small", "input": "hi"}
    )
    assert response.status == 200, out
    assert len(out["data"][0]["embedding"]) == 384
    response, out = await post(client, key, "/v1/embeddings", {"input": "hi"})
    assert response.status == 200, out


async def test_models_are_listed_once_each_with_their_aliases(lan: tuple[Client, str]) -> None:
    client, key = lan
    auth = {"Authorization": f"Bearer {key}"}
    listed = await (await client.get("/v1/models", headers=auth)).json()
    ids = [m["id"] for m in listed["data"]]
    assert len(ids) == len(set(ids))
    # By id, the embedding model after them: the registered ones (the chat model not loaded
    # yet) and the embedded ones this appliance has not registered.
    assert ids[:6] == [GEMMA, MODEL, CHAT_MODEL, SLOW, CHAT_MODEL_NAME, EMBEDDING_MODEL]
    by_id = {m["id"]: m for m in listed["data"]}
    assert by_id[MODEL]["state"] == "ready"
    assert by_id[MODEL]["aliases"] == ["gpt-4o-mini"]
    assert by_id["gpt-4o-mini"]["alias_of"] == MODEL
    assert by_id["text-embedding-3-small"]["alias_of"] == EMBEDDING_MODEL
    # `created`: when each was registered here (or, shipped in a package, installed); an
    # alias's is its model's. Unix seconds, as OpenAI's.
    created = {m["id"]: m["created"] for m in listed["data"]}
    assert all(1_600_000_000 < c <= time.time() + 1 for c in created.values()), created
    assert created["gpt-4o-mini"] == created[MODEL]
    assert created["text-embedding-3-small"] == created[EMBEDDING_MODEL]
    for name in (MODEL, by_id[MODEL]["ref"], "gpt-4o-mini"):
        response = await client.get(f"/v1/models/{name}", headers=auth)
        assert response.status == 200
        assert (await response.json())["object"] == "model"
    response = await client.get("/v1/models/no-such-model", headers=auth)
    assert response.status == 404
    assert (await response.json())["error"]["code"] == ErrorCode.model_not_found


async def test_a_registered_model_that_is_not_loaded_is_listed_as_such(
    aiohttp_client: AiohttpClient, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    client, key = await appliance(aiohttp_client, tmp_path / "data", [scripted_model])
    store = Store(tmp_path / "data" / "appliance.db")
    try:
        other = dataclasses.replace(scripted_model, name="spare", version="2")
        store.add_model(other)
    finally:
        store.close()
    listed = await (
        await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    ).json()
    by_id = {m["id"]: m for m in listed["data"]}
    assert by_id["spare"]["state"] == "unloaded"
    assert by_id["spare"]["ref"] == "spare@2"


async def test_several_choices(lan: tuple[Client, str]) -> None:
    client, key = lan
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 6, "n": 3, "seed": 7}
    response, out = await post(client, key, "/v1/chat/completions", body)
    assert response.status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] for c in out["choices"])
    assert out["usage"]["completion_tokens"] <= 3 * 6
    assert out["usage"]["completion_tokens"] >= 3
    # Streamed: every choice opens, its deltas say which it is, each ends with a reason.
    response = await client.post(
        "/v1/chat/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
    )
    chunks = [json.loads(line[6:]) for line in (await response.text()).splitlines()
              if line.startswith("data: {")]  # fmt: skip
    reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
               if c["choices"] and c["choices"][0]["finish_reason"]}  # fmt: skip
    assert sorted(reasons) == [0, 1, 2]
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert all(texts)


async def test_logprobs_of_chat_and_text(lan: tuple[Client, str]) -> None:
    client, key = lan
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    response, out = await post(client, key, "/v1/chat/completions", body)
    assert response.status == 200, out
    entries = out["choices"][0]["logprobs"]["content"]
    assert len(entries) == out["usage"]["completion_tokens"]
    for entry in entries:
        assert entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the token chosen is the most likely one.
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    assert "".join(e["token"] for e in entries) == out["choices"][0]["message"]["content"]
    response, out = await post(
        client,
        key,
        "/v1/completions",
        {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0, "logprobs": 2},
    )
    assert response.status == 200, out
    legacy = out["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"])
    assert all(len(top) <= 2 for top in legacy["top_logprobs"])


@pytest.mark.model
async def test_logit_bias_and_samplers(
    aiohttp_client: AiohttpClient, tmp_path: Path, default_model: ModelRecord
) -> None:
    # On the real model: what the samplers do to its distribution is the subject (a
    # scripted model ignores them).
    client, key = await appliance(
        aiohttp_client,
        tmp_path / "data",
        [default_model],
        model={"default": GEMMA, "chat_default": CHAT_MODEL_NAME},
    )
    base = {"model": GEMMA, "prompt": "One, two,", "max_tokens": 1, "temperature": 0}
    response, out = await post(client, key, "/v1/completions", {**base, "logprobs": 0})
    assert response.status == 200, out
    greedy = out["choices"][0]["text"]
    assert out["choices"][0]["logprobs"]["tokens"] == [greedy]
    app = client.app
    assert app is not None
    vocab = app[REGISTRY].loaded_models()[0].require_vocab()
    banned = vocab.tokenize(greedy, chat=False)[-1]
    forced = vocab.tokenize(" banana", chat=False)[-1]
    response, out = await post(
        client, key, "/v1/completions", {**base, "logit_bias": {str(banned): -100}}
    )
    assert response.status == 200, out
    assert out["choices"][0]["text"] != greedy
    response, out = await post(
        client, key, "/v1/completions", {**base, "logit_bias": {str(forced): 100}}
    )
    assert response.status == 200, out
    assert out["choices"][0]["text"] == vocab.piece(forced).decode()
    response, out = await post(
        client,
        key,
        "/v1/chat/completions",
        {
            "model": GEMMA,
            "messages": HELLO,
            "max_tokens": 2,
            "top_k": 1,
            "min_p": 0.05,
            "repeat_penalty": 1.1,
            "repeat_last_n": 32,
        },
    )
    assert response.status == 200, out
    assert "Kvl-Ignored-Parameters" not in response.headers


async def test_cors_preflight_and_headers(lan: tuple[Client, str]) -> None:
    client, key = lan
    preflight = await client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://app.example:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )
    assert preflight.status == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == "http://app.example:3000"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert "x-stainless-os" in preflight.headers["Access-Control-Allow-Headers"]
    refused = await client.options(
        "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert refused.status == 403
    assert "Access-Control-Allow-Origin" not in refused.headers
    # Answers, errors and streams alike, carry the headers to an allowed origin only.
    for origin, allowed in (("http://app.example:3000", True), ("http://evil.example", False)):
        headers = {"Origin": origin, "Authorization": f"Bearer {key}"}
        models = await client.get("/v1/models", headers=headers)
        unauthenticated = await client.get("/v1/models", headers={"Origin": origin})
        stream = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": HELLO, "max_tokens": 2, "stream": True},
            headers=headers,
        )
        await stream.read()
        for response in (models, unauthenticated, stream):
            assert ("Access-Control-Allow-Origin" in response.headers) is allowed


async def test_a_stream_gets_keepalive_comments_while_it_waits(lan: tuple[Client, str]) -> None:
    client, key = lan
    response = await client.post(
        "/v1/chat/completions",
        json={"model": SLOW, "messages": HELLO, "max_tokens": 16, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
    )
    raw = (await response.read()).decode()
    # Keep-alives every 5 ms: the slow scripted model takes 20 ms a token.
    assert ": keep-alive\n\n" in raw
    assert raw.rstrip().endswith("data: [DONE]")
    events = [line for line in raw.split("\n\n") if line.startswith("data: {")]
    assert all(json.loads(line[6:])["object"] == "chat.completion.chunk" for line in events)
