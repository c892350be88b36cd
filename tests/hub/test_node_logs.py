"""The hub's operator API reads a node's logs on the node's fleet listener
(`GET /v1/admin/nodes/{node}/logs`, hub/nodelogs.py): what it answers when it cannot
(an unknown node, one offline or without a fleet listener, one that does not answer),
and, with a real appliance joined to a real hub on loopback, what it reads and follows.
Through a real WireGuard tunnel: tests/test_fleet_netns.py."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from click.testing import CliRunner

from appliance.app import FLEET
from appliance.gateway.appkeys import CERTIFICATE, LOGS
from hub.app import create_app
from hub.identity import ssl_context
from hub.nodelogs import hub_client_context
from hub.state.nodes import Heartbeat
from hub.state.store import open_store
from shared import protocol, tls
from shared.cli import main
from tests.appliance.fleet_nodes import join
from tests.console import add_user, open_console
from tests.hubs import PREFIX, new_key, settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from appliance.state.records import ModelRecord
    from hub.settings import HubSettings


def _enroll(hub: HubSettings) -> tuple[str, str]:
    """A node (its id), never seen, and an operator token."""
    store = open_store(hub)
    try:
        token = store.tokens.create("lab", uses=1, expires_in_s=60).plaintext
        node = store.nodes.enroll(
            token, name="node-a", wg_public_key=new_key(), overlay_prefix=PREFIX,
            labels={}, versions={},
        )  # fmt: skip
        operator = store.operators.create("ops").plaintext
    finally:
        store.close()
    return node.node.id, operator


def _seen(hub: HubSettings, node_id: str, fleet_port: int | None) -> None:
    store = open_store(hub)
    try:
        api = protocol.LanApi(port=8080, fleet_port=fleet_port)
        store.heartbeats([
            Heartbeat(node_id, time.time(), {}, protocol.Capacity(api=api), "127.0.0.1")
        ])  # fmt: skip
    finally:
        store.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_what_the_hub_answers_when_it_cannot_read_a_nodes_logs(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path, {})
    node_id, operator = _enroll(hub)
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    auth = {"Authorization": f"Bearer {operator}"}

    async def get(path: str, **headers: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            answer = await session.get(
                server.make_url(path), headers={**auth, **headers}, ssl=False
            )
            body = await answer.json()
            return answer.status, body["error"]["code"]

    assert await get("/v1/admin/nodes/nobody/logs") == (404, "not_found")
    assert await get("/v1/admin/nodes/node-a/logs", Authorization="Bearer kvlo_x") == (
        401,
        "invalid_operator_token",
    )
    assert await get("/v1/admin/nodes/node-a/logs") == (409, "node_offline")  # never seen
    # The console's node page says why it shows none.
    add_user(hub)
    async with open_console(server, hub) as console:
        assert await console.login() == 303
        status, page, _ = await console.get(f"/console/nodes/{node_id}?logs=warning")
        assert status == 200
        assert "No logs to show: node node-a is offline" in page
        assert '<option value="warning" selected>' in page
    _seen(hub, node_id, fleet_port=None)
    assert await get("/v1/admin/nodes/node-a/logs") == (409, "node_offline")  # no listener
    _seen(hub, node_id, fleet_port=_closed_port())
    assert await get("/v1/admin/nodes/node-a/logs") == (503, "node_unreachable")
    assert await get("/v1/admin/nodes/node-a/logs?follow=1") == (503, "node_unreachable")
    for bad in ("limit=0", "limit=1001", "after=-1", "level=loud", "follow=yes", "tail=2"):
        assert await get(f"/v1/admin/nodes/node-a/logs?{bad}") == (400, "invalid_value"), bad
    # Revoked: not asked.
    store = open_store(hub)
    try:
        store.nodes.revoke(node_id)
    finally:
        store.close()
    assert await get("/v1/admin/nodes/node-a/logs") == (409, "node_offline")


class _AsServed(TestServer):
    """The hub as `kvl hub serve` serves it: a handler whose client goes runs on (aiohttp's
    test servers cancel it), so a follow must end its long poll of the node itself."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        return await super()._make_runner(**{**kwargs, "handler_cancellation": False})


async def test_the_operator_reads_and_follows_a_nodes_logs_through_the_hub(
    aiohttp_server: AiohttpServer, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    hub = settings_for(tmp_path, {})
    hub_server = _AsServed(create_app(hub), host="127.0.0.1")
    await hub_server.start_server(ssl=ssl_context(hub))
    try:
        await _reads_and_follows(aiohttp_server, tmp_path, scripted_model, hub, hub_server)
    finally:
        await hub_server.close()


async def _reads_and_follows(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    scripted_model: ModelRecord,
    hub: HubSettings,
    hub_server: TestServer,
) -> None:
    assert hub_server.port is not None
    node = await join(
        aiohttp_server, tmp_path, scripted_model, hub, hub_server.port, name="node-a",
        model={"n_ctx": 512},
    )  # fmt: skip
    store = open_store(hub)
    try:
        operator = store.operators.create("ops").plaintext
    finally:
        store.close()
    auth = {"Authorization": f"Bearer {operator}"}
    marker = f"a line the test wrote {time.time()}"
    logging.getLogger("kvl.test.node").warning(marker)
    base = hub_server.make_url("/v1/admin/nodes/node-a/logs")
    # The last records: the ring is the process's, and this process has run other tests'
    # appliances before, whose records come first.
    newest = {"tail": "1", "limit": "1000"}
    async with aiohttp.ClientSession() as session:
        for _ in range(300):  # until the hub heard of the node's fleet listener
            answer = await session.get(base, params=newest, headers=auth, ssl=False)
            if answer.status == 200:
                break
            assert answer.status == 409, await answer.text()
            await asyncio.sleep(0.1)
        logs = protocol.LogsAnswer.model_validate_json(await answer.read())
        assert any(r.message == marker and r.level == "WARNING" for r in logs.records)
        # The level filter, the last records: the marker is the last warning or above so far
        # (unless the node logged one since).
        tail = await session.get(
            base, params={"level": "warning", "tail": "1", "limit": "5"}, headers=auth, ssl=False
        )
        warned = protocol.LogsAnswer.model_validate_json(await tail.read())
        assert warned.records
        assert all(r.level in {"WARNING", "ERROR", "CRITICAL"} for r in warned.records)
        assert marker in [r.message for r in warned.records]
        # Follow: NDJSON, the records after `after` and then a new one as it comes.
        follow = await session.get(
            base,
            params={"after": str(warned.next_after), "follow": "1", "level": "warning"},
            headers=auth,
            ssl=False,
        )
        assert follow.status == 200
        assert follow.headers["Content-Type"].startswith("application/x-ndjson")
        later = f"a later line {time.time()}"
        logging.getLogger("kvl.test.node").error(later)
        line = await asyncio.wait_for(follow.content.readline(), 20)
        record = protocol.LogRecord.model_validate_json(line)
        assert (record.message, record.level) == (later, "ERROR")
        assert record.seq > warned.next_after
        follow.close()
        # Server-sent events for a client that asks for them.
        events = await session.get(
            base,
            params={"follow": "1", "tail": "1", "limit": "1"},
            headers={**auth, "Accept": "text/event-stream"},
            ssl=False,
        )
        assert events.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(events.content.readline(), 20)
        assert first.startswith(b"id: ")
        data = await asyncio.wait_for(events.content.readline(), 20)
        assert data.startswith(b"data: {")
        events.close()
    # The followers went: the hub ends its long polls of the node, and the node its waits
    # (each would have held on for up to 25 s).
    await until(lambda: node.app[LOGS].waiting == 0, "the node's waits to end", timeout_s=5)

    # The node's own route: the hub's certificate only, and its query checked there too.
    listener = f"https://127.0.0.1:{node.app[FLEET].fleet_port}/v1/fleet/logs"
    trust = node.app[CERTIFICATE].trust()
    assert trust is not None
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):  # no certificate: no handshake
            await session.get(listener, ssl=tls.client_context(trust))
        as_node = tls.client_context(trust, node.app[CERTIFICATE].files)
        impostor = await session.get(listener, ssl=as_node)
        assert impostor.status == 403
        assert (await impostor.json())["error"]["code"] == "certificate_mismatch"
        as_hub = hub_client_context(hub)
        for bad in ("limit=1001", "after=x", "level=loud", "wait=31", "tail=2"):
            refused = await session.get(f"{listener}?{bad}", ssl=as_hub)
            assert refused.status == 400, bad
            assert (await refused.json())["error"]["param"] == bad.split("=")[0]
        # A long poll answers as soon as a record after `after` comes.
        last = protocol.LogsAnswer.model_validate_json(
            await (await session.get(f"{listener}?tail=1&limit=1", ssl=as_hub)).read()
        ).next_after
        polling = asyncio.ensure_future(
            session.get(f"{listener}?after={last}&wait=30&level=error", ssl=as_hub)
        )
        await until(lambda: node.app[LOGS].waiting == 1, "the long poll to wait on the node")
        assert not polling.done()
        logging.getLogger("kvl.test.node").error("wake up")
        woken = protocol.LogsAnswer.model_validate_json(
            await (await asyncio.wait_for(polling, 10)).read()
        )
        assert [r.message for r in woken.records] == ["wake up"]

    # The console's node page: the last records, at the level asked for.
    add_user(hub)
    async with open_console(hub_server, hub) as console:
        assert await console.login() == 303
        status, page, _ = await console.get("/console/nodes/node-a?logs=error")
        assert status == 200
        assert later in page
        assert marker not in page  # a warning, below the level
        status, page, _ = await console.get("/console/nodes/node-a")
        assert marker in page

    # The CLI, on the hub's machine: the hub's certificate, the node's fleet listener.
    def cli(*args: str) -> str:
        result = CliRunner().invoke(
            main, ["hub", "nodes", "logs", "node-a", "--data-dir", str(hub.data_dir), *args]
        )
        assert result.exit_code == 0, result.output
        return result.output

    printed = await asyncio.to_thread(cli, "--level", "warning", "--lines", "20")
    assert marker in printed
    assert later in printed
    assert " WARNING  kvl.test.node: " in printed
    as_json = await asyncio.to_thread(cli, "--json", "--lines", "1")
    (newest,) = [json.loads(x) for x in as_json.splitlines()]
    assert newest["message"] == "wake up"
