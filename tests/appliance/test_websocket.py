"""WebSocket streaming (IF-2) with a real WebSocket client (aiohttp's) and the real model."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from appliance.settings import ApplianceSettings
from appliance.state.store import Store
from shared.errors import ErrorCode
from shared.keys import parse_prefix
from tests.conftest import Client

MODEL = "gemma-3-270m"


async def connect(client: Client, key: str) -> aiohttp.ClientWebSocketResponse:
    return await client.ws_connect("/v1/ws", headers={"Authorization": f"Bearer {key}"})


async def until(ws: aiohttp.ClientWebSocketResponse, done: set[str]) -> list[dict[str, Any]]:
    """Frames until every id in `done` has ended (done, cancelled or error)."""
    frames: list[dict[str, Any]] = []
    pending = set(done)
    while pending:
        frame = await ws.receive_json(timeout=120)
        frames.append(frame)
        if frame["event"] in {"done", "cancelled", "error"}:
            pending.discard(frame["id"])
    return frames


async def test_two_requests_share_one_connection(client: Client, api_key: str) -> None:
    ws = await connect(client, api_key)
    await ws.send_json(
        {
            "type": "chat.completions",
            "id": "a",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 6,
                "temperature": 0,
            },
        }
    )
    await ws.send_json(
        {
            "type": "completions",
            "id": "b",
            "body": {
                "model": MODEL,
                "prompt": "Once upon a time",
                "max_tokens": 6,
                "temperature": 0,
            },
        }
    )
    frames = await until(ws, {"a", "b"})
    for request_id, obj in [("a", "chat.completion.chunk"), ("b", "text_completion")]:
        mine = [f for f in frames if f["id"] == request_id]
        assert mine[-1]["event"] == "done"
        assert 0 < mine[-1]["usage"]["completion_tokens"] <= 6
        chunks = [f["data"] for f in mine if f["event"] == "chunk"]
        assert all(c["object"] == obj for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    await ws.close()


async def test_cancel_by_message(client: Client, api_key: str, settings: ApplianceSettings) -> None:
    ws = await connect(client, api_key)
    await ws.send_json(
        {
            "type": "completions",
            "id": "long",
            "body": {
                "model": MODEL,
                "prompt": "Tell a long story.",
                "max_tokens": 300,
                "temperature": 0,
            },
        }
    )
    first = await ws.receive_json(timeout=60)
    assert first["event"] == "chunk"
    await ws.send_json({"type": "cancel", "id": "long"})
    frames = await until(ws, {"long"})
    assert frames[-1]["event"] == "cancelled"
    assert frames[-1]["usage"]["completion_tokens"] < 300
    await ws.close()
    store = Store(settings.db_path)
    events = store.usage_events("tester")
    store.close()
    assert [e.status for e in events] == [499]


async def test_bad_frames_get_errors_and_the_connection_lives_on(
    client: Client, api_key: str
) -> None:
    ws = await connect(client, api_key)
    cases: list[tuple[str, Any, ErrorCode]] = [
        ("{oops", None, ErrorCode.invalid_json),
        ("[1]", None, ErrorCode.invalid_json),
        ('{"type": "completions"}', None, ErrorCode.missing_required_parameter),
        ('{"type": "nonsense", "id": "x"}', "x", ErrorCode.invalid_value),
        ('{"type": "completions", "id": "y", "body": 3}', "y", ErrorCode.invalid_json),
        (
            (
                '{"type": "completions", "id": "z", "body": '
                '{"model": "gemma-3-270m", "prompt": "x", "temperature": 9}}'
            ),
            "z",
            ErrorCode.invalid_value,
        ),
        (
            '{"type": "completions", "id": "m", "body": {"model": "nope", "prompt": "x"}}',
            "m",
            ErrorCode.model_not_found,
        ),
    ]
    for text, request_id, code in cases:
        await ws.send_str(text)
        frame = await ws.receive_json(timeout=30)
        assert frame["event"] == "error", text
        assert frame["id"] == request_id
        assert frame["error"]["code"] == code.value
    await ws.send_bytes(b"\x00")
    assert (await ws.receive_json(timeout=30))["error"]["code"] == ErrorCode.invalid_json.value
    await ws.send_json(
        {
            "type": "completions",
            "id": "ok",
            "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        }
    )
    assert (await until(ws, {"ok"}))[-1]["event"] == "done"
    await ws.close()


async def test_upgrade_needs_a_key_and_plain_get_is_refused(client: Client, api_key: str) -> None:
    unauthenticated = await client.get(
        "/v1/ws", headers={"Upgrade": "websocket", "Connection": "Upgrade"}
    )
    assert unauthenticated.status == 401
    assert (await unauthenticated.json())["error"]["code"] == ErrorCode.missing_api_key.value
    plain = await client.get("/v1/ws", headers={"Authorization": f"Bearer {api_key}"})
    assert plain.status == 400
    assert (await plain.json())["error"]["code"] == ErrorCode.bad_request.value


async def test_a_key_revoked_while_the_socket_is_open_ends_it_within_a_second(
    client: Client, api_key: str, settings: ApplianceSettings
) -> None:
    ws = await connect(client, api_key)
    await ws.send_json(
        {
            "type": "completions",
            "id": "long",
            "body": {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 300},
        }
    )
    assert (await ws.receive_json(timeout=60))["event"] == "chunk"  # it streams
    prefix = parse_prefix(api_key)
    assert prefix is not None
    store = Store(settings.db_path)  # as `kvl appliance keys revoke` does, from outside
    try:
        store.revoke_key(prefix)
    finally:
        store.close()
    revoked_at = time.monotonic()
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(1.0):  # the bound: within a second of the revocation
        while True:
            message = await ws.receive()
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            frames.append(message.json())
    took = time.monotonic() - revoked_at
    assert message.type in {aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED}, message
    assert ws.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION, (ws.close_code, took)
    last = frames[-1]
    assert (last["id"], last["event"]) == (None, "error")
    assert last["error"]["code"] == ErrorCode.revoked_api_key.value
    assert set(last["error"]) == {"message", "type", "param", "code"}  # the error shape
    # The stream stopped with the connection: nothing of it came after the error.
    assert all(f["event"] == "chunk" for f in frames[:-1])
