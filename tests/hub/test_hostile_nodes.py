"""A node can break only itself: a real hub (SQLite and PostgreSQL) under every malformed,
extreme, non-finite, negative, duplicated, oversized and foreign message a hostile node
can send, each refused with a 4xx in the error shape, while in the same run an honest
node's heartbeats keep landing, its syncs are accepted, a revocation made by another
process still reaches the running hub, placement keeps converging, and the accounts'
budgets stay exact."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web

from hub.app import create_app
from hub.planning.quota import Budget
from hub.planning.tenancy import Tenancy
from hub.state.deployments import DeploymentRecord, ModelArtifact
from hub.state.serials import Serials
from hub.state.store import open_store
from shared import protocol
from tests.conftest import kvl
from tests.hub.nodes import assert_refused, enroll_node, node_call
from tests.hubs import new_key, settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient, AiohttpServer

    from hub.settings import HubSettings
    from tests.hub.conftest import HubDatabase

DEEP = "[" * 5000 + "]" * 5000


def _usage(event_id: str, **body: Any) -> dict[str, Any]:
    return {"id": event_id, "kind": "usage", "body": {"account": "acme", **body}}


def _capacity(**fields: Any) -> dict[str, Any]:
    return {"memory_total_mib": 16_000, "memory_available_mib": 8_000, **fields}


def _hostile_calls(honest_lease: str) -> list[tuple[str, str, str | bytes]]:
    """(method, path, body) of every hostile call; bodies as raw text where Python's json
    would not write them (NaN, Infinity, huge numbers)."""
    beat = "/v1/node/heartbeat"
    sync = "/v1/node/events"
    lease = "/v1/node/leases"
    calls: list[tuple[str, str, str | bytes]] = [
        # Non-finite, extreme and negative capacity.
        ("POST", beat, '{"capacity": {"cpu_percent": Infinity}}'),
        ("POST", beat, '{"capacity": {"cpu_percent": NaN}}'),
        ("POST", beat, '{"capacity": {"memory_total_mib": 1e300}}'),
        ("POST", beat, '{"capacity": {"model_memory_mib": NaN}}'),
        ("POST", beat, json.dumps({"capacity": {"gpus": 5}})),
        ("POST", beat, json.dumps({"capacity": {"gpus": [{"name": "g", "memory_total_mib": -1}]}})),
        ("POST", beat, json.dumps({"capacity": {"queue_waiting": -100}})),
        ("POST", beat, json.dumps({"capacity": {"cpu_percent": -5}})),
        ("POST", beat, json.dumps({"capacity": _capacity(memory_available_mib=99_000)})),
        ("POST", beat, json.dumps({"capacity": {"models": [f"m{i}@1" for i in range(500)]}})),
        ("POST", beat, json.dumps({"capacity": {"models": ["a@1", "a@1"]}})),
        ("POST", beat, json.dumps({"capacity": {"api": {"port": 0}}})),
        ("POST", beat, json.dumps({"capacity": {"placement_errors": {"m": "x" * 10_000}}})),
        ("POST", beat, json.dumps({"capacity": {"surprise": 1}})),
        ("POST", beat, json.dumps({"versions": {f"k{i}": "v" for i in range(100)}})),
        ("POST", beat, '{"capacity": ' + DEEP + "}"),
        ("POST", beat, "[1, 2"),
        ("POST", beat, b"\xff\xfe not text"),
        # Usage: overflowing, negative, non-finite, another account's, another node's lease.
        ("POST", sync, '{"events": [' + json.dumps(_usage("h1"))[:-2] + ', "tokens_in": 1e300}}]}'),
        ("POST", sync, json.dumps({"events": [_usage("h2", tokens_in=-1_000_000)]})),
        ("POST", sync, '{"events": [' + json.dumps(_usage("h3"))[:-2] + ', "ttft_ms": NaN}}]}'),
        ("POST", sync, json.dumps({"events": [_usage("h5", account="nobody", tokens_in=5)]})),
        ("POST", sync, json.dumps({"events": [_usage("h6", tokens_in=5, lease_id=honest_lease)]})),
        ("POST", sync, json.dumps({"events": [_usage("h7"), _usage("h7")]})),
        ("POST", sync, json.dumps({"events": [_usage(f"n{i}") for i in range(5001)]})),
        ("POST", sync, json.dumps({"events": [{"id": "h8", "kind": "surprise", "body": {}}]})),
        ("POST", sync, json.dumps({"events": [{"id": "h9", "kind": "usage", "body": []}]})),
        (
            "POST",
            sync,
            json.dumps(
                {"events": [{"id": "x" * 1000, "kind": "usage", "body": {"account": "acme"}}]}
            ),
        ),
        (
            "POST",
            sync,
            '{"events": [{"id": "h10", "kind": "package", "body": {"lineage": ' + DEEP + "}}]}",
        ),
        # Leases: repeated, foreign, another node's, negative, overflowing.
        ("POST", lease, json.dumps({"accounts": ["acme"] * 10_000})),
        ("POST", lease, json.dumps({"accounts": ["nobody"]})),
        ("POST", lease, json.dumps({"finals": {honest_lease: 0}})),
        ("POST", lease, json.dumps({"finals": {"mine": -5}})),
        ("POST", lease, '{"finals": {"mine": 1e300}}'),
        ("POST", lease, json.dumps({"accounts": [f"a{i}" for i in range(10_001)]})),
        # Desired state, offload and artifacts with nonsense.
        ("GET", "/v1/node/state?after=1e300", ""),
        ("GET", "/v1/node/state?after=" + "9" * 400, ""),
        ("GET", "/v1/node/state?after=abc", ""),
        ("POST", "/v1/node/offload/chat/completions", json.dumps({"model": "m"})),
        ("POST", "/v1/node/offload/completions", DEEP),
        ("POST", "/v1/node/offload/embeddings", "{}"),
        ("GET", "/v1/node/artifacts/" + "0" * 64, ""),
    ]
    return calls


def _fleet(tmp_path: Path, hub_database: HubDatabase) -> tuple[HubSettings, dict[str, Any]]:
    settings = settings_for(tmp_path, hub_database)
    settings = settings.model_copy(
        update={"fleet": settings.fleet.model_copy(update={"placement_every_s": 0.2})}
    )
    store = open_store(settings)
    try:
        store.accounts.put("acme", "S1", budget=Budget(100_000, 86_400.0))
        store.accounts.put("globex", "S1", budget=Budget(100_000, 86_400.0))
        honest, honest_token = enroll_node(store, "honest")
        hostile, hostile_token = enroll_node(store, "hostile")
        store.deployments.add_model(ModelArtifact("m", "1", "ab" * 32, 10, "gguf", 600))
    finally:
        store.close()
    return settings, {
        "honest": honest,
        "honest_token": honest_token,
        "hostile": hostile,
        "hostile_token": hostile_token,
    }


async def test_a_hostile_node_is_refused_everything_and_the_fleet_goes_on(
    aiohttp_client: AiohttpClient, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings, ids = _fleet(tmp_path, hub_database)
    client = await aiohttp_client(create_app(settings))
    honest, hostile = ids["honest_token"], ids["hostile_token"]

    # The honest node: a heartbeat, a lease for acme, usage under it.
    status, _ = await node_call(client, "POST", "/v1/node/heartbeat", honest,
                            json.dumps({"capacity": _capacity()}))  # fmt: skip
    assert status == 200
    status, answer = await node_call(client, "POST", "/v1/node/leases", honest,
                                 json.dumps({"accounts": ["acme"]}))  # fmt: skip
    assert status == 200, answer
    [lease] = answer["leases"]
    granted = lease["granted"]
    assert granted > 0
    usage = [_usage("ok-1", tokens_in=100, tokens_out=20, lease_id=lease["lease_id"])]
    status, answer = await node_call(client, "POST", "/v1/node/events", honest,
                                 json.dumps({"events": usage}))  # fmt: skip
    assert (status, answer["new"]) == (200, 1)

    def quotas() -> tuple[Any, Any]:
        store = open_store(settings)
        try:
            now = time.time()
            return store.leases.quota("acme", now), store.leases.quota("globex", now)
        finally:
            store.close()

    before = quotas()

    # The hostile node: every call refused, in the error shape.
    for method, path, body in _hostile_calls(lease["lease_id"]):
        status, answer = await node_call(client, method, path, hostile, body)
        assert_refused(status, answer, f"{method} {path} {str(body)[:80]!r}")

    # Offload: no client key, a forged key, an account in a header: refused at the hub.
    ask = json.dumps({"model": "m@1", "prompt": "hi"})
    for headers in ({}, {protocol.CLIENT_KEY_HEADER: "kvl_forged_000000"},
                    {"X-Kvl-Account": "globex", "X-Kvl-Class": "S0"}):  # fmt: skip
        status, answer = await node_call(
            client, "POST", "/v1/node/offload/completions", hostile, ask, headers=headers
        )
        assert_refused(status, answer, f"offload {headers}")
        assert answer["error"]["code"] in {"missing_api_key", "invalid_api_key"}

    # Versions outside the window: a clear error, naming the side to upgrade.
    newer = str(protocol.PROTOCOL_VERSION + 1)
    for version, fix in (("1", "upgrade the node"), (newer, "upgrade the hub"), ("x", "node")):
        status, answer = await node_call(client, "POST", "/v1/node/heartbeat", hostile, "{}",
                                     headers={protocol.PROTOCOL_HEADER: version})  # fmt: skip
        assert_refused(status, answer, f"protocol {version}")
        assert answer["error"]["code"] == "protocol_unsupported"
        assert fix in answer["error"]["message"]

    # Nothing changed: the budgets are exactly as before (no usage, no final, no lease).
    after = quotas()
    assert after == before
    assert after[0].consumed == 120
    assert after[0].leased == {ids["honest"]: granted - 120}
    assert after[1].consumed == 0
    assert after[1].leased == {}
    store = open_store(settings)
    try:
        assert store.ledger.count(ids["hostile"]) == 0
        hostile_node = store.nodes.get(ids["hostile"])
        assert hostile_node.capacity == protocol.Capacity()  # no heartbeat of it landed
    finally:
        store.close()

    # The honest node goes on: its heartbeat lands (the flusher still runs), its sync is
    # accepted, placement converges on it.
    status, _ = await node_call(client, "POST", "/v1/node/heartbeat", honest,
                            json.dumps({"capacity": _capacity(cpu_percent=42.0)}))  # fmt: skip
    assert status == 200

    async def landed() -> bool:
        store = open_store(settings)
        try:
            return store.nodes.get(ids["honest"]).capacity.cpu_percent == 42.0
        finally:
            store.close()

    await until(landed, "the honest heartbeat written", timeout_s=10)
    status, answer = await node_call(client, "POST", "/v1/node/events", honest,
                                 json.dumps({"events": [_usage("ok-2", tokens_in=1)]}))  # fmt: skip
    assert (status, answer["new"]) == (200, 1)

    store = open_store(settings)
    try:
        store.deployments.add(DeploymentRecord("d1", "m@1", 1, "S1", "I1", {}))
    finally:
        store.close()

    async def placed() -> bool:
        store = open_store(settings)
        try:
            return (ids["honest"]) in {node for _, node, _ in store.deployments.placements()}
        finally:
            store.close()

    await until(placed, "the deployment placed on the honest node", timeout_s=10)

    # A revocation made by another process reaches the running hub within its bound.
    store = open_store(settings)
    try:
        store.nodes.revoke(ids["hostile"])
    finally:
        store.close()

    async def revoked() -> bool:
        status, answer = await node_call(client, "POST", "/v1/node/heartbeat", hostile, "{}")
        return status == 403 and answer["error"]["code"] == "node_revoked"

    await until(revoked, "the revocation seen", timeout_s=3 * 1.0 + 2)
    # No background loop of the hub failed on anything the hostile node sent.
    health = await (await client.get("/healthz")).json()
    assert health["loop_failures"] == {}
    assert health["protocol"] == protocol.PROTOCOL_VERSION


async def test_a_node_cannot_read_as_another_or_steal_its_key(
    aiohttp_client: AiohttpClient, tmp_path: Path, hub_database: HubDatabase
) -> None:
    """Enrollment: a retry of the same enrollment (answer lost) gets the same node and a
    new token; the same key with another token is a 409, not a 500."""
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    try:
        token = store.tokens.create("site", uses=1, expires_in_s=60).plaintext
        other = store.tokens.create("site", uses=1, expires_in_s=60).plaintext
    finally:
        store.close()
    client = await aiohttp_client(create_app(settings))
    key = new_key()
    body = {"token": token, "name": "n1", "wg_public_key": key}

    async def enroll(payload: dict[str, Any]) -> tuple[int, Any]:
        response = await client.post("/v1/enroll", json=payload, headers=protocol.HEADERS)
        return response.status, await response.json()

    status, first = await enroll(body)
    assert status == 201, first
    status, again = await enroll(body)  # the first answer was lost: the same call again
    assert status == 201, again
    assert again["node_id"] == first["node_id"]
    assert again["overlay_address"] == first["overlay_address"]
    assert again["node_token"] != first["node_token"]
    # The lost token is good no more; the new one is.
    beat = {"Authorization": f"Bearer {first['node_token']}", **protocol.HEADERS}
    assert (await client.post("/v1/node/heartbeat", json={}, headers=beat)).status == 401
    beat = {"Authorization": f"Bearer {again['node_token']}", **protocol.HEADERS}
    assert (await client.post("/v1/node/heartbeat", json={}, headers=beat)).status == 200

    status, refused = await enroll({**body, "token": other})
    assert_refused(status, refused, "the same key, another token")
    assert refused["error"]["code"] == "already_enrolled"
    status, refused = await enroll({**body, "name": "n2"})
    assert refused["error"]["code"] == "already_enrolled"
    store = open_store(settings)
    try:
        assert len(store.nodes.all()) == 1
        assert store.tokens.all()[0].uses_left + store.tokens.all()[1].uses_left == 1  # one spent
    finally:
        store.close()


async def test_nesting_and_surprises_are_refused_in_the_error_shape(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path, {})
    store = open_store(settings)
    try:
        _, node = enroll_node(store, "n")
        operator = store.operators.create("ops").plaintext
    finally:
        store.close()
    client = await aiohttp_client(create_app(settings))
    calls = [
        ("/v1/enroll", {}),
        ("/v1/node/heartbeat", {"Authorization": f"Bearer {node}"}),
        ("/v1/admin/tokens", {"Authorization": f"Bearer {operator}"}),
    ]
    for path, auth in calls:
        for body in (DEEP, "{" * 3000, '{"a": ' * 3000, '{"a": NaN}'):
            response = await client.post(path, data=body, headers={**auth, **protocol.HEADERS})
            answer = await response.json()
            assert_refused(response.status, answer, f"{path} {body[:20]}")


async def test_an_unexpected_error_is_a_500_in_the_error_shape_with_a_request_id(
    aiohttp_client: AiohttpClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tmp_path, {})
    store = open_store(settings)
    try:
        _, token = enroll_node(store, "n")
    finally:
        store.close()
    client = await aiohttp_client(create_app(settings))

    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Serials, "desired", broken)
    response = await client.get(
        "/v1/node/state?after=1", headers={"Authorization": f"Bearer {token}", **protocol.HEADERS}
    )
    assert response.status == 500
    error = (await response.json())["error"]
    assert error["code"] == "internal_error"
    assert response.headers["X-Kvl-Request-Id"] in error["message"]


async def test_a_node_is_given_no_tenancy_lease_or_offload_that_is_not_its_own(
    aiohttp_client: AiohttpClient,
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    hub_database: HubDatabase,
) -> None:
    """One enrolled node tries to be more than itself: it claims tenant tx's dedicated
    node through its labels, reports one account's usage under another account's lease,
    and offers itself for offload over plain HTTP (`tls: false`). Each is refused or
    grants nothing; tenancy is the operator's (the token's, `kvl hub nodes set`); and the
    honest nodes' accounts, budgets, syncs and heartbeats are exactly as before."""
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    try:
        store.accounts.put("acme", "S1", budget=Budget(100_000, 86_400.0))
        store.accounts.put("globex", "S1", budget=Budget(100_000, 86_400.0))
        store.accounts.put("tx-secret", "S1", budget=Budget(100_000, 86_400.0))
        store.accounts.set_tenancy("tx-secret", Tenancy("tx", (), dedicated=True))
        client_key = store.accounts.create_key("acme").plaintext
        store.deployments.add_model(ModelArtifact("m", "1", "ab" * 32, 10, "gguf", 600))
        plain = store.tokens.create("site", uses=2, expires_in_s=60).plaintext
        dedicated = store.tokens.create("site", uses=1, expires_in_s=60, tenant="tx").plaintext
    finally:
        store.close()
    client = await aiohttp_client(create_app(settings))

    async def enroll(token: str, name: str, labels: dict[str, str]) -> tuple[str, str]:
        body = {"token": token, "name": name, "wg_public_key": new_key(), "labels": labels}
        status, answer = await node_call(client, "POST", "/v1/enroll", "", json.dumps(body))
        assert status == 201, answer
        return answer["node_id"], answer["node_token"]

    claimer, claimer_token = await enroll(plain, "claimer", {"tenant": "tx", "private": "true"})
    _, honest_token = await enroll(plain, "honest", {"region": "eu"})
    tx_node, tx_token = await enroll(dedicated, "tx-node", {})

    async def accounts_of(token: str) -> set[str]:
        status, state = await node_call(client, "GET", "/v1/node/state", token)
        assert status == 200, state
        return {a["name"] for a in state["accounts"]}

    async def lease(token: str, account: str) -> tuple[int, Any]:
        return await node_call(client, "POST", "/v1/node/leases", token,
                           json.dumps({"accounts": [account]}))  # fmt: skip

    # Tenancy: the labels grant nothing; the token's tenancy is the node's.
    store = open_store(settings)
    try:
        node = store.nodes.get(claimer)
        assert (node.tenant, node.private, node.labels["tenant"]) == (None, False, "tx")
        assert (store.nodes.get(tx_node).tenant, store.nodes.get(tx_node).private) == ("tx", False)
    finally:
        store.close()
    assert "tx-secret" not in await accounts_of(claimer_token)
    assert "tx-secret" in await accounts_of(tx_token)
    status, answer = await lease(claimer_token, "tx-secret")
    assert_refused(status, answer, "a lease of a tenant's dedicated account")
    assert answer["error"]["code"] == "foreign_account"

    # The honest node, before: its accounts, a lease and usage under it.
    honest_accounts = await accounts_of(honest_token)
    status, answer = await lease(honest_token, "acme")
    assert status == 200, answer
    [honest_lease] = answer["leases"]
    usage = [_usage("h-1", tokens_in=100, tokens_out=20, lease_id=honest_lease["lease_id"])]
    status, answer = await node_call(client, "POST", "/v1/node/events", honest_token,
                                 json.dumps({"events": usage}))  # fmt: skip
    assert (status, answer["new"]) == (200, 1)

    def quotas() -> tuple[Any, ...]:
        store = open_store(settings)
        try:
            now = time.time()
            return tuple(store.leases.quota(a, now) for a in ("acme", "globex", "tx-secret"))
        finally:
            store.close()

    # The claimer's own lease of acme, which it may have.
    status, answer = await lease(claimer_token, "acme")
    assert status == 200, answer
    [acme_lease] = answer["leases"]
    before = quotas()

    # Leases count for their own account: globex's usage under the claimer's acme lease.
    crossed = {
        "id": "x-1",
        "kind": "usage",
        "body": {
            "account": "globex",
            "tokens_in": 500,
            "tokens_out": 0,
            "lease_id": acme_lease["lease_id"],
        },
    }
    status, answer = await node_call(client, "POST", "/v1/node/events", claimer_token,
                                 json.dumps({"events": [crossed]}))  # fmt: skip
    assert_refused(status, answer, "usage under another account's lease")
    assert answer["error"]["code"] == "foreign_lease"
    assert "not 'globex'" in answer["error"]["message"]

    # Offload only over mutual TLS: the claimer says it takes offloaded requests on a
    # plain-HTTP LAN API (a real server here, which must never see the client's key).
    seen: list[str] = []

    async def lan_api(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"choices": []})

    lan = web.Application()
    lan.router.add_route("*", "/{tail:.*}", lan_api)
    plain_http = await aiohttp_server(lan)
    capacity = _capacity(models=["m@1"], offload=True, queue_waiting=0,
                         api={"port": plain_http.port, "tls": False})  # fmt: skip
    status, answer = await node_call(client, "POST", "/v1/node/heartbeat", claimer_token,
                                 json.dumps({"capacity": capacity}))  # fmt: skip
    assert status == 200, answer

    async def beat_landed() -> bool:
        store = open_store(settings)
        try:
            return store.nodes.get(claimer).capacity.offload
        finally:
            store.close()

    await until(beat_landed, "the claimer's heartbeat written", timeout_s=10)
    status, answer = await node_call(
        client, "POST", "/v1/node/offload/completions", honest_token,
        json.dumps({"model": "m@1", "prompt": "hi"}),
        headers={protocol.CLIENT_KEY_HEADER: client_key},
    )  # fmt: skip
    assert_refused(status, answer, "offload to a node without mutual TLS")
    assert answer["error"]["code"] == "overloaded"
    assert seen == []

    # Nothing of the honest nodes changed: budgets, accounts; their calls go on.
    assert quotas() == before
    assert await accounts_of(honest_token) == honest_accounts
    status, answer = await node_call(client, "POST", "/v1/node/events", honest_token,
                                 json.dumps({"events": [_usage("h-2", tokens_in=1)]}))  # fmt: skip
    assert (status, answer["new"]) == (200, 1)
    status, _ = await node_call(client, "POST", "/v1/node/heartbeat", honest_token,
                            json.dumps({"capacity": _capacity()}))  # fmt: skip
    assert status == 200

    # The operator, and only the operator, gives the claimer tx's tenancy.
    # (Another process: the running hub sees the desired serial move within its bound.)
    kvl("hub", "nodes", "set", "claimer", "--tenant", "tx", "--data-dir", str(settings.data_dir))

    async def given(accounts: set[str]) -> bool:
        return await accounts_of(claimer_token) == accounts

    await until(lambda: given({"tx-secret"}), "tx's account given", timeout_s=10)
    kvl("hub", "nodes", "set", "claimer", "--shared", "--data-dir", str(settings.data_dir))
    await until(lambda: given({"acme", "globex"}), "a shared node again", timeout_s=10)
    health = await (await client.get("/healthz")).json()
    assert health["loop_failures"] == {}
