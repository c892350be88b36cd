"""The appliance's runner (appliance/gateway/server.py) on loopback: what aiohttp's HTTP
parser refuses is answered in the error shape and logged as the peer's fault, one line at
debug, not as an error with a traceback: the image's health check and any client that
speaks TLS to the plain port did that at every try, and filled the journal."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web

from appliance.gateway.server import ApplianceRunner

TLS_CLIENT_HELLO = bytes.fromhex("16030100f8010000f40303") + b"\x00" * 32


async def _answer(port: int, request: bytes) -> tuple[int, dict[str, object]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    received = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_a_malformed_request_is_a_400_in_the_shape_and_no_logged_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = ApplianceRunner(web.Application(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        with caplog.at_level(logging.DEBUG):
            for request in (TLS_CLIENT_HELLO, b"FROB / HTTP/1.1\r\nHost: x\r\n\r\n"):
                status, body = await _answer(port, request)
                assert status == 400
                assert body["error"]["code"] == "bad_request", body  # type: ignore[index]
    finally:
        await runner.cleanup()
    refused = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(refused) == 2, caplog.text
    assert all(r.levelno == logging.DEBUG for r in refused)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info] == []
