"""The appliance's fleet link against a real hub on loopback (HTTPS, pinned certificate):
enrollment once, heartbeats, and the outbox synced exactly once across a hub outage and
lost acknowledgements. The link here skips the tunnel (`fleet.tunnel: false`); the
WireGuard path has its own netns tests."""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web

from appliance.app import FLEET
from appliance.fleet.identity import FleetFiles
from appliance.fleet.link import enroll
from appliance.gateway.appkeys import SETTINGS, STORE
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.state.store import HubStore, open_store
from shared import protocol
from shared.provisioning import Provisioning
from shared.wireguard import read_private_key
from tests.conftest import SCRIPTED, NoModels, free_port, kvl, make_settings
from tests.fleet import complete, fleet_account, fleet_appliance, given_by_hub, provisioning
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient, AiohttpServer


async def test_enrolls_once_heartbeats_and_syncs_every_event_once_across_an_outage(
    aiohttp_client: AiohttpClient,
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    scripted_model: ModelRecord,
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    hub_server = await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)
    app, client, key = await fleet_appliance(
        aiohttp_client, tmp_path, scripted_model, path, heartbeat_s=1, sync_interval_s=0.5
    )
    link = app[FLEET]

    def hub_store() -> HubStore:
        return open_store(hub)

    async def heard() -> bool:
        s = hub_store()
        try:
            return any(n.capacity.models for n in s.nodes.all())
        finally:
            s.close()

    await until(heard, timeout_s=30)
    assert link.identity is not None
    assert (tmp_path / "data" / "fleet" / "identity.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "data" / "fleet" / "wireguard.key").stat().st_mode & 0o777 == 0o600
    s = hub_store()
    (node,) = s.nodes.all()
    s.close()
    assert node.capacity.models == [scripted_model.ref]
    assert node.wg_public_key == (
        read_private_key(tmp_path / "data" / "fleet" / "wireguard.key").public_key
    )

    for _ in range(3):
        await complete(client, key)

    async def ledger(n: int) -> bool:
        s = hub_store()
        try:
            return s.ledger.count() == n
        finally:
            s.close()

    await until(lambda: ledger(3), timeout_s=30)

    # The hub goes away: LAN clients are still served, events wait in the outbox.
    await hub_server.close()
    for _ in range(4):
        await complete(client, key)
    appliance_store = app[STORE]
    assert await appliance_store.run(appliance_store.sync.outbox_lag) == 4
    # It comes back on the same address: every event arrives, none twice.
    await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    await until(lambda: ledger(7), timeout_s=30)
    await until(lambda: _lag_zero(appliance_store), timeout_s=30)
    s = hub_store()
    try:
        usage = [
            json.loads(r["body"])
            for r in s.db.query("SELECT body FROM ledger ORDER BY received_at")
        ]
    finally:
        s.close()
    assert len({u["id"] for u in usage}) == 7
    assert all(u["route"] == "/v1/completions" for u in usage)


async def _lag_zero(store: Any) -> bool:
    return bool(await store.run(store.sync.outbox_lag) == 0)


async def test_a_restarted_node_keeps_its_identity_and_a_refused_token_is_clear(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)
    files = FleetFiles(tmp_path / "fleet")
    first = await enroll(files, Provisioning.load(path))
    # The token was single use: a second enrollment would be refused, and is not needed.
    again = await enroll(FleetFiles(tmp_path / "fleet"), Provisioning.load(path))
    assert again == first
    other = FleetFiles(tmp_path / "other")
    with pytest.raises(Exception, match="already used"):
        await enroll(other, Provisioning.load(path))
    assert other.identity() is None


async def test_lost_acknowledgements_never_duplicate(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    """A proxy in front of the hub forwards each sync, then cuts the connection before the
    answer for the first two: the hub committed, the node never heard. It resends; the
    ledger holds each event once and the checkpoint only moves on an answer. (The proxy
    ends TLS, so it calls the hub with the node's certificate, as the node would.)"""
    hub = settings_for(tmp_path)
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    cut = {"left": 2}
    node_files = FleetFiles(tmp_path / "data" / "fleet")

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        upstream_tls = ssl.create_default_context()
        upstream_tls.check_hostname = False
        upstream_tls.verify_mode = ssl.CERT_NONE
        if node_files.certificate.present:
            upstream_tls.load_cert_chain(*node_files.certificate.files)
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method,
                f"https://127.0.0.1:{hub_server.port}{request.path_qs}",
                data=body,
                headers={
                    k: v
                    for k, v in request.headers.items()
                    if k.lower() in {"authorization", "content-type", "kvl-protocol"}
                },
                ssl=upstream_tls,
            ) as upstream,
        ):
            answer = await upstream.read()
            status = upstream.status
        if request.path == "/v1/node/events" and cut["left"] > 0:
            cut["left"] -= 1
            assert request.transport is not None
            request.transport.close()  # the reply is lost
            raise ConnectionResetError
        return web.Response(body=answer, status=status, content_type="application/json")

    proxy_app = web.Application()
    proxy_app.router.add_route("*", "/{tail:.*}", forward)
    proxy = await aiohttp_server(proxy_app, ssl=ssl_context(hub))
    assert proxy.port is not None
    path = provisioning(tmp_path, hub, proxy.port)
    settings = make_settings(
        tmp_path / "data",
        embeddings={"enabled": False},
        fleet={
            "provisioning_file": str(path),
            "tunnel": False,
            "heartbeat_s": 3600,
            "sync_interval_s": 3600,
        },
    )
    # The link alone, over a store with usage events and no model.
    from appliance.fleet.link import FleetLink  # noqa: PLC0415
    from appliance.observability.metrics import Metrics  # noqa: PLC0415
    from appliance.state.store import AsyncStore, UsageEvent  # noqa: PLC0415

    store = AsyncStore(settings.db_path)
    await store.open()
    account = await fleet_account(store)
    for i in range(5):
        await store.run(
            store.sync.record_usage,
            UsageEvent(account.id, "kvl", "/v1/completions", "m", i, i, None, 1.0, 200, "stop"),
        )

    link = FleetLink(settings.fleet, FleetFiles(settings.fleet_dir), store, Metrics(), NoModels())  # type: ignore[arg-type]
    try:
        # Enrolled; the first answer is lost, and so is that of the resend the client
        # makes at once on a new connection (a call the hub cut is sent once more).
        assert await link.sync() == 0
        assert await store.run(store.sync.outbox_lag) == 5
        assert await link.sync() == 5  # the next round gets through
        assert await store.run(store.sync.outbox_lag) == 0
    finally:
        await link.close()
        await store.close()
    s = open_store(hub)
    try:
        assert s.ledger.count() == 5
    finally:
        s.close()


async def test_the_cli_enrolls_and_reports_status(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)
    data = str(tmp_path / "data")
    before = json.loads(
        (await asyncio.to_thread(kvl, "appliance", "status", "--json", "--data-dir", data)).stdout
    )
    assert before["enrolled"] is False
    assert before["update"] is None  # no release given yet
    done = await asyncio.to_thread(
        kvl, "appliance", "enroll", "--provisioning", str(path), "--data-dir", data
    )
    assert "enrolled: lab-server" in done.stdout
    after = json.loads(
        (await asyncio.to_thread(kvl, "appliance", "status", "--json", "--data-dir", data)).stdout
    )
    assert after["enrolled"] is True
    assert after["overlay_address"] == "100.64.0.2"
    assert after["outbox_lag"] == 0
    refused = await asyncio.to_thread(
        kvl,
        "appliance",
        "enroll",
        "--provisioning",
        str(path),
        "--data-dir",
        str(tmp_path / "x"),
        check=False,
    )
    assert refused.returncode == 1
    assert "already used" in refused.stderr


async def test_desired_state_from_the_hub_is_applied_and_kept_while_offline(
    aiohttp_client: AiohttpClient,
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    scripted_model: ModelRecord,
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    hub_server = await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)
    s = open_store(hub)
    try:
        s.accounts.put("school", "S2", requests_per_minute=2)
        fleet_key = s.accounts.create_key("school").plaintext
    finally:
        s.close()
    app, client, _ = await fleet_appliance(
        aiohttp_client, tmp_path, scripted_model, path, heartbeat_s=1
    )
    settings = app[SETTINGS]
    headers = {"Authorization": f"Bearer {fleet_key}"}

    async def status() -> int:
        return (await client.get("/v1/models", headers=headers)).status

    async def accepted() -> bool:
        return await status() == 200

    # A key made on the hub reaches the appliance with the desired state.
    await until(accepted, timeout_s=30)
    local = Store(settings.db_path)
    try:
        (key,) = [k for k in local.list_keys() if k.account.name == "school"]
        assert key.account.service_class.value == "S2"
    finally:
        local.close()

    # The account's own quota, set on the hub, holds on the node: two a minute.
    for expected in (200, 200, 429):
        response = await client.post(
            "/v1/completions",
            headers=headers,
            json={"model": SCRIPTED, "prompt": "Hi", "max_tokens": 1},
        )
        assert response.status == expected, await response.text()
    assert "requests_per_minute quota (2," in (await response.json())["error"]["message"]

    s = open_store(hub)
    try:
        s.accounts.revoke_key(fleet_key.split("_")[1])
    finally:
        s.close()

    async def refused() -> bool:
        return await status() == 401

    await until(refused, timeout_s=30)
    error = (await (await client.get("/v1/models", headers=headers)).json())["error"]
    assert error["code"] == "revoked_api_key"

    # With the hub gone, the appliance keeps the last state it applied.
    s = open_store(hub)
    try:
        s.accounts.put("library", "S1")
        library_key = s.accounts.create_key("library").plaintext
    finally:
        s.close()

    async def library() -> bool:
        r = await client.get("/v1/models", headers={"Authorization": f"Bearer {library_key}"})
        return r.status == 200

    await until(library, timeout_s=30)
    await hub_server.close()
    link = app[FLEET]
    await until(lambda: link.error is not None, "a heartbeat failing with the hub gone", 30)
    assert await library()


async def test_the_outbox_is_bounded_and_takes_work_again_once_the_hub_is_back(
    aiohttp_client: AiohttpClient,
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    scripted_model: ModelRecord,
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    hub_server = await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)
    app, client, key = await fleet_appliance(
        aiohttp_client,
        tmp_path,
        scripted_model,
        path,
        heartbeat_s=1,
        sync_interval_s=0.5,
        outbox_alarm_events=1,
        outbox_limit_events=2,
    )
    link = app[FLEET]
    await until(lambda: _enrolled(link), timeout_s=30)
    # Only the fleet's usage waits for the hub: the account is the fleet's once a heartbeat
    # has brought the hub's desired state (enrolled alone, on a busy machine it was not yet,
    # and the usage stayed the node's own, never filling the outbox).
    await until(lambda: given_by_hub(app[STORE]), "the hub's account on the node", 30)
    await hub_server.close()
    for _ in range(2):
        await complete(client, key)

    async def refused() -> bool:
        response = await client.post(
            "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": SCRIPTED, "prompt": "Hi", "max_tokens": 2},
        )
        if response.status == 200:
            return False
        error = (await response.json())["error"]
        assert (response.status, error["code"]) == (503, "outbox_full"), error
        assert response.headers["Retry-After"] == "60"
        return True

    # Once a heartbeat has counted the two unsynced events, new work waits for the hub.
    await until(refused, timeout_s=30)
    assert await app[STORE].run(app[STORE].sync.outbox_lag) >= 2
    await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    await until(lambda: _lag_zero(app[STORE]), timeout_s=30)

    async def accepted() -> bool:
        response = await client.post(
            "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": SCRIPTED, "prompt": "Hi", "max_tokens": 2},
        )
        return response.status == 200

    await until(accepted, timeout_s=30)


async def _enrolled(link: Any) -> bool:
    return link.identity is not None and link.error is None


async def test_enrollment_issues_a_lan_certificate_that_clients_verify_with_the_hub_ca(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    files = FleetFiles(tmp_path / "fleet")
    identity = await enroll(files, Provisioning.load(provisioning(tmp_path, hub, port)))
    tls = files.lan_tls()
    assert tls is not None
    cert, key = tls
    assert key.stat().st_mode & 0o777 == 0o600
    # A LAN API served with it: a client that trusts the hub's CA verifies the appliance.
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    lan = web.Application()
    lan.router.add_get("/healthz", healthz)
    server = await aiohttp_server(lan, ssl=context)
    trust = ssl.create_default_context(cadata=identity.hub.ca_pem)
    async with aiohttp.ClientSession() as session:
        for host in ("localhost", "127.0.0.1"):
            url = f"https://{host}:{server.port}/healthz"
            async with session.get(url, ssl=trust) as response:
                assert response.status == 200
        # Without the hub's CA the certificate means nothing to a client.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await session.get(
                f"https://localhost:{server.port}/healthz", ssl=ssl.create_default_context()
            )


async def test_heartbeats_name_the_gpus_the_workers_see(tmp_path: Path) -> None:
    """A node's capacity carries its GPUs (from ggml's device list, as the workers report
    it), so the hub can place GPU work; a CPU-only node sends an empty list."""
    from types import SimpleNamespace  # noqa: PLC0415

    from appliance.fleet.link import FleetLink  # noqa: PLC0415
    from appliance.observability.metrics import Metrics  # noqa: PLC0415
    from appliance.serving.devices import Device, DeviceLayout  # noqa: PLC0415
    from appliance.settings import FleetLinkSettings  # noqa: PLC0415
    from appliance.state.store import AsyncStore  # noqa: PLC0415

    cpu = Device("CPU", "AMD EPYC", "cpu", 64_000, 60_000)
    gpu = Device("CUDA0", "NVIDIA H200", "gpu", 143_000, 140_000)
    placements = [
        DeviceLayout(gpu_offload=True, n_gpu_layers=-1, devices=(cpu, gpu)),
        DeviceLayout(gpu_offload=True, n_gpu_layers=-1, devices=(cpu, gpu)),
        None,
    ]

    class Registry(NoModels):
        def replicas(self) -> list[Any]:
            return [SimpleNamespace(layout=p) for p in placements]

    store = AsyncStore(tmp_path / "appliance.db")
    await store.open()
    link = FleetLink(
        FleetLinkSettings(),
        FleetFiles(tmp_path / "fleet"),
        store,
        Metrics(),
        Registry(),  # type: ignore[arg-type]
    )
    try:
        capacity = await link.capacity()
        assert capacity.gpus == [
            protocol.Gpu(
                name="CUDA0",
                description="NVIDIA H200",
                memory_total_mib=143_000,
                memory_free_mib=140_000,
            )
        ]
        placements[:] = [DeviceLayout(gpu_offload=False, n_gpu_layers=0, devices=(cpu,))]
        assert (await link.capacity()).gpus == []
    finally:
        await link.close()
        await store.close()
