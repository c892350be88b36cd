"""The hub's operator API (/v1/admin): operator tokens, and the fleet's nodes, accounts,
budgets and deployments over HTTPS, as the CLI shows them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp
from wireguard_tools import WireguardKey

from hub.app import create_app
from hub.identity import certificates, ssl_context
from hub.planning.quota import Budget
from hub.state.deployments import ModelArtifact
from hub.state.store import open_store
from shared import pki
from tests.conftest import kvl
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase


async def test_the_admin_api_needs_an_operator_token_and_runs_the_fleet(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = settings_for(tmp_path, hub_database)
    data = str(hub.data_dir)
    token = kvl("hub", "operators", "create", "--name", "ops", "--data-dir", data).stdout.strip()
    assert token.startswith("kvlo_")
    store = open_store(hub)
    store.accounts.put("acme", "S1", budget=Budget(1_000, 86_400))
    enrollment = store.tokens.create("lab", uses=1, expires_in_s=60).plaintext
    store.nodes.enroll(enrollment, name="node-a",
                       wg_public_key=str(WireguardKey.generate().public_key()),
                       overlay_prefix="100.64.0.0/10", labels={}, versions={})  # fmt: skip
    store.deployments.add_model(ModelArtifact("m", "1", "ab" * 32, 10, "gguf", 600))
    store.close()
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    base = f"https://127.0.0.1:{server.port}/v1/admin"

    async def call(method: str, path: str, body: Any = None, auth: str | None = token) -> Any:
        headers = {"Authorization": f"Bearer {auth}"} if auth else {}
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, base + path, json=body, headers=headers, ssl=pin) as response,
        ):
            return response.status, await response.json()

    for auth in (None, "kvlo_AAAAAAAA_" + "A" * 32, "not a token"):
        status, body = await call("GET", "/nodes", auth=auth)
        assert (status, body["error"]["code"]) == (401, "invalid_operator_token")

    status, nodes = await call("GET", "/nodes")
    assert status == 200
    assert [(n["name"], n["status"]) for n in nodes["data"]] == [("node-a", "offline")]
    status, drained = await call("POST", "/nodes/node-a/drain", {"draining": True})
    assert status == 200
    assert drained["draining"] is True
    assert (await call("POST", "/nodes/nope/drain", {}))[0] == 404

    status, accounts = await call("GET", "/accounts")
    assert [a["name"] for a in accounts["data"]] == ["acme"]
    status, quota = await call("GET", "/accounts/acme/quota")
    assert (status, quota["budget_tokens"], quota["remaining"]) == (200, 1_000, 1_000)

    status, created = await call("POST", "/deployments", {"model": "m@1", "replicas": 2})
    assert status == 201, created
    status, listed = await call("GET", "/deployments")
    assert [(d["id"], d["model"], d["replicas"]) for d in listed["data"]] == [
        (created["id"], "m@1", 2)
    ]
    bad = await call("POST", "/deployments", {"model": "m@1", "replicas": -1})
    assert (bad[0], bad[1]["error"]["param"]) == (400, "replicas")
    assert (await call("POST", "/deployments", {"model": "nope@1"}))[0] == 404
    # A preset goes with the deployment as given (what is left unset stays the node's).
    preset = {"n_ctx": 2048, "kv_type": "q8_0", "aliases": ["gpt-4o-mini"], "stop": ["</s>"]}
    status, with_preset = await call("POST", "/deployments", {"model": "m@1", "preset": preset})
    assert (status, with_preset["preset"]) == (201, preset)
    bad = await call("POST", "/deployments", {"model": "m@1", "preset": {"kv_type": "q2"}})
    assert (bad[0], bad[1]["error"]["param"]) == (400, "preset.kv_type")
    assert (await call("DELETE", f"/deployments/{with_preset['id']}"))[0] == 200
    assert (await call("DELETE", f"/deployments/{created['id']}"))[0] == 200
    assert (await call("DELETE", f"/deployments/{created['id']}"))[0] == 404

    # Node settings: set fleet-wide, listed, refused when the hub does not set the key,
    # unset; a node that is not there is a 404.
    status, put = await call("PUT", "/settings", {"key": "chat_default", "value": "m@1"})
    assert (status, put["scope"]) == (200, "fleet"), put
    status, listed = await call("GET", "/settings")
    assert listed["data"] == [{"scope": "fleet", "key": "chat_default", "value": "m@1"}]
    bad = await call("PUT", "/settings", {"key": "model.n_ctx", "value": "9"})
    assert (bad[0], bad[1]["error"]["code"], bad[1]["error"]["param"]) == (
        400, "invalid_value", "key"
    )  # fmt: skip
    assert (await call("PUT", "/settings", {"key": "chat_default", "value": None}))[0] == 200
    assert (await call("GET", "/settings"))[1]["data"] == []
    assert (await call("GET", "/nodes/nope/settings"))[0] == 404
    assert (await call("PUT", "/settings", {"key": "default", "value": "x", "node": "no"}))[
        0
    ] == 404

    # A revoked operator token is refused at once.
    kvl("hub", "operators", "revoke", token, "--data-dir", data)
    assert (await call("GET", "/nodes"))[0] == 401
