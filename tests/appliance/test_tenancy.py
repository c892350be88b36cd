"""Tenancy on the appliance: a fleet account the hub's state no longer gives is withdrawn
(its keys refused), packages and jobs are listed per account (an admin key sees all), and
the isolation level each worker runs at is what the machine really gives it; and, end to
end with a real hub, a node dedicated to one tenant refuses another tenant's key."""

from __future__ import annotations

import json
import os
import subprocess
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from appliance.app import create_app
from appliance.gateway.appkeys import REGISTRY
from appliance.gateway.packages import PACKAGES
from appliance.serving import isolation
from appliance.state.store import EVERY_ACCOUNT, Store
from hub.app import create_app as create_hub
from hub.identity import certificates, ssl_context
from hub.planning.tenancy import Tenancy
from hub.state.store import open_store
from shared import protocol
from shared.classes import IsolationLevel
from tests.appliance.fleet_nodes import placement_hub
from tests.conftest import SCRIPTED, free_port, make_settings
from tests.packages import package
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient, AiohttpServer

    from appliance.state.records import ModelRecord
    from hub.settings import HubSettings


def _state(serial: int, *accounts: str, keys: tuple[protocol.KeyState, ...] = ()) -> Any:
    return protocol.DesiredState(
        node_id="n",
        serial=serial,
        accounts=[protocol.AccountState(name=a, service_class="S1") for a in accounts],
        keys=list(keys),
    )


def test_an_account_the_hub_withdraws_has_its_keys_refused_until_given_again(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "kvl.db")
    try:
        made = store.create_key("school")  # made here, then given by the hub too
        given = protocol.KeyState(prefix="p1", hash=made.hash, account="school")
        store.apply_desired_state(_state(1, "school", keys=(given,)))
        local = store.create_key("lab").plaintext  # the node's own account: never withdrawn
        assert store.authenticate(made.plaintext) is not None
        store.apply_desired_state(_state(2))  # the hub no longer gives it (a rebinding)
        assert store.authenticate(made.plaintext) is None  # as if never received: 401
        assert store.authenticate(local) is not None
        store.apply_desired_state(_state(3, "school", keys=(given,)))
        assert store.authenticate(made.plaintext) is not None
    finally:
        store.close()


# -- packages and jobs per account --------------------------------------------------------


async def test_packages_and_jobs_are_listed_per_account_and_an_admin_sees_all(
    aiohttp_client: AiohttpClient, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    settings = make_settings(tmp_path / "data", embeddings={"enabled": False})
    store = Store(settings.db_path)
    store.add_model(scripted_model)
    keys = {name: store.create_key(name).plaintext for name in ("a", "b")}
    keys["admin"] = store.create_key("ops", admin=True).plaintext
    ids = {a.name: a.id for a in store.list_accounts()}
    store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()

    cache = app[PACKAGES].cache
    owners = {1: ids["a"], 2: ids["b"], 3: EVERY_ACCOUNT}  # 3: seeded by the hub
    store = Store(settings.db_path)
    for n, owner in owners.items():
        manifest, files = package(n)
        cache.put(manifest, files, f"key-{n}")
        store.add_package_owner(manifest.id, manifest.version, owner)
    cache.put(*package(4), "key-4")  # cached before owners were kept: admins only
    store.close()

    def auth(who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {keys[who]}"}

    async def listed(who: str) -> set[int]:
        response = await client.get("/v1/packages", headers=auth(who))
        assert response.status == 200
        return {int(p["id"][4:], 16) for p in (await response.json())["data"]}

    assert await listed("a") == {1, 3}
    assert await listed("b") == {2, 3}
    assert await listed("admin") == {1, 2, 3, 4}
    # Another account's package is not found, whichever way it is asked for.
    b_package = package(2)[0].id
    for path in (f"/v1/packages/{b_package}", f"/v1/packages/{b_package}/files/items.json",
                 f"/v1/packages/{b_package}/exports/moodle-xml"):  # fmt: skip
        response = await client.get(path, headers=auth("a"))
        assert response.status == 404, path
        assert (await response.json())["error"]["code"] == "package_not_found"
        assert (await client.get(path, headers=auth("b"))).status == 200, path
    seeded = package(3)[0].id
    assert (
        await client.get(f"/v1/packages/{seeded}/files/items.json", headers=auth("a"))
    ).status == 200

    # Jobs: each account lists its own, newest first; an admin key lists every one.
    made: dict[str, list[str]] = {"a": [], "b": []}
    for who in ("a", "b", "a"):
        ask = {"model": SCRIPTED, "prompt": "Hi", "max_tokens": 1}
        body = {"requests": [{"custom_id": "x", "url": "/v1/completions", "body": ask}]}
        response = await client.post("/v1/jobs", json=body, headers=auth(who))
        assert response.status == 202, await response.text()
        made[who].append((await response.json())["id"])

    async def jobs(who: str, query: str = "") -> dict[str, Any]:
        response = await client.get(f"/v1/jobs{query}", headers=auth(who))
        assert response.status == 200, await response.text()
        return dict(await response.json())

    assert {j["id"] for j in (await jobs("a"))["data"]} == set(made["a"])
    assert [j["id"] for j in (await jobs("b"))["data"]] == made["b"]
    assert {j["id"] for j in (await jobs("admin"))["data"]} == {*made["a"], *made["b"]}
    first = await jobs("a", "?limit=1")
    assert first["has_more"] is True
    rest = await jobs("a", f"?limit=1&after={first['last_id']}")
    assert {first["last_id"], rest["last_id"]} == set(made["a"])
    assert rest["has_more"] is False
    # Paging after another account's job, or with a bad limit: 400.
    for query in (f"?after={made['b'][0]}", "?limit=0", "?limit=x"):
        response = await client.get(f"/v1/jobs{query}", headers=auth("a"))
        assert response.status == 400, query
        assert (await response.json())["error"]["code"] == "invalid_value"


# -- isolation levels ---------------------------------------------------------------------


def _fake_cgroups(tmp_path: Path, *, subtree: str = "memory cpu") -> tuple[Path, Path]:
    """A cgroup v2 tree and a /proc in files: this process in /svc/main."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    (root / "svc" / "main").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "svc" / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "svc" / "cgroup.subtree_control").write_text(subtree + "\n")
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/svc/main\n")
    return root, proc


def test_workers_go_in_cgroups_beside_the_appliance_and_their_level_is_read_back(
    tmp_path: Path,
) -> None:
    root, proc = _fake_cgroups(tmp_path)
    found = isolation.find_cgroups(root, proc)
    assert (found.base, found.level) == (root / "svc", IsolationLevel.I2)
    group = isolation.confine(found, 4242, isolation.Limits(memory_mib=512, cpus=2))
    assert group == root / "svc" / "kvl-worker-4242"
    assert (group / "memory.max").read_text() == str(512 << 20)
    assert (group / "cpu.max").read_text() == "200000 100000"
    assert (group / "cgroup.procs").read_text() == "4242"
    # Read back: I2 only while the worker is in its cgroup and the limits are set.
    (proc / "4242").mkdir()
    assert isolation.level_of(4242, group, proc) == IsolationLevel.I1  # no /proc entry yet
    (proc / "4242" / "cgroup").write_text("0::/svc/kvl-worker-4242\n")
    assert isolation.level_of(4242, group, proc) == IsolationLevel.I2
    (group / "memory.max").write_text("max")
    assert isolation.level_of(4242, group, proc) == IsolationLevel.I1
    (proc / "4242" / "cgroup").write_text("0::/svc/main\n")
    assert isolation.level_of(4242, group, proc) == IsolationLevel.I1
    assert isolation.level_of(None, group, proc) == IsolationLevel.I1


def test_without_cgroup_v2_controllers_a_node_says_i1_and_why(tmp_path: Path) -> None:
    assert isolation.find_cgroups(tmp_path / "none", tmp_path).why_not.startswith("no cgroup v2")
    root, proc = _fake_cgroups(tmp_path, subtree="pids")
    (root / "svc" / "cgroup.subtree_control").chmod(0o444)
    found = isolation.find_cgroups(root, proc)
    if os.geteuid() != 0:  # root writes a read-only file: the enabling then "works"
        assert found.base is None
        assert "does not give memory and cpu" in found.why_not
    assert isolation.confine(isolation.Cgroups(None, "x"), 1, isolation.Limits(1, 1)) is None


def test_a_worker_on_this_machine_runs_at_the_level_it_reports() -> None:
    """The real machine: I2 where it can write a cgroup v2 with limits, else I1 (why)."""
    found = isolation.find_cgroups()
    if found.base is None:
        assert found.level == IsolationLevel.I1
        pytest.skip(
            f"cgroup limits cannot be applied on this machine, so it reports I1: {found.why_not}"
        )
    worker = subprocess.Popen(["sleep", "30"])
    group = None
    try:
        group = isolation.confine(found, worker.pid, isolation.Limits(memory_mib=64, cpus=1))
        assert group is not None
        assert isolation.level_of(worker.pid, group) == IsolationLevel.I2
    finally:
        worker.kill()
        worker.wait()
        isolation.release(group)


# -- end to end ---------------------------------------------------------------------------


async def test_a_node_dedicated_to_a_tenant_refuses_another_tenants_key(
    aiohttp_server: AiohttpServer, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    hub = placement_hub(tmp_path)
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    store = open_store(hub)
    try:
        for name, tenant in (("acme-staff", "acme"), ("globex-staff", "globex")):
            store.accounts.put(name, "S1")
            store.accounts.set_tenancy(name, Tenancy(tenant, dedicated=True))
        acme_key = store.accounts.create_key("acme-staff").plaintext
        globex_key = store.accounts.create_key("globex-staff").plaintext
    finally:
        store.close()
    base_url = await _dedicated_node(aiohttp_server, tmp_path, scripted_model, hub, hub_server.port)
    async with aiohttp.ClientSession() as session:

        async def status(key: str) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            async with session.get(f"{base_url}/v1/models", headers=headers) as response:
                return response.status

        async def acme_served() -> bool:
            return await status(acme_key) == 200

        await until(acme_served, "acme's key reaches acme's node", timeout_s=30)
        foreign = {"Authorization": f"Bearer {globex_key}"}
        async with session.get(f"{base_url}/v1/models", headers=foreign) as response:
            assert response.status == 401
            assert (await response.json())["error"]["code"] == "invalid_api_key"

        # globex's account rebound to acme's nodes: given, then withdrawn again.
        store = open_store(hub)
        store.accounts.set_tenancy("globex-staff", Tenancy("acme"))
        store.close()

        async def globex_served() -> bool:
            return await status(globex_key) == 200

        await until(globex_served, "the rebound key reaches acme's node", timeout_s=30)
        store = open_store(hub)
        store.accounts.set_tenancy("globex-staff", Tenancy("globex", dedicated=True))
        store.close()

        async def globex_refused() -> bool:
            return await status(globex_key) == 401

        await until(globex_refused, "the key withdrawn from acme's node", timeout_s=30)


async def _dedicated_node(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    record: ModelRecord,
    hub: HubSettings,
    hub_port: int,
) -> str:
    """An appliance enrolled with the hub as a node dedicated to tenant acme (its
    enrollment token's tenancy), serving ``record`` (the scripted model: tenancy is the
    subject), where its heartbeats say; its base URL."""
    store = open_store(hub)
    token = store.tokens.create("site", uses=1, expires_in_s=600, tenant="acme").plaintext
    store.close()
    provisioning = tmp_path / "acme-1.json"
    provisioning.write_text(json.dumps({
        "hub_url": f"https://127.0.0.1:{hub_port}", "token": token,
        "hub_fingerprint": certificates(hub)[1].fingerprint, "name": "acme-1",
    }))  # fmt: skip
    port = free_port()
    settings = make_settings(
        tmp_path / "acme-1",
        model={"n_ctx": 512, "n_threads": 1, "n_slots": 1},
        embeddings={"enabled": False},
        server={"port": port},
        fleet={"provisioning_file": str(provisioning), "tunnel": False, "lan_tls": False,
               "heartbeat_s": 1, "sync_interval_s": 0.5},
    )  # fmt: skip
    local = Store(settings.db_path)
    local.add_model(record)
    local.close()
    app = create_app(settings)
    await aiohttp_server(app, port=port)
    await app[REGISTRY].wait_loaded()
    return f"http://127.0.0.1:{port}"
