"""`kvl hub backup` and `kvl hub restore` (hub/backup.py) with real parts, on SQLite and on
PostgreSQL: a real hub serving over HTTPS, a real appliance link enrolled with it (the
fleet link alone, over its own store: no model), a backup taken while accounts are being
made and events synced, then the hub lost and restored into a fresh data directory (and
database): everything of the backup is there, nothing after it, and the node takes the
restored state instead of ignoring it as older. Hostile archives: test_backup_archives.py."""

from __future__ import annotations

import asyncio
import datetime
import json
import subprocess
import tarfile
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import conninfo, sql

from appliance.fleet.identity import FleetFiles
from appliance.fleet.link import FleetLink
from appliance.observability.metrics import Metrics
from appliance.state.dump import resend_since
from appliance.state.store import AsyncStore, UsageEvent
from hub.app import create_app as create_hub
from hub.backup import backup, restore
from hub.identity import certificates, hub_keys, ssl_context
from hub.state.store import open_store
from tests.conftest import NoModels, free_port, make_settings
from tests.fleet import provisioning
from tests.hub.backups import fresh_database, hub_cli
from tests.hubs import settings_for
from tests.waiting import until, until_sync

if TYPE_CHECKING:
    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings
    from tests.hub.conftest import HubDatabase
    from tests.postgres import Cluster


def manifest_of(archive: Path) -> dict[str, Any]:
    with tarfile.open(archive, "r:*") as tar:
        handle = tar.extractfile("manifest.json")
        assert handle is not None
        manifest: dict[str, Any] = json.loads(handle.read())
    return manifest


class Writer(threading.Thread):
    """Makes accounts busy-0, busy-1, … on the hub's store, one change (one serial) each,
    until stopped: writes that go on while a backup is taken."""

    def __init__(self, settings: HubSettings) -> None:
        super().__init__(daemon=True)
        self.settings = settings
        self.made = 0
        self.stop = threading.Event()

    def run(self) -> None:
        store = open_store(self.settings)
        try:
            while not self.stop.is_set():
                store.accounts.put(f"busy-{self.made}", "S1")
                self.made += 1
        finally:
            store.close()


async def test_a_backup_taken_while_the_hub_serves_is_restored_and_the_node_takes_it(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    hub_database: HubDatabase,
    request: pytest.FixtureRequest,
) -> None:
    hub = settings_for(tmp_path, hub_database)
    port = free_port()
    server = await aiohttp_server(create_hub(hub), port=port, ssl=ssl_context(hub))
    path = provisioning(tmp_path, hub, port)  # a token, the fleet account lan-user
    store = open_store(hub)
    try:
        kept = store.accounts.create_key("lan-user")  # revoked after the backup
    finally:
        store.close()

    node = make_settings(
        tmp_path / "node",
        embeddings={"enabled": False},
        fleet={"provisioning_file": str(path), "tunnel": False, "heartbeat_s": 3600,
               "sync_interval_s": 3600},
    )  # fmt: skip
    local = AsyncStore(node.db_path)
    await local.open()
    link = FleetLink(node.fleet, FleetFiles(node.fleet_dir), local, Metrics(), NoModels())  # type: ignore[arg-type]

    async def applied() -> int:
        return int(await local.run(local.sync.meta, "desired_serial") or -1)

    async def pulled(serial: int) -> bool:
        await link.tick()  # the hub answers the serial its last heartbeat flush read
        return await applied() == serial

    def hub_serial(settings: HubSettings) -> int:
        s = open_store(settings)
        try:
            return s.serials.desired()
        finally:
            s.close()

    def ledger(settings: HubSettings) -> set[str]:
        s = open_store(settings)
        try:
            return {str(r["event_id"]) for r in s.db.query("SELECT event_id FROM ledger")}
        finally:
            s.close()

    async def record(n: int) -> list[str]:
        account = await local.run(local.sync.ensure_account, "lan-user")
        event = UsageEvent(account.id, "k", "/v1/completions", "m", 3, 4, None, 1.0, 200, "stop")
        return [(await local.run(local.sync.record_usage, event)).id for _ in range(n)]

    try:
        await until(lambda: pulled(hub_serial(hub)), "the node pulls its state")
        assert link.identity is not None
        before_backup = await record(3)
        assert await link.sync() == 3

        # The backup, as a real `kvl hub backup`, while accounts are made and events
        # recorded and synced: it copies one consistent moment.
        writer = Writer(hub)
        writer.start()
        await until(lambda: writer.made >= 5, "writes under way")
        made_before = writer.made
        archive = tmp_path / "hub-backup.tar.gz"
        backing_up = asyncio.create_task(
            asyncio.to_thread(hub_cli, "backup", str(archive), "--data-dir", str(hub.data_dir),
                              database=hub_database)
        )  # fmt: skip
        during: list[str] = []
        while not backing_up.done():
            during += await record(1)
            await link.sync()
        done = await backing_up
        made_after = writer.made
        writer.stop.set()
        await asyncio.to_thread(writer.join)
        assert "backed up the hub" in done.stdout, done.stderr
        assert archive.stat().st_mode & 0o777 == 0o600  # it holds the CA's key
        manifest = manifest_of(archive)
        backup_serial = manifest["serials"]["desired_serial"]

        # After the backup: a change the node applies (serial past the backup's), a
        # revocation, usage synced and acknowledged (the restore loses it), and usage not
        # yet synced (the node still holds it).
        store = open_store(hub)
        try:
            store.accounts.put("after-backup", "S1")
            store.accounts.revoke_key(kept.prefix)
        finally:
            store.close()
        await until(lambda: pulled(hub_serial(hub)), "the node pulls the changes")
        seen_by_node = await applied()
        assert seen_by_node > backup_serial
        acknowledged_after = await record(2)
        await link.sync()
        pending = await record(2)
        assert set(acknowledged_after) <= ledger(hub)

        # A running hub is never restored over.
        refused = hub_cli("restore", str(archive), "--force", "--data-dir", str(hub.data_dir),
                          database=hub_database, check=False)  # fmt: skip
        assert refused.returncode == 1
        assert "is running on" in refused.stderr
        if hub_database:  # nor one whose replicas are connected to the database
            elsewhere = str(tmp_path / "elsewhere")
            refused = hub_cli("restore", str(archive), "--force", "--data-dir", elsewhere,
                              database=hub_database, check=False)  # fmt: skip
            assert refused.returncode == 1
            assert "hub connection(s) are open on the database" in refused.stderr

        # The hub is lost; a new one is restored from the backup, on the same address.
        await server.close()
        target = fresh_database(request, hub_database)
        restored = settings_for(tmp_path / "b", target)
        done = hub_cli("restore", str(archive), "--data-dir", str(restored.data_dir),
                       database=target)  # fmt: skip
        assert f"desired_serial: {backup_serial} -> " in done.stdout, done.stdout
        new_serial = hub_serial(restored)
        assert new_serial > seen_by_node  # past anything a node may hold
        # Its identity is the backed-up hub's: nodes trust and reach it unchanged.
        assert certificates(restored)[0].fingerprint == certificates(hub)[0].fingerprint
        assert hub_keys(restored).public_key == hub_keys(hub).public_key
        store = open_store(restored)
        try:
            names = {a["name"] for a in store.accounts.all()}
            assert [n.id for n in store.nodes.all()] == [link.identity.node_id]
        finally:
            store.close()
        # One consistent moment: the accounts made by then, every one, none after.
        busy = sorted(int(n.removeprefix("busy-")) for n in names if n.startswith("busy-"))
        assert busy == list(range(len(busy)))
        assert made_before <= len(busy) <= made_after
        assert "lan-user" in names
        assert "after-backup" not in names

        await aiohttp_server(create_hub(restored), port=port, ssl=ssl_context(restored))
        await until(lambda: pulled(new_serial), "the node takes the restored state")
        withdrawn = dict(
            await local.run(
                lambda: local.sync.db.execute("SELECT name, withdrawn FROM accounts").fetchall()
            )
        )
        assert withdrawn["after-backup"] == 1  # not in the restored state
        assert withdrawn["lan-user"] == 0
        # A revocation made after the backup stays on the node (keys are never un-revoked).
        key = await local.run(local.sync.authenticate, kept.plaintext)
        assert key is not None
        assert key.revoked

        # The outbox drains into the restored ledger: what the node had not had
        # acknowledged arrives once; what was acknowledged after the backup is missing...
        await link.sync()
        assert await local.run(local.sync.outbox_lag) == 0
        held = ledger(restored)
        assert set(before_backup) | set(pending) <= held
        assert not set(acknowledged_after) & held
        # ...until the node sends again what it recorded since the backup: the ledger then
        # holds every event the node recorded, each once.
        since = datetime.datetime.fromtimestamp(manifest["created_at"] - 60, datetime.UTC)
        assert await local.run(resend_since, local.sync, since) > 0
        await link.sync()
        everything = [*before_backup, *during, *acknowledged_after, *pending]
        assert ledger(restored) == set(everything)
        store = open_store(restored)
        try:
            assert store.ledger.count() == len(everything)
        finally:
            store.close()
    finally:
        await link.close()
        await local.close()


def test_a_restore_refuses_a_target_that_is_not_empty_unless_forced(
    tmp_path: Path, hub_database: HubDatabase, request: pytest.FixtureRequest
) -> None:
    hub = settings_for(tmp_path, hub_database)
    store = open_store(hub)
    try:
        store.accounts.put("acme", "S1")
    finally:
        store.close()
    certificates(hub)
    archive = tmp_path / "hub.tar"
    hub_cli("backup", str(archive), "--data-dir", str(hub.data_dir), database=hub_database)

    target = fresh_database(request, hub_database)
    restored = settings_for(tmp_path / "target", target)
    data_dir = str(restored.data_dir)
    hub_cli("restore", str(archive), "--data-dir", data_dir, database=target)
    refused = hub_cli("restore", str(archive), "--data-dir", data_dir, database=target, check=False)
    assert refused.returncode == 1
    assert "not empty" in refused.stderr
    assert "--force" in refused.stderr
    if target:
        # An empty data directory on a database that holds a hub is not empty either.
        refused = hub_cli(
            "restore", str(archive), "--data-dir", str(tmp_path / "other"), database=target,
            check=False,
        )  # fmt: skip
        assert refused.returncode == 1
        assert "the database's tables" in refused.stderr

    # Forced: what was there is set aside, not deleted, and the restore is whole.
    store = open_store(restored)
    try:
        store.accounts.put("made-after", "S1")
    finally:
        store.close()
    forced = hub_cli("restore", str(archive), "--force", "--data-dir", data_dir, database=target)
    assert "what was there before is in" in forced.stdout
    (aside,) = restored.data_dir.glob("replaced-*")
    assert (aside / ("hub.pgdump" if target else "hub.db")).is_file()
    assert (aside / "pki" / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (restored.data_dir / "pki" / "ca.key").stat().st_mode & 0o777 == 0o600
    store = open_store(restored)
    try:
        assert [a["name"] for a in store.accounts.all()] == ["acme"]
    finally:
        store.close()


def test_the_lock_keeps_a_hub_from_starting_under_a_restore(tmp_path: Path) -> None:
    from shared.backup_archive import DataDirBusyError, restoring, serving  # noqa: PLC0415

    data_dir = tmp_path / "hub"
    with (
        restoring(data_dir, "a hub"),
        pytest.raises(DataDirBusyError, match="under way"),
        serving(data_dir, "hub"),
    ):
        pass
    with (
        serving(data_dir, "hub"),
        serving(data_dir, "hub"),  # servers share it
        pytest.raises(DataDirBusyError, match="is running on"),
        restoring(data_dir, "a hub"),
    ):
        pass


# -- the database's password: never on a command line ----------------------------------------

SECRET = "s3cret:pa\\ss w@rd/ü"


def test_pg_dump_and_pg_restore_get_the_password_in_their_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hub.state import dump as stored  # noqa: PLC0415

    monkeypatch.delenv("PGPASSWORD", raising=False)
    url = f"postgresql://kvl:{quote(SECRET, safe='')}@db.example:5432/kvl?sslmode=require"
    dbname, env = stored.client_connection(url)
    assert env["PGPASSWORD"] == SECRET
    assert "s3cret" not in dbname
    assert conninfo.conninfo_to_dict(dbname) == {
        "user": "kvl", "host": "db.example", "port": "5432", "dbname": "kvl",
        "sslmode": "require",
    }  # fmt: skip
    # No password in the URL: none of ours in the environment (~/.pgpass, $PGPASSWORD apply).
    dbname, env = stored.client_connection("postgresql:///kvl?host=/run/postgresql")
    assert "PGPASSWORD" not in env
    assert conninfo.conninfo_to_dict(dbname) == {"dbname": "kvl", "host": "/run/postgresql"}


@pytest.mark.postgres
def test_a_backup_and_restore_with_a_password_in_the_url_keep_it_off_the_command_line(
    tmp_path: Path, postgres: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a role that must give its password (the cluster trusts every other): pg_dump and
    pg_restore work, so they were given it, and no command line they ran holds it."""
    role = f"kvl_pw_{uuid.uuid4().hex[:8]}"
    databases = [f"{role}_{n}" for n in ("source", "target")]
    hba = postgres.data / "pg_hba.conf"
    trusting = hba.read_text()
    with psycopg.connect(postgres.url("postgres"), autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(SECRET)
            )
        )
        for name in databases:
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {} TEMPLATE template0").format(
                    sql.Identifier(name), sql.Identifier(role)
                )
            )
        hba.write_text(f"local all {role} scram-sha-256\n{trusting}")
        try:
            conn.execute("SELECT pg_reload_conf()")

            def asks_for_it() -> bool:
                try:
                    wrong = f"postgresql://{role}:wrong@/{databases[0]}?host={postgres.root}"
                    psycopg.connect(wrong).close()
                except psycopg.OperationalError as err:
                    return "password" in str(err)
                return False

            until_sync(asks_for_it, "the cluster asks the role for its password")
            urls = [
                f"postgresql://{role}:{quote(SECRET, safe='')}@/{name}?host={postgres.root}"
                for name in databases
            ]
            ran: list[tuple[list[str], dict[str, str]]] = []
            run = subprocess.run

            def recorded(command: list[str], **kwargs: Any) -> Any:
                ran.append((command, kwargs.get("env") or {}))
                return run(command, **kwargs)

            source = settings_for(tmp_path / "source", {"database_url": urls[0]})
            store = open_store(source)
            try:
                store.accounts.put("acme", "S1")
            finally:
                store.close()
            monkeypatch.setattr(subprocess, "run", recorded)
            backup(source, tmp_path / "hub.tar")
            target = settings_for(tmp_path / "target", {"database_url": urls[1]})
            restore(target, tmp_path / "hub.tar")
            store = open_store(target)
            try:
                assert [a["name"] for a in store.accounts.all()] == ["acme"]
            finally:
                store.close()
        finally:
            hba.write_text(trusting)
            conn.execute("SELECT pg_reload_conf()")
    assert [Path(command[0]).name for command, _ in ran] == ["pg_dump", "pg_restore"]
    for command, env in ran:
        assert not [arg for arg in command if "s3cret" in arg], command
        assert env["PGPASSWORD"] == SECRET
