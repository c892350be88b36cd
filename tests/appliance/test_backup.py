"""`kvl appliance backup` and `kvl appliance restore` (appliance/backup.py) with real parts:
an appliance enrolled with a real hub (the fleet link alone, over its own store: no
model), with accounts, keys, a job with a webhook secret, pins, quota leases, objectives
and an outbox; backed up while events are synced, lost, and restored into a fresh data
directory: it is the same node to the hub, its keys work, and its outbox drains to the
hub with every event counted once, those the hub acknowledged after the backup too."""

from __future__ import annotations

import datetime
import io
import json
import tarfile
from typing import TYPE_CHECKING

import pytest

from appliance import backup as appliance_backup
from appliance.app import create_app
from appliance.fleet.identity import FleetFiles
from appliance.fleet.link import FleetLink
from appliance.gateway.backups import RESTART
from appliance.observability.metrics import Metrics
from appliance.state.dump import resend_since
from appliance.state.jobs import JobStore, NewItem
from appliance.state.records import ModelRecord
from appliance.state.store import AsyncStore, Store, UsageEvent
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.state.store import open_store
from shared import protocol
from shared.backup_archive import serving
from tests.conftest import NoModels, free_port, kvl, make_settings
from tests.fleet import provisioning
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient, AiohttpServer

    from appliance.settings import ApplianceSettings
    from hub.settings import HubSettings
    from tests.conftest import Client

MODEL = ModelRecord(
    name="m", version="1", format="gguf", path="/models/m.gguf", sha256="0" * 64,
    size_bytes=1, quantization=None, source="test", added_at="2026-01-01T00:00:00+00:00",
)  # fmt: skip


def ledger(hub: HubSettings) -> list[str]:
    store = open_store(hub)
    try:
        return [str(r["event_id"]) for r in store.db.query("SELECT event_id FROM ledger")]
    finally:
        store.close()


class Node:
    """The appliance's fleet link over its store, without a model."""

    def __init__(self, settings: ApplianceSettings) -> None:
        self.settings = settings
        self.store = AsyncStore(settings.db_path)
        self.link: FleetLink | None = None

    async def __aenter__(self) -> Node:
        await self.store.open()
        s = self.settings
        self.link = FleetLink(s.fleet, FleetFiles(s.fleet_dir), self.store, Metrics(), NoModels())  # type: ignore[arg-type]
        return self

    async def __aexit__(self, *_: object) -> None:
        if self.link is not None:
            await self.link.close()
        await self.store.close()

    async def usage(self, n: int) -> list[str]:
        account = await self.store.run(self.store.sync.ensure_account, "lan-user")
        event = UsageEvent(account.id, "k", "/v1/completions", "m", 5, 7, None, 1.0, 200, "stop")
        return [(await self.store.run(self.store.sync.record_usage, event)).id for _ in range(n)]

    async def fleet_state(self) -> bool:
        """A heartbeat; whether the hub's state is applied (its fleet account given)."""
        assert self.link is not None
        await self.link.tick()
        accounts = await self.store.run(self.store.sync.list_accounts)
        return any(a.name == "lan-user" for a in accounts) and bool(
            await self.store.run(self.store.sync.meta, "desired_serial")
        )


async def test_an_appliance_restored_from_its_backup_is_the_same_node_and_counts_once(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path)
    port = free_port()
    await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)
    fleet = {"provisioning_file": str(path), "tunnel": False, "heartbeat_s": 3600,
             "sync_interval_s": 3600}  # fmt: skip
    source = make_settings(tmp_path / "node", embeddings={"enabled": False}, fleet=fleet)
    store = Store(source.db_path)
    try:
        local_key = store.create_key("local-team").plaintext  # an account of the node's own
        store.add_model(MODEL)
        store.set_model_pinned(MODEL.ref, pinned=True)
        store.add_package_owner("lesson", "1.0.0", store.ensure_account("local-team").id)
        store.record_worker_restart("m@1", "crash", "exit 1", 1)
        store.save_leases([({"id": "lease-1", "account": "lan-user", "granted": 100,
                             "granted_at": 0.0, "expires_at": 1e12, "period_ends_at": 1e12},
                            True)])  # fmt: skip
        jobs = JobStore(store.db)
        account_id = store.ensure_account("local-team").id
        job = jobs.create(account_id=account_id, key_prefix="k", metadata={},
                          items=[NewItem("a", "/v1/completions", {"prompt": "x"})],
                          webhook_url="https://example.invalid/hook")  # fmt: skip
        secret = jobs.webhook_secret("local-team")
        epoch = store.objectives_epoch()
    finally:
        store.close()

    archive = tmp_path / "node.tar"
    async with Node(source) as node:
        await until(node.fleet_state, "the node takes the hub's state")
        node_id = node.link.identity.node_id if node.link and node.link.identity else None
        synced = await node.usage(3)
        assert node.link is not None
        assert await node.link.sync() == 3
        pending = await node.usage(2)  # recorded, not yet synced, when the backup is taken
        done = kvl("appliance", "backup", str(archive), "--data-dir", str(source.data_dir))
        assert "backed up the appliance" in done.stdout
        # After the backup: the pending events are acknowledged (then lost with the
        # node's disk), and more are recorded and synced.
        after = await node.usage(2)
        assert await node.link.sync() == 4
    assert sorted(ledger(hub)) == sorted([*synced, *pending, *after])
    assert archive.stat().st_mode & 0o777 == 0o600
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert {"manifest.json", "appliance.db", "fleet/identity.json", "fleet/wireguard.key",
            "fleet/node.key", "fleet/node.crt", "fleet/trust.pem"} <= set(names)  # fmt: skip

    # The node's disk is lost; its backup is restored into a new data directory.
    restored = make_settings(tmp_path / "new", embeddings={"enabled": False}, fleet=fleet)
    with serving(restored.data_dir, "appliance"):  # one that serves is never restored over
        refused = kvl("appliance", "restore", str(archive), "--data-dir",
                      str(restored.data_dir), check=False)  # fmt: skip
    assert refused.returncode == 1
    assert "is running on" in refused.stderr
    done = kvl("appliance", "restore", str(archive), "--data-dir", str(restored.data_dir))
    assert "restored the appliance" in done.stdout
    for name in ("identity.json", "wireguard.key", "node.key"):
        assert (restored.fleet_dir / name).stat().st_mode & 0o777 == 0o600, name

    store = Store(restored.db_path)
    try:
        key = store.authenticate(local_key)
        assert key is not None
        assert key.account.name == "local-team"
        assert [m.ref for m in store.pinned_models()] == [MODEL.ref]
        assert ("lesson", "1.0.0") in store.visible_packages(key.account.id)
        jobs = JobStore(store.db)
        assert jobs.get(job.id).status == job.status
        assert jobs.webhook_secret("local-team") == secret
        # Nothing the hub counts is counted twice: a new objectives epoch from zero, the
        # worker restarts of the old one behind it, the leases asked for again.
        assert store.objectives_epoch() != epoch
        assert store.load_objectives() == []
        assert store.worker_restart_count() == 0
        assert len(store.worker_restarts()) == 1
        assert store.load_leases() == []
        assert store.meta("desired_serial") is None  # the next heartbeat pulls it whole
        # The outbox as it was: the events pending at the backup, which the hub holds.
        assert store.outbox_lag() == 2
    finally:
        store.close()

    async with Node(restored) as node:
        assert node.link is not None
        assert node.link.identity is not None
        assert node.link.identity.node_id == node_id  # the same node: no new enrollment
        await until(node.fleet_state, "the restored node takes the hub's state")
        # Sent again, acknowledged, stored once.
        assert await node.link.sync() == 2
        assert await node.store.run(node.store.sync.outbox_lag) == 0
        assert sorted(ledger(hub)) == sorted([*synced, *pending, *after])
        newer = await node.usage(2)
        assert await node.link.sync() == 2
        # Asked to send everything since the backup again: still each once.
        since = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
        assert await node.store.run(resend_since, node.store.sync, since) == 7
        assert await node.link.sync() == 7
    held = ledger(hub)
    assert sorted(held) == sorted([*synced, *pending, *after, *newer])
    hub_store = open_store(hub)
    try:
        (hub_node,) = hub_store.nodes.all()
        assert hub_node.id == node_id
    finally:
        hub_store.close()


def test_outbox_resend_waits_for_a_stopped_appliance_and_never_moves_forward(
    tmp_path: Path,
) -> None:
    settings = make_settings(tmp_path / "node")
    store = Store(settings.db_path)
    try:
        given = protocol.AccountState(name="a", service_class="S1")  # a fleet account
        store.apply_desired_state(
            protocol.DesiredState(node_id="-", serial=0, accounts=[given], keys=[])
        )
        account = store.ensure_account("a")
        for month in ("01", "03"):
            store.record_usage(
                UsageEvent(account.id, "k", "/v1/completions", "m", 1, 1, None, 1.0, 200,
                           "stop", created_at=f"2026-{month}-01T00:00:00.000000+00:00")
            )  # fmt: skip
        store.acknowledge(2)
        assert store.outbox_lag() == 0
    finally:
        store.close()
    data = str(settings.data_dir)
    with serving(settings.data_dir, "appliance"):
        refused = kvl("appliance", "outbox", "resend", "--since", "2026-02-01", "--data-dir",
                      data, check=False)  # fmt: skip
    assert refused.returncode == 1
    assert "stop it before resending" in refused.stderr
    done = kvl("appliance", "outbox", "resend", "--since", "2026-02-01", "--data-dir", data)
    assert "holds 1 event(s)" in done.stdout
    # A later time never moves the checkpoint forward past events not yet acknowledged.
    done = kvl("appliance", "outbox", "resend", "--since", "2026-04-01", "--data-dir", data)
    assert "holds 1 event(s)" in done.stdout


@pytest.mark.parametrize("what", ["kind", "schema"])
def test_a_restore_refuses_an_archive_of_a_hub_or_of_a_newer_schema(
    tmp_path: Path, what: str
) -> None:
    settings = make_settings(tmp_path / "node")
    Store(settings.db_path).close()
    archive = tmp_path / "node.tar"
    kvl("appliance", "backup", str(archive), "--data-dir", str(settings.data_dir))
    with tarfile.open(archive) as tar:
        members = [(i, tar.extractfile(i)) for i in tar.getmembers()]
        parts = [(i, h.read() if h else b"") for i, h in members]
    manifest = json.loads(parts[0][1])
    if what == "kind":
        manifest["kind"] = "hub"
    else:
        manifest["migrations"].append("m999_later")
    body = json.dumps(manifest).encode()
    parts[0][0].size = len(body)
    forged = tmp_path / "forged.tar"
    with tarfile.open(forged, "w") as tar:
        tar.addfile(parts[0][0], io.BytesIO(body))
        for info, data in parts[1:]:
            tar.addfile(info, io.BytesIO(data))
    target = str(tmp_path / "target")
    refused = kvl("appliance", "restore", str(forged), "--data-dir", target, check=False)
    assert refused.returncode == 1
    expected = "is a backup of hub" if what == "kind" else "newer than this appliance's"
    assert expected in refused.stderr


async def test_an_admin_key_takes_the_backup_through_the_api_and_it_restores(
    client: Client, settings: ApplianceSettings, tmp_path: Path
) -> None:
    """A site without a hub (and without a shell) takes its backup with an admin key: the
    archive `kvl appliance backup` writes, taken while the appliance serves; restored into
    a fresh data directory, its keys work there. Other keys are refused, and so is a flag
    that is not one."""
    admin, user = _site_keys(settings)
    # The appliance serves meanwhile: a request before and during the backup.
    assert (await client.get("/v1/models", headers=_bearer(user))).status == 200
    refused = await client.post("/v1/admin/backup", headers=_bearer(user))
    assert refused.status == 403
    assert (await refused.json())["error"]["code"] == "permission_denied"
    bad = await client.post("/v1/admin/backup?packages=maybe", headers=_bearer(admin))
    assert bad.status == 400
    assert (await bad.json())["error"]["param"] == "packages"

    response = await client.post("/v1/admin/backup?packages=false", headers=_bearer(admin))
    assert response.status == 200
    assert response.headers["Content-Type"] == "application/x-tar"
    assert 'filename="kvl-appliance-' in response.headers["Content-Disposition"]
    body = await response.read()
    assert len(body) == int(response.headers["Content-Length"])
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert "appliance.db" in tar.getnames()
    # Nothing of it is left in the data directory (removed once the last byte went out,
    # which the client may read first).
    await until(
        lambda: not [p for p in settings.data_dir.iterdir() if p.name.startswith(".kvl-backup-")],
        "the backup's scratch folder removed",
        30,
    )

    archive = tmp_path / "downloaded.tar"
    archive.write_bytes(body)
    elsewhere = make_settings(tmp_path / "elsewhere")
    appliance_backup.restore(elsewhere, archive)
    restored = Store(elsewhere.db_path)
    try:
        for plaintext, account in ((admin, "ops"), (user, "lab-3")):
            key = restored.authenticate(plaintext)
            assert key is not None
            assert key.account.name == account
    finally:
        restored.close()


def _site_keys(settings: ApplianceSettings) -> tuple[str, str]:
    """An admin key (account `ops`) and a user's (account `lab-3`)."""
    store = Store(settings.db_path)
    try:
        return store.create_key("ops", admin=True).plaintext, store.create_key("lab-3").plaintext
    finally:
        store.close()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_an_admin_key_puts_a_backup_back_and_the_appliance_restarts_into_it(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, tmp_path: Path
) -> None:
    """A backup put back through the admin API is checked whole while the appliance serves
    (a tampered one is refused, nothing staged), then applied when it next starts: the
    keys of the backup work, one made after it does not, and what the data directory held
    is set aside."""
    admin, user = _site_keys(settings)
    app = create_app(settings)
    restarts: list[float] = []
    app[RESTART] = lambda: restarts.append(1.0)
    client = await aiohttp_client(app)
    taken = await client.post("/v1/admin/backup?packages=false", headers=_bearer(admin))
    archive = await taken.read()
    later = await client.post(
        "/v1/admin/keys", headers=_bearer(admin), json={"account": "lab-3", "admin": False}
    )
    assert later.status == 201
    later_key = (await later.json())["key"]

    refused = await client.post("/v1/admin/restore", headers=_bearer(user), data=archive)
    assert refused.status == 403
    tampered = bytearray(archive)
    tampered[len(tampered) // 2] ^= 0xFF
    bad = await client.post("/v1/admin/restore", headers=_bearer(admin), data=bytes(tampered))
    assert bad.status == 400
    assert (await bad.json())["error"]["code"] == "bad_request"
    empty = await client.post("/v1/admin/restore", headers=_bearer(admin), data=b"")
    assert empty.status == 400
    assert not (settings.data_dir / appliance_backup.PENDING).exists()
    assert restarts == []

    staged = await client.post("/v1/admin/restore", headers=_bearer(admin), data=archive)
    assert staged.status == 202, await staged.text()
    assert (await staged.json())["status"] == "restarting"
    assert restarts == [1.0]
    assert (settings.data_dir / appliance_backup.PENDING).is_file()
    await client.close()  # the appliance stops, as SIGTERM stops it

    restored = appliance_backup.apply_pending(settings)  # as `kvl appliance serve` starts
    assert restored is not None
    assert restored.set_aside is not None
    assert (restored.set_aside / "appliance.db").is_file()
    assert not (settings.data_dir / appliance_backup.PENDING).exists()
    assert appliance_backup.apply_pending(settings) is None  # once
    store = Store(settings.db_path)
    try:
        assert store.authenticate(admin) is not None
        assert store.authenticate(user) is not None
        assert store.authenticate(later_key) is None  # made after the backup
    finally:
        store.close()
