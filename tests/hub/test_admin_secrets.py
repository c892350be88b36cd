"""Enrollment tokens and fleet API keys over the operator API, as the console and the CLI
make them: the secret shown once, then only its prefix; revocation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from wireguard_tools import WireguardKey

from hub.app import create_app
from hub.identity import certificates, ssl_context
from hub.state.nodes import Enrolled
from hub.state.store import HubStore, open_store
from hub.state.tokens import TokenRefusedError
from shared import pki
from tests.conftest import kvl
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer


async def test_tokens_and_keys_are_made_listed_and_revoked(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path)
    data = str(hub.data_dir)
    operator = kvl("hub", "operators", "create", "--name", "ops", "--data-dir", data).stdout.strip()
    kvl("hub", "accounts", "set", "acme", "--data-dir", data)
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    base = f"https://127.0.0.1:{server.port}/v1/admin"

    async def call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {operator}"}
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, base + path, json=body, headers=headers, ssl=pin) as response,
        ):
            return response.status, await response.json()

    status, made = await call("POST", "/tokens", {"site": "north", "uses": 2})
    assert status == 201, made
    assert made["token"].startswith("kvle_")
    assert (made["site"], made["uses_left"], made["state"]) == ("north", 2, "active")
    status, listed = await call("GET", "/tokens")
    assert [t["prefix"] for t in listed["data"]] == [made["prefix"]]
    assert "token" not in listed["data"][0]  # the secret was shown once
    status, revoked = await call("POST", f"/tokens/{made['prefix']}/revoke")
    assert (status, revoked["state"]) == (200, "revoked")
    store = open_store(hub)
    try:
        with pytest.raises(TokenRefusedError):  # a node cannot enroll with it any more
            _enroll(store, made["token"])
    finally:
        store.close()
    assert (await call("POST", "/tokens/nosuch/revoke"))[0] == 404
    bad = await call("POST", "/tokens", {"site": "", "uses": 0})
    assert (bad[0], bad[1]["error"]["code"]) == (400, "invalid_value")

    status, key = await call("POST", "/keys", {"account": "acme"})
    assert status == 201, key
    assert key["key"].startswith("kvl_")
    assert key["key"].split("_")[1] == key["prefix"]
    assert (await call("POST", "/keys", {"account": "nope"}))[0] == 404
    status, gone = await call("POST", f"/keys/{key['prefix']}/revoke")
    assert (status, gone["revoked"]) == (200, True)
    assert (await call("POST", f"/keys/{key['prefix']}/revoke"))[0] == 404
    status, other = await call("POST", "/tokens", {"site": "north"})
    store = open_store(hub)
    try:
        node = _enroll(store, other["token"]).node
        keys = {k.prefix: k for k in store.desired.of(node).keys}
    finally:
        store.close()
    assert keys[key["prefix"]].revoked  # every node refuses it at its next state pull


def _enroll(store: HubStore, token: str) -> Enrolled:
    return store.nodes.enroll(token, name="n",
                              wg_public_key=str(WireguardKey.generate().public_key()),
                              overlay_prefix="100.64.0.0/10", labels={}, versions={})  # fmt: skip
