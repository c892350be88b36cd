"""The hub's web console as the tests drive it: a hub's settings with a quick stream, its
first user, a cookie-keeping HTTPS client, and the node calls the pages show."""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from wireguard_tools import WireguardKey

from hub.app import create_app
from hub.console.auth import hash_password
from hub.identity import certificates, ssl_context
from hub.settings import HubSettings
from hub.state.store import open_store
from shared import pki, protocol
from tests.hubs import settings_for

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from aiohttp.test_utils import TestServer
    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase


PASSWORD = "correct horse battery"


def console_settings(tmp_path: Path, database: HubDatabase, **console: Any) -> HubSettings:
    """A hub whose nodes go stale and offline within seconds and whose console streams
    and samples them several times a second."""
    return settings_for(
        tmp_path,
        database,
        fleet={"stale_after_s": 3, "offline_after_s": 6},
        console={"stream_every_s": 0.2, "sample_every_s": 0.5, **console},
    )


def add_user(hub: HubSettings, name: str = "ops", password: str = PASSWORD) -> None:
    store = open_store(hub)
    try:
        store.console.add_user(name, hash_password(password), time.time())
    finally:
        store.close()


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


class Console:
    """A cookie-keeping HTTPS client of one hub, as a browser would be: it sends the
    hub's own Origin with its posts unless told otherwise."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base
        self.csrf = ""

    async def get(self, path: str) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.session.get(self.base + path, allow_redirects=False) as response:
            return response.status, await response.text(), response

    async def post(
        self, path: str, data: dict[str, str], *, origin: str | None = "", with_csrf: bool = True
    ) -> tuple[int, str, aiohttp.ClientResponse]:
        headers = {} if origin is None else {"Origin": origin or self.base}
        form = {"csrf": self.csrf, **data} if with_csrf else data
        async with self.session.post(
            self.base + path, data=form, headers=headers, allow_redirects=False
        ) as response:
            return response.status, await response.text(), response

    async def login(self, name: str = "ops", password: str = PASSWORD, **extra: str) -> int:
        status, page, _ = await self.get("/console/login")
        assert status == 200
        self.csrf = csrf_of(page)
        status, _, _ = await self.post(
            "/console/login", {"name": name, "password": password, **extra}
        )
        if status == 303:
            _, page, _ = await self.get("/console/nodes")
            self.csrf = csrf_of(page)
        return status

    def cookie(self, name: str) -> str | None:
        for cookie in self.session.cookie_jar:
            if cookie.key == name:
                return cookie.value
        return None


async def start(aiohttp_server: AiohttpServer, hub: HubSettings) -> TestServer:
    return await aiohttp_server(create_app(hub), ssl=ssl_context(hub))


@contextlib.asynccontextmanager
async def open_console(server: TestServer, hub: HubSettings) -> AsyncIterator[Console]:
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    # unsafe: the jar keeps cookies of an IP address (127.0.0.1), as a browser does.
    async with aiohttp.ClientSession(
        cookie_jar=aiohttp.CookieJar(unsafe=True), connector=aiohttp.TCPConnector(ssl=pin)
    ) as session:
        yield Console(session, f"https://127.0.0.1:{server.port}")


async def enroll(console: Console, hub: HubSettings, name: str, site: str = "lab") -> str:
    """A node enrolled over the real API; its node token."""
    store = open_store(hub)
    token = store.tokens.create(site, uses=1, expires_in_s=60).plaintext
    store.close()
    body = {
        "token": token,
        "name": name,
        "wg_public_key": str(WireguardKey.generate().public_key()),
    }
    async with console.session.post(
        console.base + "/v1/enroll", json=body, headers=protocol.HEADERS
    ) as response:
        assert response.status == 201, await response.text()
        return str((await response.json())["node_token"])


async def heartbeat(console: Console, node_token: str, **capacity: Any) -> None:
    body = {"versions": {"kvl": "9.9.9"}, "capacity": {
        "cpu_percent": 37.0, "cpu_count": 4, "memory_total_mib": 8000,
        "memory_available_mib": 6000, "queue_waiting": 2, "outbox_lag": 5,
        "models": ["m@1"], **capacity}}  # fmt: skip
    async with console.session.post(
        console.base + "/v1/node/heartbeat",
        json=body,
        headers={"Authorization": f"Bearer {node_token}", **protocol.HEADERS},
    ) as response:
        assert response.status == 200, await response.text()


async def stream_event(response: aiohttp.ClientResponse, name: str) -> Any:
    while True:
        block = (await response.content.readuntil(b"\n\n")).decode()
        if not block:
            raise AssertionError("the stream ended")
        if block.startswith(f"event: {name}\n"):
            return json.loads(block.split("data: ", 1)[1])
