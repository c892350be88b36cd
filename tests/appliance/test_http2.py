"""HTTP/2 on the LAN API with TLS on: real `kvl appliance serve` processes (nginx in front,
appliance/gateway/front.py), real clients (httpx with h2, raw TLS sockets) on loopback.

The certificate comes from a CA of the test's own (shared.pki), as the fleet's does, so a
renewed certificate is trusted by the same clients; it is renewed the way the fleet's is
(the key, then the certificate, each replaced atomically), here in the operator's files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import httpx
import psutil
import pytest
from aiohttp import web

from appliance.fleet.identity import FleetFiles
from appliance.gateway.front import WATCH_S, Front, nginx_binary
from appliance.state.store import AsyncStore
from shared import pki
from tests.appliance.front_processes import (
    HOST,
    MAX_BODY,
    Appliance,
    issue,
    start,
    stop,
    wait_https,
)
from tests.appliance.node_certificates import (
    Node,
    hub_settings,
    link_for,
    provisioning,
    serve_hub,
    served_serial,
)
from tests.conftest import REAL_MODEL_ENV, free_port, make_settings
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from pytest_aiohttp import AiohttpServer

pytestmark = pytest.mark.skipif(
    nginx_binary() is None, reason="nginx is not installed: `just setup-system`"
)

GOAWAY = 0x7


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    started = start(tmp_path_factory.mktemp("http2"))
    yield started
    stop(started)


def frames(data: bytes) -> list[int]:
    """The types of the HTTP/2 frames in ``data``."""
    types = []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        types.append(data[3])
        data = data[9 + length :]
    return types


def test_h2_is_negotiated_and_serves_the_api(appliance: Appliance) -> None:
    with appliance.client() as client:
        response = client.get("/v1/models")
        again = client.get("/healthz")
    assert response.http_version == "HTTP/2"
    assert response.status_code == 200
    assert response.json()["object"] == "list"
    assert response.headers["x-request-id"]
    assert again.http_version == "HTTP/2"
    assert again.json()["status"] == "alive"


def test_http11_clients_are_served_on_the_same_port(appliance: Appliance) -> None:
    with appliance.client(http2=False) as client:
        response = client.get("/v1/models")
    assert response.http_version == "HTTP/1.1"
    assert response.status_code == 200
    # A client that offers no ALPN at all speaks HTTP/1.1 too.
    context = appliance.context()
    with (
        socket.create_connection((HOST, appliance.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=HOST) as tls,
    ):
        assert tls.selected_alpn_protocol() is None
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: appliance\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200")
    assert b'"status": "alive"' in answer


def test_a_malformed_preamble_is_closed_and_others_go_on(appliance: Appliance) -> None:
    with appliance.client() as client:
        assert client.get("/healthz").http_version == "HTTP/2"
        context = appliance.context(["h2"])
        with (
            socket.create_connection((HOST, appliance.port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=HOST) as tls,
        ):
            assert tls.selected_alpn_protocol() == "h2"
            tls.sendall(b"GET / HTTP/1.1\r\nHost: appliance\r\n\r\n" + b"\x00" * 64)
            received = b""
            # nginx may close without TLS's close_notify: the read ends in an error then.
            with contextlib.suppress(ssl.SSLError, ConnectionResetError):
                while chunk := tls.recv(65536):
                    received += chunk
        assert GOAWAY in frames(received), received
        # The other connection, open before and after, is not affected.
        response = client.get("/v1/models")
        assert response.http_version == "HTTP/2"
        assert response.status_code == 200


def test_bodies_and_headers_are_bounded(appliance: Appliance) -> None:
    with appliance.client() as client:
        too_large = client.post(
            "/v1/chat/completions",
            content=b"x" * (MAX_BODY + 1),
            headers={"Content-Type": "application/json"},
        )
        assert too_large.http_version == "HTTP/2"
        assert too_large.status_code == 413
        assert too_large.json()["error"]["code"] == "request_too_large"
        # A body without a length, streamed past the limit, is refused as well.
        streamed = client.post(
            "/v1/chat/completions",
            content=iter([b"x" * 1024] * 8),
            headers={"Content-Type": "application/json"},
        )
        assert streamed.status_code == 413
        assert streamed.json()["error"]["code"] == "request_too_large"
    # Headers past the bound end that connection (GOAWAY), and that connection only.
    with appliance.client() as other, appliance.client() as hostile:
        assert other.get("/healthz").status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            hostile.get("/healthz", headers={f"x-h{i}": "a" * 4000 for i in range(16)})
        assert other.get("/healthz").status_code == 200
    # Over HTTP/1.1 the same bounds are a 400 in the API's error shape.
    with appliance.client(http2=False) as client:
        big_header = client.get("/healthz", headers={"x-big": "a" * 20_000})
        long_line = client.get("/healthz?" + "a" * 9000)
    assert big_header.status_code == 400
    assert big_header.json()["error"]["code"] == "bad_request"
    assert long_line.status_code == 400
    assert "request line" in long_line.json()["error"]["message"]
    # So is plain HTTP on the TLS port.
    plain = httpx.get(f"http://{HOST}:{appliance.port}/healthz", timeout=30)
    assert plain.status_code == 400
    assert plain.json()["error"]["code"] == "bad_request"


def test_websockets_go_through_over_http11(appliance: Appliance) -> None:
    async def talk() -> dict[str, object]:
        headers = {"Authorization": f"Bearer {appliance.key}"}
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(
                f"{appliance.url}/v1/ws", headers=headers, ssl=appliance.context()
            ) as ws,
        ):
            await ws.send_str("not json")
            reply: dict[str, object] = json.loads(await ws.receive_str(timeout=30))
            return reply

    reply = asyncio.run(talk())
    assert reply["id"] is None
    assert reply["event"] == "error"


def test_the_clients_address_is_the_connections_not_a_header(tmp_path: Path) -> None:
    """Three failed keys a minute from one address, then 429 naming it: the address nginx
    saw (loopback), not the X-Forwarded-For the client made up. (An appliance of its own:
    loopback is throttled after this.)"""
    appliance = start(tmp_path)
    headers = {"Authorization": "Bearer kvl_wrong", "X-Forwarded-For": "203.0.113.9"}
    try:
        with httpx.Client(http2=True, verify=appliance.context(), timeout=30) as client:
            codes = []
            for _ in range(10):
                response = client.get(f"{appliance.url}/v1/models", headers=headers)
                assert response.http_version == "HTTP/2"
                codes.append(response.json()["error"]["code"])
                if codes[-1] == "too_many_auth_failures":
                    break
    finally:
        stop(appliance)
    assert codes[-1] == "too_many_auth_failures", codes
    message = response.json()["error"]["message"]
    assert f"from {HOST};" in message, message
    assert "203.0.113.9" not in appliance.log.read_text()


def test_a_renewed_certificate_is_served_on_new_connections(tmp_path: Path) -> None:
    appliance = start(tmp_path)
    try:
        with appliance.client() as before:
            assert before.get("/healthz").http_version == "HTTP/2"
            ca = pki.Issued((tmp_path / "ca.crt").read_bytes(), (tmp_path / "ca.key").read_bytes())
            first = ssl.PEM_cert_to_DER_cert(appliance.cert.read_text())
            issue(ca, tmp_path, "renewed.test")
            renewed = ssl.PEM_cert_to_DER_cert(appliance.cert.read_text())
            deadline = time.monotonic() + WATCH_S * 10 + 10
            served = [first]
            while served[-1] != renewed and time.monotonic() < deadline:
                time.sleep(0.2)
                with (
                    socket.create_connection((HOST, appliance.port), timeout=10) as raw,
                    appliance.context(["h2", "http/1.1"]).wrap_socket(
                        raw, server_hostname=HOST
                    ) as tls,
                ):
                    assert tls.selected_alpn_protocol() == "h2"
                    served.append(tls.getpeercert(binary_form=True) or b"")
                    assert served[-1] in (first, renewed)
            assert served[-1] == renewed, "the renewed certificate was not served"
            # Clients go on: a connection of the old certificate's is closed gracefully
            # (nginx's reload: GOAWAY, NO_ERROR). A request the close caught, which HTTP/2
            # lets a client ask again, is asked again, on a new connection (on a busy host
            # the old worker closed the connection as the request arrived, once in CI).
            closed = ""
            try:
                answer = before.get("/v1/models")
            except httpx.RemoteProtocolError as err:
                closed = str(err)
                answer = before.get("/v1/models")
            assert not closed or "error_code:0" in closed, closed
            assert answer.status_code == 200
    finally:
        stop(appliance)


def test_http2_off_serves_http11_only(tmp_path: Path) -> None:
    appliance = start(tmp_path, {"KVL_SERVER__HTTP2": "false"})
    try:
        with appliance.client() as client:
            response = client.get("/v1/models")
        assert response.http_version == "HTTP/1.1"
        assert response.status_code == 200
    finally:
        stop(appliance)


@pytest.mark.model
def test_a_chat_completion_streams_over_h2(tmp_path: Path) -> None:
    env = {"KVL_MODEL__DEFAULT": "gemma-3-270m", "KVL_MODEL__N_CTX": "2048", **REAL_MODEL_ENV}
    appliance = start(tmp_path, env)
    try:
        with appliance.client() as client:
            body = {
                "model": "gemma-3-270m",
                "messages": [{"role": "user", "content": "Count from one to five."}],
                "max_tokens": 16,
                "stream": True,
            }
            deadline = time.monotonic() + 180
            while client.get("/readyz").status_code != 200:  # the model loads
                assert time.monotonic() < deadline, "the model did not load"
                time.sleep(0.5)
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.http_version == "HTTP/2"
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                lines = list(response.iter_lines())
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert text.strip()
        assert len(chunks) > 3  # token by token, not one piece
    finally:
        stop(appliance)


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a zombie is dead, where nothing reaps orphans)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_nginx_that_dies_is_started_again(tmp_path: Path) -> None:
    appliance = start(tmp_path)
    try:
        (master,) = [
            p for p in psutil.Process(appliance.process.pid).children() if p.name() == "nginx"
        ]
        workers = master.children()
        assert workers
        master.kill()  # its workers are left, holding the port, until the appliance acts
        master.wait(timeout=10)
        deadline = time.monotonic() + 30
        while "nginx exited" not in appliance.log.read_text():
            assert time.monotonic() < deadline, "the appliance did not see nginx exit"
            time.sleep(0.1)
        # Its workers are gone (zombies at most, where nothing reaps orphans), and a new
        # nginx serves.
        # The appliance logs the exit, then ends the workers: wait for that, not for the log.
        wait_https(appliance, timeout_s=30)
        for worker in workers:
            while _alive(worker):
                assert time.monotonic() < deadline, f"worker {worker.pid} outlived its master"
                time.sleep(0.1)
        (again,) = [
            p for p in psutil.Process(appliance.process.pid).children() if p.name() == "nginx"
        ]
        assert again.pid != master.pid
        with appliance.client() as client:
            response = client.get("/v1/models")
        assert response.http_version == "HTTP/2"
        assert response.status_code == 200
    finally:
        stop(appliance)
    # A stopped appliance leaves no nginx behind.
    with contextlib.suppress(psutil.NoSuchProcess):
        assert again.status() == psutil.STATUS_ZOMBIE


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    """A node's fleet link alone, as tests/appliance/test_certificates.py has it."""
    settings = make_settings(tmp_path / "data", embeddings={"enabled": False})
    store = AsyncStore(settings.db_path)
    await store.open()
    node = Node(None, store, FleetFiles(settings.fleet_dir))  # type: ignore[arg-type]
    yield node
    if node.link is not None:
        await node.link.close()
    await store.close()


async def test_the_fleets_renewed_certificate_is_served_by_nginx_at_once(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    node: Node,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fleet's certificate (a real hub's CA, the node's link renewing it when its
    addresses change), served by a Front as `kvl appliance serve` runs it: the renewed one
    reaches new connections without a restart."""
    hub = hub_settings(tmp_path)
    hub_port = free_port()
    await serve_hub(aiohttp_server, hub, hub_port)
    node.link = link_for(node, tmp_path, provisioning(tmp_path, hub, hub_port))
    monkeypatch.setattr(node.link, "addresses", lambda: ["192.0.2.70"])
    await node.tick()  # enrolls: the node's certificate
    files = node.files.lan_tls()
    trust = node.files.certificate.trust()
    binary = nginx_binary()
    assert files is not None
    assert trust is not None
    assert binary is not None

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    front = Front(
        binary, host=HOST, port=port, certificate=files, max_streams=8, max_body_bytes=4096
    )
    await web.UnixSite(runner, str(front.upstream)).start()
    await front.start()
    try:
        first = await asyncio.to_thread(served_serial, port, trust)
        # The node's address changed (DHCP): renewed at the next heartbeat.
        monkeypatch.setattr(node.link, "addresses", lambda: ["192.0.2.71"])
        await node.tick()
        assert "192.0.2.71" in node.files.certificate.names()

        async def renewed() -> bool:
            return await asyncio.to_thread(served_serial, port, trust) != first

        await until(renewed, "nginx serves the renewed certificate", timeout_s=WATCH_S * 10)
        assert node.failures == 0
    finally:
        await front.stop()
        await runner.cleanup()
