"""A site without a hub: the provisioning file carries a bootstrap admin key's hash, the
appliance starts without enrolling and imports that key once, and the key makes accounts
and keys over the LAN. In-process appliances (a real aiohttp server on loopback, real
SQLite), no language model: `/v1/models` is the request a new key is served; and a real
hub on loopback for a node of a fleet, whose accounts the appliance refuses to change."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import ValidationError

from appliance.app import PROVISIONED, create_app
from appliance.fleet.identity import FleetFiles, provisioned
from appliance.state.store import Store
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.state.store import open_store
from shared.errors import ErrorCode
from shared.keys import hash_key
from shared.provisioning import BootstrapKey, Provisioning, ProvisioningError
from tests.conftest import make_settings
from tests.fleet import provisioning as fleet_provisioning
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp import web
    from pytest_aiohttp import AiohttpClient, AiohttpServer

    from appliance.settings import ApplianceSettings
    from tests.conftest import Client

FINGERPRINT = "sha256:" + "ab" * 32
TOKEN = "kvle_Abcdefgh_" + "x" * 32
# The six routes of accounts and keys, each with a body it would take.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/admin/accounts", None),
    ("POST", "/v1/admin/accounts", {"name": "lab-3"}),
    ("DELETE", "/v1/admin/accounts/lab-3", None),
    ("GET", "/v1/admin/keys", None),
    ("POST", "/v1/admin/keys", {"account": "lab-3"}),
    ("DELETE", "/v1/admin/keys/AbCd1234", None),
]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(status: int, body: Any, code: ErrorCode) -> None:
    assert status == code.status, body
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code.value, body
    assert body["error"]["type"] == code.type
    assert body["error"]["message"]


async def call(
    client: Client, method: str, path: str, key: str, body: Any = None
) -> tuple[int, Any]:
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body)
    response = await client.request(method, path, headers=auth(key), data=data)
    return response.status, await response.json()


def hubless(tmp_path: Path, account: str = "admin") -> tuple[ApplianceSettings, str, str]:
    """Settings of an appliance provisioned for a site without a hub, as `kvl image
    configure --no-hub` writes its file: (settings, the bootstrap key, its prefix)."""
    key, plaintext = BootstrapKey.generate(account)
    path = tmp_path / "kovenlab.json"
    path.write_text(Provisioning(name="lab-server", bootstrap_key=key).text())
    assert "kvl_" not in path.read_text()  # the key itself is in no file
    settings = make_settings(
        tmp_path / "data",
        model={"default": "absent-model"},  # no language model: nothing here generates
        embeddings={"enabled": False},
        fleet={"provisioning_file": str(path)},
    )
    return settings, plaintext, key.prefix


async def start(aiohttp_client: AiohttpClient, settings: ApplianceSettings) -> Client:
    client: Client = await aiohttp_client(create_app(settings))
    return client


async def test_a_site_without_a_hub_makes_its_accounts_and_keys_over_the_lan(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    settings, admin, bootstrap = hubless(tmp_path)
    client = await start(aiohttp_client, settings)
    app: web.Application = client.app
    # It starts without a hub: nothing to enroll with, no WireGuard key made for one.
    assert app[PROVISIONED].hub is False
    assert FleetFiles(settings.fleet_dir).identity() is None
    assert not (settings.fleet_dir / "wireguard.key").exists()

    # The bootstrap key is an admin key of the account `admin`, there from the start.
    status, body = await call(client, "GET", "/v1/admin/keys", admin)
    assert status == 200, body
    assert [(k["prefix"], k["account"], k["admin"]) for k in body["data"]] == [
        (bootstrap, "admin", True)
    ]
    assert all("key" not in k and "hash" not in k for k in body["data"])

    # An account, then a key of it: the key is in the answer, once.
    status, account = await call(
        client, "POST", "/v1/admin/accounts", admin, {"name": "class-7b", "tokens_per_day": 0}
    )
    assert status == 201, account
    assert (account["name"], account["service_class"], account["fleet"]) == (
        "class-7b",
        "S1",
        False,
    )
    assert account["tokens_per_day"] == 0
    assert account["disabled_at"] is None
    status, body = await call(client, "POST", "/v1/admin/accounts", admin, {"name": "class-7b"})
    assert_error(status, body, ErrorCode.account_exists)
    status, made = await call(client, "POST", "/v1/admin/keys", admin, {"account": "class-7b"})
    assert status == 201, made
    key = made["key"]
    assert key.startswith(f"kvl_{made['prefix']}_")
    assert (made["account"], made["admin"], made["revoked_at"]) == ("class-7b", False, None)
    status, body = await call(client, "GET", "/v1/admin/keys?account=class-7b", admin)
    assert [k["prefix"] for k in body["data"]] == [made["prefix"]]
    assert all("key" not in k for k in body["data"])
    status, body = await call(client, "GET", "/v1/admin/accounts", admin)
    assert [a["name"] for a in body["data"]] == ["admin", "class-7b"]

    # The new key is served, and is no admin.
    status, models = await call(client, "GET", "/v1/models", key)
    assert status == 200, models
    assert models["object"] == "list"
    for method, path, route_body in ROUTES:
        status, body = await call(client, method, path, key, route_body)
        assert_error(status, body, ErrorCode.permission_denied)

    # Revoked: its next request is a 401; revoking it again answers it as it is.
    status, revoked = await call(client, "DELETE", f"/v1/admin/keys/{made['prefix']}", admin)
    assert status == 200, revoked
    assert revoked["revoked_at"] is not None
    status, body = await call(client, "GET", "/v1/models", key)
    assert_error(status, body, ErrorCode.revoked_api_key)
    status, again = await call(client, "DELETE", f"/v1/admin/keys/{made['prefix']}", admin)
    assert (status, again["revoked_at"]) == (200, revoked["revoked_at"])

    # Disabling an account revokes its keys, and it gets no new ones.
    status, made = await call(client, "POST", "/v1/admin/keys", admin, {"account": "class-7b"})
    assert status == 201, made
    status, disabled = await call(client, "DELETE", "/v1/admin/accounts/class-7b", admin)
    assert status == 200, disabled
    assert disabled["disabled_at"] is not None
    status, body = await call(client, "GET", "/v1/models", made["key"])
    assert_error(status, body, ErrorCode.revoked_api_key)
    status, body = await call(client, "POST", "/v1/admin/keys", admin, {"account": "class-7b"})
    assert_error(status, body, ErrorCode.account_disabled)
    status, body = await call(client, "POST", "/v1/admin/accounts", admin, {"name": "class-7b"})
    assert_error(status, body, ErrorCode.account_exists)

    # What is not there is a 404 in the error shape.
    for method, path, route_body in [
        ("DELETE", "/v1/admin/accounts/nobody", None),
        ("POST", "/v1/admin/keys", {"account": "nobody"}),
        ("GET", "/v1/admin/keys?account=nobody", None),
    ]:
        status, body = await call(client, method, path, admin, route_body)
        assert_error(status, body, ErrorCode.account_not_found)
    status, body = await call(client, "DELETE", "/v1/admin/keys/Zz9Zz9Zz", admin)
    assert_error(status, body, ErrorCode.key_not_found)

    # The node always keeps an admin key: the bootstrap key goes once another is made.
    status, body = await call(client, "DELETE", f"/v1/admin/keys/{bootstrap}", admin)
    assert_error(status, body, ErrorCode.last_admin_key)
    status, body = await call(client, "DELETE", "/v1/admin/accounts/admin", admin)
    assert_error(status, body, ErrorCode.last_admin_key)
    status, mine = await call(
        client, "POST", "/v1/admin/keys", admin, {"account": "admin", "admin": True}
    )
    assert status == 201, mine
    status, body = await call(client, "DELETE", f"/v1/admin/keys/{bootstrap}", mine["key"])
    assert status == 200, body
    status, body = await call(client, "GET", "/v1/admin/accounts", admin)
    assert_error(status, body, ErrorCode.revoked_api_key)
    status, body = await call(client, "GET", "/v1/admin/accounts", mine["key"])
    assert status == 200, body


async def test_the_bootstrap_key_is_imported_once_and_a_revoked_one_stays_revoked(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    settings, admin, bootstrap = hubless(tmp_path)
    client = await start(aiohttp_client, settings)
    status, mine = await call(
        client, "POST", "/v1/admin/keys", admin, {"account": "ops", "admin": True}
    )
    assert_error(status, mine, ErrorCode.account_not_found)  # accounts are made first
    status, _ = await call(client, "POST", "/v1/admin/accounts", admin, {"name": "ops"})
    assert status == 201
    status, mine = await call(
        client, "POST", "/v1/admin/keys", admin, {"account": "ops", "admin": True}
    )
    assert status == 201, mine
    status, body = await call(client, "DELETE", f"/v1/admin/keys/{bootstrap}", mine["key"])
    assert status == 200, body
    await client.close()

    # Started again, with the same file: the bootstrap key is not added again, nor made
    # valid again.
    for _ in range(2):
        client = await start(aiohttp_client, settings)
        status, body = await call(client, "GET", "/v1/admin/keys", mine["key"])
        assert status == 200, body
        assert [k["prefix"] for k in body["data"]].count(bootstrap) == 1
        assert len(body["data"]) == 2
        status, body = await call(client, "GET", "/v1/models", admin)
        assert_error(status, body, ErrorCode.revoked_api_key)
        await client.close()


def test_a_new_bootstrap_key_is_the_way_back_into_a_site(tmp_path: Path) -> None:
    """The store's import: once per prefix; a new one (a new file on the boot partition)
    is added, into its account even if that was disabled; the key matches its hash."""
    store = Store(tmp_path / "appliance.db")
    try:
        first, plaintext = BootstrapKey.generate()
        assert store.import_bootstrap_key(first.account, first.prefix, first.hash) is True
        assert store.import_bootstrap_key(first.account, first.prefix, first.hash) is False
        found = store.authenticate(plaintext)
        assert found is not None
        assert (found.prefix, found.admin, found.account.name) == (first.prefix, True, "admin")
        assert first.hash == hash_key(plaintext)
        # The account disabled (another admin key kept the node managed), then a new file.
        store.create_key("ops", admin=True)
        store.disable_account("admin")
        second, again = BootstrapKey.generate()
        assert store.import_bootstrap_key(second.account, second.prefix, second.hash) is True
        account = store.get_account("admin")
        assert account is not None
        assert account.disabled_at is None
        key = store.authenticate(again)
        assert key is not None
        assert not key.revoked
        old = store.authenticate(plaintext)
        assert old is not None
        assert old.revoked  # the first one stays revoked
    finally:
        store.close()


HOSTILE: list[tuple[str, str, Any]] = [
    ("POST", "/v1/admin/accounts", b"not json"),
    ("POST", "/v1/admin/accounts", b"\xff\xfe"),
    ("POST", "/v1/admin/accounts", [{"name": "a"}]),
    ("POST", "/v1/admin/accounts", {}),
    ("POST", "/v1/admin/accounts", {"name": ""}),
    ("POST", "/v1/admin/accounts", {"name": "x" * 64}),
    ("POST", "/v1/admin/accounts", {"name": "a/b"}),
    ("POST", "/v1/admin/accounts", {"name": "-lead"}),
    ("POST", "/v1/admin/accounts", {"name": "a\u0000b"}),
    ("POST", "/v1/admin/accounts", b'{"name": "\\ud800"}'),
    ("POST", "/v1/admin/accounts", {"name": "ok", "service_class": "S9"}),
    ("POST", "/v1/admin/accounts", {"name": "ok", "requests_per_minute": -1}),
    ("POST", "/v1/admin/accounts", {"name": "ok", "tokens_per_day": 10**30}),
    ("POST", "/v1/admin/accounts", {"name": "ok", "fleet": True}),
    ("POST", "/v1/admin/accounts", {"name": ["ok"]}),
    ("POST", "/v1/admin/keys", {"account": "x" * 201}),
    ("POST", "/v1/admin/keys", {"account": "admin", "admin": {"yes": 1}}),
    ("POST", "/v1/admin/keys", {"account": "admin", "hash": "0" * 64}),
    ("POST", "/v1/admin/keys", {"account": None}),
    ("DELETE", "/v1/admin/keys/short", None),
    ("DELETE", "/v1/admin/keys/AbCd12%2534", None),
    ("DELETE", "/v1/admin/keys/" + "A" * 300, None),
    ("DELETE", "/v1/admin/accounts/" + "a" * 300, None),
    ("DELETE", "/v1/admin/accounts/a%00b", None),
    ("GET", "/v1/admin/keys?account=", None),
    ("GET", "/v1/admin/keys?acount=admin", None),
    ("GET", "/v1/admin/keys?account=a%00b", None),
]


async def test_hostile_input_is_a_4xx_in_the_error_shape(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    settings, admin, _ = hubless(tmp_path)
    client = await start(aiohttp_client, settings)
    for method, path, body in HOSTILE:
        data = None if body is None else body if isinstance(body, bytes) else json.dumps(body)
        response = await client.request(method, path, headers=auth(admin), data=data)
        answer = await response.json()
        assert 400 <= response.status < 500, (method, path, body, answer)
        code = ErrorCode(answer["error"]["code"])
        assert_error(response.status, answer, code)
    # Nothing of it was made.
    status, accounts = await call(client, "GET", "/v1/admin/accounts", admin)
    assert status == 200, accounts
    assert [a["name"] for a in accounts["data"]] == ["admin"]


def test_a_provisioning_file_is_a_fleets_or_a_site_without_a_hubs(tmp_path: Path) -> None:
    key, _ = BootstrapKey.generate()
    hub = {"hub_url": "https://hub:8443", "token": TOKEN, "hub_fingerprint": FINGERPRINT}
    assert Provisioning.model_validate({"name": "n", **hub}).hub is not None
    assert Provisioning(name="n", bootstrap_key=key).hub is None
    for wrong in (
        {"name": "n"},  # neither: a file that would leave the node with no way in
        {"name": "n", "hub_url": hub["hub_url"], "token": TOKEN},  # a hub's field missing
        {"name": "n", **hub, "bootstrap_key": key},  # both
        {"name": "n", "bootstrap_key": {"prefix": "AbCd1234", "hash": "kvl_AbCd1234_x"}},
        {"name": "n", "bootstrap_key": {"prefix": "AbCd1234", "hash": "0" * 64, "key": "x"}},
        {"name": "n", "bootstrap_key": {"prefix": "A/", "hash": "0" * 64}},
        {"name": "n", "bootstrap_key": {"account": "a b", "prefix": "AbCd1234", "hash": "0" * 64}},
    ):
        with pytest.raises(ValidationError):
            Provisioning.model_validate(wrong)
    with pytest.raises(ProvisioningError, match="names no hub"):
        Provisioning(name="n", bootstrap_key=key).require_hub()
    # A fleet's file is written as it was before bootstrap keys: older appliances read it.
    assert "bootstrap_key" not in Provisioning.model_validate({"name": "n", **hub}).text()
    # At start: a file of a site without a hub names no hub; one that cannot be read counts
    # as a fleet's (its link retries it), so the node takes no local writes meanwhile.
    path = tmp_path / "kovenlab.json"
    path.write_text(Provisioning(name="n", bootstrap_key=key).text())
    assert provisioned(path).hub is False
    assert provisioned(path).bootstrap_key == key
    path.write_text("{")
    assert provisioned(path).hub is True
    assert provisioned(None).hub is False


async def test_a_node_of_a_fleet_refuses_local_account_and_key_writes(
    aiohttp_client: AiohttpClient, aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path)
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    path = fleet_provisioning(tmp_path, hub, hub_server.port)
    hub_store = open_store(hub)
    try:
        hub_store.accounts.put("ops", "S1")
        fleet_admin = hub_store.accounts.create_key("ops", admin=True).plaintext
    finally:
        hub_store.close()
    settings = make_settings(
        tmp_path / "data",
        model={"default": "absent-model"},
        embeddings={"enabled": False},
        fleet={"provisioning_file": str(path), "tunnel": False, "lan_tls": False},
    )
    store = Store(settings.db_path)
    try:  # a key made on the node itself, by whoever has its shell
        local_admin = store.create_key("local", admin=True).plaintext
    finally:
        store.close()
    client = await start(aiohttp_client, settings)

    async def fleet_key_works() -> bool:
        response = await client.get("/v1/admin/accounts", headers=auth(fleet_admin))
        return response.status == 200

    # Enrolled, and the hub's desired state applied: its admin key works here.
    await until(fleet_key_works, "the hub's admin key reaches the node", timeout_s=60)
    assert FleetFiles(settings.fleet_dir).identity() is not None
    status, body = await call(client, "GET", "/v1/admin/accounts", fleet_admin)
    assert {a["name"]: a["fleet"] for a in body["data"]} == {
        "lan-user": True,
        "local": False,
        "ops": True,
    }
    status, body = await call(client, "GET", "/v1/admin/keys", local_admin)
    assert status == 200, body
    # Every write is refused, with whichever admin key: the hub owns this node's accounts.
    for key in (fleet_admin, local_admin):
        for method, path_, route_body in ROUTES:
            if method == "GET":
                continue
            status, body = await call(client, method, path_, key, route_body)
            assert_error(status, body, ErrorCode.hub_managed)
    status, body = await call(client, "GET", "/v1/admin/accounts", fleet_admin)
    assert [a["name"] for a in body["data"]] == ["lan-user", "local", "ops"]
