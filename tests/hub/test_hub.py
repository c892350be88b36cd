"""The hub: enrollment tokens, the node registry, enrollment over HTTPS with a pinned
certificate, heartbeats and the idempotent ledger, and its CLI. A real hub on loopback;
the WireGuard tunnel between hub and node has its own netns tests."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web

from hub.app import create_app
from hub.cli.common import parse_duration
from hub.fleet.heartbeats import HEARTBEATS_EVERY_S
from hub.http import LARGE_BODY, answer
from hub.identity import certificates, ssl_context
from hub.planning.health import NodeStatus, node_status
from hub.state.sql import DatabaseError
from hub.state.store import AsyncHubStore, open_store
from hub.state.tokens import TokenProblem, TokenRefusedError
from shared import pki, protocol
from shared.errors import ErrorCode
from shared.protocol import EVENTS
from tests.conftest import kvl
from tests.hubs import PREFIX, new_key, settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient, AiohttpServer

    from tests.hub.conftest import HubDatabase

# -- tokens and the registry -----------------------------------------------------------------


def test_tokens_are_single_use_by_default_and_expire_or_get_revoked(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    store = open_store(settings_for(tmp_path, hub_database))
    try:
        token = store.tokens.create("school-a", uses=1, expires_in_s=3600)
        enrolled = store.nodes.enroll(
            token.plaintext,
            name="node-1",
            wg_public_key=new_key(),
            overlay_prefix=PREFIX,
            labels={"room": "lab"},
            versions={},
        )
        assert enrolled.node.site == "school-a"
        assert enrolled.node.overlay_address == "100.64.0.2"  # .1 is the hub's
        assert enrolled.node_token.startswith("kvln_")
        with pytest.raises(TokenRefusedError) as used:
            store.nodes.enroll(
                token.plaintext,
                name="n2",
                wg_public_key=new_key(),
                overlay_prefix=PREFIX,
                labels={},
                versions={},
            )
        assert used.value.problem is TokenProblem.used

        twice = store.tokens.create("school-a", uses=2, expires_in_s=3600)
        addresses = {
            store.nodes.enroll(
                twice.plaintext,
                name=f"m{i}",
                wg_public_key=new_key(),
                overlay_prefix=PREFIX,
                labels={},
                versions={},
            ).node.overlay_address
            for i in range(2)
        }
        assert addresses == {"100.64.0.3", "100.64.0.4"}

        expired = store.tokens.create("school-b", uses=5, expires_in_s=0.01)
        time.sleep(0.02)  # time is the subject: the token's 10 ms run out
        revoked = store.tokens.create("school-b", uses=5, expires_in_s=3600)
        store.tokens.revoke(revoked.prefix)
        for plaintext, problem in [
            (expired.plaintext, TokenProblem.expired),
            (revoked.plaintext, TokenProblem.revoked),
            ("kvle_AAAAAAAA_" + "A" * 32, TokenProblem.unknown),
            (_spoiled(token.plaintext), TokenProblem.unknown),
            ("not a token", TokenProblem.unknown),
        ]:
            with pytest.raises(TokenRefusedError) as refused:
                store.nodes.enroll(
                    plaintext,
                    name="x",
                    wg_public_key=new_key(),
                    overlay_prefix=PREFIX,
                    labels={},
                    versions={},
                )
            assert refused.value.problem is problem, plaintext
        assert [t.state(time.time()) for t in store.tokens.all()] == [
            "used",
            "used",
            "expired",
            "revoked",
        ]
    finally:
        store.close()


LIMITS = {"stale_after_s": 45.0, "offline_after_s": 120.0}


def test_node_status_is_a_state_never_an_eviction() -> None:
    assert node_status(None, 100, revoked=False, **LIMITS) is NodeStatus.offline
    assert node_status(90, 100, revoked=False, **LIMITS) is NodeStatus.online
    assert node_status(50, 100, revoked=False, **LIMITS) is NodeStatus.stale
    assert node_status(-30, 100, revoked=False, **LIMITS) is NodeStatus.offline
    assert node_status(99, 100, revoked=True, **LIMITS) is NodeStatus.revoked


def test_durations() -> None:
    assert parse_duration("90s") == 90
    assert parse_duration("30m") == 1800
    assert parse_duration("24h") == 86_400
    assert parse_duration("2") == 2
    with pytest.raises(Exception, match="duration"):
        parse_duration("soon")


# -- over HTTPS --------------------------------------------------------------------------------


async def test_enroll_over_https_with_a_pinned_certificate_then_heartbeat_and_sync(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    token = store.tokens.create("school-a", uses=1, expires_in_s=3600).plaintext
    store.accounts.put("pupils", "S1")
    store.close()
    server = await aiohttp_server(create_app(settings), ssl=ssl_context(settings))
    _, cert = certificates(settings)
    pinned = aiohttp.Fingerprint(pki.fingerprint_bytes(cert.fingerprint))
    base = f"https://127.0.0.1:{server.port}"
    key = new_key()
    async with aiohttp.ClientSession() as client:
        enroll = {"token": token, "name": "lab-server", "wg_public_key": key}
        # A signing request that is not one: refused before the token is spent.
        bad_csr = await client.post(
            f"{base}/v1/enroll",
            json={**enroll, "lan_csr": "not a request"},
            ssl=pinned,
            headers=protocol.HEADERS,
        )
        assert bad_csr.status == 400
        assert (await bad_csr.json())["error"]["param"] == "lan_csr"
        response = await client.post(
            f"{base}/v1/enroll", json=enroll, ssl=pinned, headers=protocol.HEADERS
        )
        assert response.status == 201, await response.text()
        enrolled = await response.json()
        assert enrolled["overlay_address"] == "100.64.0.2"
        assert enrolled["hub"]["overlay_address"] == "100.64.0.1"
        assert len(enrolled["hub"]["wg_public_key"]) == 44
        assert "BEGIN CERTIFICATE" in enrolled["hub"]["ca_pem"]

        # The same token again: refused, naming the problem.
        again = await client.post(
            f"{base}/v1/enroll",
            json={**enroll, "wg_public_key": new_key()},
            ssl=pinned,
            headers=protocol.HEADERS,
        )
        assert again.status == 401
        error = (await again.json())["error"]
        assert error["code"] == ErrorCode.invalid_enrollment_token
        assert "already used" in error["message"]

        # A hub with another certificate is refused by the pin, before any token is sent.
        other = pki.issue_with_key(
            pki.new_ca("impostor"),
            common_name="kovenlab-hub",
            names=["127.0.0.1"],
            uri="spiffe://kvl.internal/hub",
            lifetime=datetime.timedelta(days=1),
        )
        wrong = aiohttp.Fingerprint(pki.fingerprint_bytes(other.fingerprint))
        with pytest.raises(aiohttp.ServerFingerprintMismatch):
            await client.post(f"{base}/v1/enroll", json=enroll, ssl=wrong, headers=protocol.HEADERS)

        node = {"Authorization": f"Bearer {enrolled['node_token']}", **protocol.HEADERS}
        beat = await client.post(
            f"{base}/v1/node/heartbeat",
            # The node's word on its protocol gives way to its call's (`Kvl-Protocol`).
            json={
                "versions": {"kvl": "0.1.0", "protocol": "99"},
                "capacity": {"cpu_percent": 12.5},
            },
            headers=node,
            ssl=pinned,
        )
        assert beat.status == 200, await beat.text()
        events = [
            {"id": f"e{i}", "kind": "usage", "body": {"account": "pupils", "tokens_in": i}}
            for i in range(5)
        ]
        first = await client.post(
            f"{base}/v1/node/events", json={"events": events}, headers=node, ssl=pinned
        )
        assert await first.json() == {"acknowledged": [f"e{i}" for i in range(5)], "new": 5}
        # A resend (the acknowledgement was lost) is acknowledged and stored once.
        resend = await client.post(
            f"{base}/v1/node/events",
            json={
                "events": [
                    *events[3:],
                    {"id": "e5", "kind": "usage", "body": {"account": "pupils"}},
                ]
            },
            headers=node,
            ssl=pinned,
        )
        assert (await resend.json())["new"] == 1

        missing = await client.post(f"{base}/v1/node/heartbeat", json={}, ssl=pinned)
        assert missing.status == 401
        assert (await missing.json())["error"]["code"] == ErrorCode.invalid_node_token
        bad = await client.post(
            f"{base}/v1/enroll",
            json={**enroll, "wg_public_key": "nope"},
            ssl=pinned,
            headers=protocol.HEADERS,
        )
        assert bad.status == 400
        assert (await bad.json())["error"]["param"] == "wg_public_key"

    store = open_store(settings)
    try:
        assert store.ledger.count() == 6
        # Heartbeats are written behind, within a second.
        for _ in range(50):
            (registered,) = store.nodes.all()
            if registered.last_seen is not None:
                break
            await asyncio.sleep(0.1)
        # Listed with the protocol version it speaks: during a rollout, which nodes are
        # still to upgrade.
        assert registered.versions == {"kvl": "0.1.0", "protocol": str(protocol.PROTOCOL_VERSION)}
        assert registered.capacity == protocol.Capacity(cpu_percent=12.5)
        assert registered.wg_public_key == key
        store.nodes.revoke("lab-server")  # by another process, as `kvl hub nodes revoke`
    finally:
        store.close()
    # The hub remembers the node's token; a revocation by another process reaches it
    # within the second in which its heartbeat flusher reads the revision.
    deadline = time.monotonic() + 3 * HEARTBEATS_EVERY_S
    async with aiohttp.ClientSession() as client:
        while True:
            refused = await client.post(
                f"{base}/v1/node/heartbeat", json={}, headers=node, ssl=pinned
            )
            if refused.status != 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert refused.status == 403
        assert (await refused.json())["error"]["code"] == ErrorCode.node_revoked


async def test_node_calls_must_come_from_the_overlay_address(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database, require_overlay_source=True)
    store = open_store(settings)
    token = store.tokens.create("s", uses=1, expires_in_s=60).plaintext
    node_token = store.nodes.enroll(
        token, name="n", wg_public_key=new_key(), overlay_prefix=PREFIX, labels={}, versions={}
    ).node_token
    store.close()
    server = await aiohttp_server(create_app(settings), ssl=ssl_context(settings))
    context = ssl.create_default_context(cadata=certificates(settings)[0].cert_pem.decode())
    async with aiohttp.ClientSession() as client:
        response = await client.post(
            f"https://127.0.0.1:{server.port}/v1/node/heartbeat",
            json={},
            headers={"Authorization": f"Bearer {node_token}", **protocol.HEADERS},
            ssl=context,  # the hub's CA also verifies it, as a LAN client would
        )
    assert response.status == 403
    error = (await response.json())["error"]
    assert error["code"] == ErrorCode.wrong_source_address
    assert "100.64.0.2" in error["message"]


def test_the_cli_creates_lists_and_revokes_tokens_and_lists_nodes(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    data = str(tmp_path / "hub")
    token = kvl("hub", "tokens", "create", "--site", "school-a", "--uses", "3", "--data-dir", data)
    plaintext = token.stdout.strip()
    assert plaintext.startswith("kvle_")
    assert len(token.stdout.splitlines()) == 1  # alone on stdout
    listed = kvl("hub", "tokens", "list", "--data-dir", data).stdout
    assert "school-a" in listed
    assert "3 left" in listed
    assert plaintext not in listed
    assert "revoked" in kvl("hub", "tokens", "revoke", plaintext, "--data-dir", data).stdout
    assert kvl("hub", "tokens", "list", "--data-dir", data).stdout.rstrip().endswith("revoked")
    bad = kvl(
        "hub",
        "tokens",
        "create",
        "--site",
        "s",
        "--expires",
        "soon",
        "--data-dir",
        data,
        check=False,
    )
    assert bad.returncode == 2
    assert "duration" in bad.stderr
    assert kvl("hub", "nodes", "list", "--data-dir", data).stdout == ""


async def test_each_node_reads_only_its_own_desired_state_and_serials_grow(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    token = store.tokens.create("s", uses=2, expires_in_s=60).plaintext
    a, b = (
        store.nodes.enroll(
            token, name=n, wg_public_key=new_key(), overlay_prefix=PREFIX, labels={}, versions={}
        )
        for n in ("a", "b")
    )
    assert store.accounts.put("school", "S1") == 1
    store.accounts.create_key("school")
    assert store.serials.desired() == 2
    with pytest.raises(Exception, match="no account"):
        store.accounts.create_key("nobody")
    store.close()
    server = await aiohttp_server(create_app(settings), ssl=ssl_context(settings))
    pinned = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(settings)[1].fingerprint))
    url = f"https://127.0.0.1:{server.port}/v1/node/state"
    async with aiohttp.ClientSession() as client:
        for node in (a, b):
            headers = {"Authorization": f"Bearer {node.node_token}", **protocol.HEADERS}
            # Asking for another node's state is not a thing: the token says whose it is.
            response = await client.get(
                url, params={"node": b.node.id}, headers=headers, ssl=pinned
            )
            state = await response.json()
            assert state["node_id"] == node.node.id
            assert state["serial"] == 2
            assert [k["account"] for k in state["keys"]] == ["school"]
            assert "hash" in state["keys"][0]
            unchanged = await client.get(url, params={"after": "2"}, headers=headers, ssl=pinned)
            assert unchanged.status == 204


def test_the_cli_manages_fleet_accounts_and_keys(tmp_path: Path, hub_database: HubDatabase) -> None:
    data = str(tmp_path / "hub")
    assert (
        "serial 1"
        in kvl("hub", "accounts", "set", "school", "--class", "S2", "--data-dir", data).stdout
    )
    assert "S2" in kvl("hub", "accounts", "list", "--data-dir", data).stdout
    key = kvl("hub", "keys", "create", "--account", "school", "--data-dir", data).stdout.strip()
    assert key.startswith("kvl_")
    assert "serial 3" in kvl("hub", "keys", "revoke", key, "--data-dir", data).stdout
    missing = kvl("hub", "keys", "create", "--account", "nobody", "--data-dir", data, check=False)
    assert missing.returncode == 1
    assert "no account" in missing.stderr


async def test_provision_writes_a_file_an_appliance_enrolls_with(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    from appliance.fleet.identity import FleetFiles  # noqa: PLC0415
    from appliance.fleet.link import enroll  # noqa: PLC0415
    from shared.provisioning import Provisioning  # noqa: PLC0415

    settings = settings_for(tmp_path, hub_database)
    data = str(settings.data_dir)
    bad = kvl("hub", "provision", "--site", "s", "--name", "no spaces", "--data-dir", data,
              check=False)  # fmt: skip
    assert bad.returncode == 2
    assert "name" in bad.stderr
    # One DNS label: a dotted name could be one of the hub's, a number reads as an address.
    for name in ("hub.example.test", "100"):
        bad = kvl("hub", "provision", "--site", "s", "--name", name, "--data-dir", data,
                  check=False)  # fmt: skip
        assert bad.returncode == 2
        assert "one DNS label" in bad.stderr
    assert kvl("hub", "tokens", "list", "--data-dir", data).stdout == ""  # none was made

    server = await aiohttp_server(create_app(settings), ssl=ssl_context(settings))
    path = tmp_path / "kovenlab.json"
    kvl("hub", "provision", "--site", "school-b", "--name", "lab-2", "--data-dir", data,
        "--url", f"https://127.0.0.1:{server.port}", "--output", str(path))  # fmt: skip
    assert path.stat().st_mode & 0o777 == 0o600  # it holds a token
    provisioning = Provisioning.load(path)
    # The CA's fingerprint: the hub's own certificate may be issued again at will.
    assert provisioning.hub_fingerprint == certificates(settings)[0].fingerprint
    files = FleetFiles(tmp_path / "node")
    identity = await enroll(files, provisioning)
    assert (identity.name, identity.site) == ("lab-2", "school-b")
    # Its certificate came with the answer, and the bundle it trusts the hub by.
    assert files.certificate.present
    assert files.certificate.trust() == certificates(settings)[0].cert_pem


@pytest.mark.parametrize(
    ("with_certificates", "reconnect"), [(True, False), (True, True), (False, False)]
)
async def test_the_simulator_enrolls_a_fleet_and_its_heartbeats_and_syncs_land(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    hub_database: HubDatabase,
    with_certificates: bool,
    reconnect: bool,
) -> None:
    """With certificates (mutual TLS, a connection per node, or a handshake per call),
    and without (token only, shared connections: how a hub of an earlier commit is
    measured)."""
    from tests.benchmarks.simulate import Simulator  # noqa: PLC0415

    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    token = store.tokens.create("simulated", uses=20, expires_in_s=600).plaintext
    store.accounts.put("simulated", "S1")  # the account its usage events are for
    store.close()
    server = await aiohttp_server(create_app(settings), ssl=ssl_context(settings))
    url = f"https://127.0.0.1:{server.port}"
    ca, served = certificates(settings)
    trust = ca.cert_pem if with_certificates else served.fingerprint
    connections = 0 if with_certificates else 4
    async with Simulator(url, trust, connections=connections, reconnect=reconnect) as sim:
        nodes, enrolled = await sim.enroll(token, 20)
        assert len(nodes) == 20
        assert enrolled.summary()["failed"] == {}
        first = (await sim.connect(nodes)).summary()
        assert (first["ok"], first["failed"]) == (20, {})
        # One more than the token allows: refused, and counted as such.
        _, refused = await sim.enroll(token, 1, prefix="extra")
        assert refused.summary()["failed"] == {"401": 1}
        # Three events a sync, and half the syncs sent twice (lost acknowledgements).
        load = await sim.run(nodes, interval_s=0.5, duration_s=1.5, events=3, resend=0.5)
    summary = load.summary()
    assert summary["heartbeats"]["failed"] == {}
    assert summary["heartbeats"]["ok"] == 60  # 20 nodes x 3 periods (the first aside)
    assert summary["heartbeats"]["p99_ms"] is not None
    assert summary["sync"]["failed"] == {}
    assert summary["sync"]["events"] == 180
    assert summary["sync"]["resent"] > 0
    assert summary["sync"]["new"] == 180  # each event new once, resends included
    await server.close()  # the last heartbeats are flushed on the way out
    store = open_store(settings)
    try:
        registered = store.nodes.all()
        assert store.ledger.count() == 180
    finally:
        store.close()
    assert len(registered) == 20
    assert len({n.overlay_address for n in registered}) == 20
    assert all(n.last_seen is not None for n in registered)
    assert all(n.capacity.models == ["gemma-3-270m@1.0.0"] for n in registered)


async def test_heartbeat_answers_carry_the_desired_serial(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    token = store.tokens.create("s", uses=1, expires_in_s=60).plaintext
    node_token = store.nodes.enroll(
        token, name="n", wg_public_key=new_key(), overlay_prefix=PREFIX, labels={}, versions={}
    ).node_token
    store.close()
    server = await aiohttp_server(create_app(settings), ssl=ssl_context(settings))
    pinned = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(settings)[1].fingerprint))
    headers = {"Authorization": f"Bearer {node_token}", **protocol.HEADERS}

    async def serial() -> int:
        async with aiohttp.ClientSession() as client:
            answer = await client.post(
                f"https://127.0.0.1:{server.port}/v1/node/heartbeat",
                json={},
                headers=headers,
                ssl=pinned,
            )
            assert answer.status == 200
            return int((await answer.json())["desired_serial"])

    before = await serial()
    store = open_store(settings)
    store.accounts.put("school", "S1")  # another process's change: the serial moves
    store.close()
    for _ in range(30):  # the hub reads it again within a second
        if await serial() > before:
            break
        await asyncio.sleep(0.1)
    assert await serial() == before + 1


async def test_event_batches_arriving_together_are_committed_together_and_each_answered(
    tmp_path: Path, hub_database: HubDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    token = store.tokens.create("s", uses=3, expires_in_s=60).plaintext
    nodes = [
        store.nodes.enroll(token, name=f"n{i}", wg_public_key=new_key(), overlay_prefix=PREFIX,
                     labels={}, versions={}).node.id
        for i in range(3)
    ]  # fmt: skip
    store.close()
    hub = AsyncHubStore(settings)
    await hub.open()
    commits = 0
    store_events = hub.sync.ledger.store_events

    def counted(*args: Any) -> Any:
        nonlocal commits
        commits += 1
        return store_events(*args)

    monkeypatch.setattr(hub.sync.ledger, "store_events", counted)  # counts, and does the real work
    try:
        # 30 batches of 10 events at once, each event in two batches (a resend).
        batches = [
            (nodes[b % 3], EVENTS.validate_python(
                [{"id": f"e{(b * 5 + i) % 150}", "kind": "usage",
                  "body": {"account": "a", "tokens_in": 1}} for i in range(10)]))
            for b in range(30)
        ]  # fmt: skip
        answers = await asyncio.gather(
            *(hub.ingest(node, events) for node, events in batches), return_exceptions=True
        )
        for (_, events), answer in zip(batches, answers, strict=True):
            assert not isinstance(answer, BaseException), answer
            assert answer[0] == [e.id for e in events]
        assert sum(a[1] for a in answers if isinstance(a, tuple)) == 150
        assert commits < len(batches)  # grouped: fewer commits than batches
        assert await hub.run(hub.sync.ledger.count) == 150
        # A batch the database refuses (its node is not registered) fails alone: the
        # group is committed again one batch at a time.
        bad = EVENTS.validate_python([{"id": "bad", "kind": "usage", "body": {"account": "a"}}])
        good = EVENTS.validate_python([{"id": "good", "kind": "usage", "body": {"account": "a"}}])
        refused, stored = await asyncio.gather(
            hub.ingest("no-such-node", bad), hub.ingest(nodes[0], good), return_exceptions=True
        )
        assert isinstance(refused, DatabaseError)
        assert stored == (["good"], 1, {"usage": 1})
    finally:
        await hub.close()


def _spoiled(secret: str) -> str:
    """The secret with its last character changed (to another one, whatever it was)."""
    return secret[:-1] + ("y" if secret.endswith("x") else "x")


async def test_a_protocol_answer_over_a_mebibyte_is_written_in_chunks(
    aiohttp_client: AiohttpClient,
) -> None:
    """A desired state of over 1 MiB (a large fleet's accounts) is answered whole, and not
    from bytes written at once, which aiohttp warns holds the event loop: under the
    tests' warnings-as-errors that warning was a 500 at every state pull."""
    state = protocol.DesiredState(
        node_id="n",
        serial=1,
        accounts=[protocol.AccountState(name=f"account-{i:06d}", service_class="S1")
                  for i in range(30_000)],
        keys=[],
    )  # fmt: skip
    assert len(protocol.dump_for(state, protocol.PROTOCOL_VERSION)) > LARGE_BODY

    async def pull(request: web.Request) -> web.Response:
        return answer(state)

    app = web.Application()
    app.router.add_get("/state", pull)
    client = await aiohttp_client(app)
    response = await client.get("/state")
    assert response.status == 200
    assert protocol.DesiredState.model_validate_json(await response.read()) == state
