"""The scripted model (appliance/serving/scripted.py): the whole appliance with no weights.

Other tests stand on it, so its own behaviour is checked here: replies by rule, a token a
byte, the finish reasons, stop strings, streaming, logprobs, and slots shared by the real
scheduler; and a file that is not a valid script is refused when it is registered."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import pytest

from appliance.serving.catalog import ModelFileError, register_file
from appliance.serving.scripted import ByteVocabulary, Script, ScriptError
from appliance.state.store import Store
from tests.conftest import SCRIPTED, Client, write_script

if TYPE_CHECKING:
    from pathlib import Path


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_completion_is_the_scripted_reply_a_token_a_byte(
    client: Client, api_key: str
) -> None:
    response = await client.post(
        "/v1/completions",
        json={"model": SCRIPTED, "prompt": "Say hello", "max_tokens": 100},
        headers=_headers(api_key),
    )
    assert response.status == 200, await response.text()
    body = await response.json()
    reply = "Hello from the scripted model."
    assert body["choices"][0]["text"] == reply
    assert body["choices"][0]["finish_reason"] == "stop"
    # The prompt is BOS and its bytes; the reply, a token a byte.
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        1 + len("Say hello"),
        len(reply),
    )


async def test_rules_length_and_stop_strings(client: Client, api_key: str) -> None:
    async def complete(**body: object) -> dict[str, object]:
        response = await client.post(
            "/v1/completions", json={"model": SCRIPTED, **body}, headers=_headers(api_key)
        )
        assert response.status == 200, await response.text()
        choice: dict[str, object] = (await response.json())["choices"][0]
        return choice

    assert (await complete(prompt="ping?", max_tokens=10))["text"] == "pong"
    cut = await complete(prompt="hi", max_tokens=5)
    assert (cut["text"], cut["finish_reason"]) == ("Hello", "length")
    stopped = await complete(prompt="hi", max_tokens=100, stop=[" the"])
    assert (stopped["text"], stopped["finish_reason"]) == ("Hello from", "stop")


async def test_chat_streams_the_reply_in_deltas_with_logprobs(client: Client, api_key: str) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Answer in JSON"}],
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
        headers=_headers(api_key),
    )
    assert response.status == 200, await response.text()
    text, tokens, finish = "", 0, None
    async for line in response.content:
        data = line.decode().strip().removeprefix("data: ")
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        text += choice["delta"].get("content") or ""
        tokens += len((choice.get("logprobs") or {}).get("content") or [])
        finish = choice["finish_reason"] or finish
    assert (text, finish) == ('{"ok": true}', "stop")
    assert tokens == len(text)  # one token a byte, each with its logprob


async def test_sequences_share_the_slots_as_the_scheduler_says(
    client: Client, api_key: str
) -> None:
    # Eight requests at once on four slots with four places to wait (tests/conftest.py):
    # all answered, whole.
    async def one(i: int) -> str:
        response = await client.post(
            "/v1/completions",
            json={"model": SCRIPTED, "prompt": f"ping {i}", "max_tokens": 20},
            headers=_headers(api_key),
        )
        assert response.status == 200, await response.text()
        return str((await response.json())["choices"][0]["text"])

    assert await asyncio.gather(*(one(i) for i in range(8))) == ["pong"] * 8


def test_the_vocabulary_is_the_bytes() -> None:
    vocab = ByteVocabulary(None)
    assert vocab.tokenize("é", chat=True) == [0xC3, 0xA9]
    assert vocab.tokenize("a", chat=False) == [256, 97]
    assert vocab.piece(257) == b""
    assert vocab.piece(257, special=True) == b"<eos>"
    assert vocab.chat_template.origin == "chatml"


@pytest.mark.parametrize(
    ("content", "fault"),
    [
        ('{"reply": "x"}', "not a model script"),
        ('{"kvl_script": 1}', "`reply` must be a string"),
        ('{"kvl_script": 1, "reply": "x", "step_s": -1}', "`step_s`"),
        ('{"kvl_script": 1, "reply": "x", "rules": [{"contains": 1, "reply": "y"}]}', "`rules`"),
        ('{"kvl_script": 1, "reply": "x", "voice": "y"}', "unknown keys"),
        ("{not json", "not JSON"),
    ],
)
def test_a_file_that_is_not_a_valid_script_is_refused(
    tmp_path: Path, content: str, fault: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    store = Store(tmp_path / "catalog.db")
    try:
        with pytest.raises(ModelFileError, match=fault):
            register_file(store, path, "bad", "1")
        assert store.list_models() == []
    finally:
        store.close()


def test_a_script_reads_back_as_written(tmp_path: Path) -> None:
    script = Script.read(write_script(tmp_path / "s.json", step_s=0.01))
    assert script.answer("say ping") == "pong"
    assert script.answer("anything") == "Hello from the scripted model."
    assert script.step_s == 0.01
    with pytest.raises(ScriptError):
        Script.parse([], "here")
