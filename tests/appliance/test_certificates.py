"""A node's certificate over its life, with a real hub over HTTPS on loopback and the
node's fleet link: enrolled with one, renewed before it expires and when the node's
addresses change, served by the node's TLS server without a restart; the CA rotated with
an overlap and the hub's certificate issued again, with no failed call."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web

from appliance.fleet.client import HubRefusedError
from appliance.fleet.identity import FleetFiles
from appliance.state.store import AsyncStore
from hub.appkeys import TLS
from hub.certificates import Authority, HubTls
from hub.identity import certificates
from hub.settings import HubSettings
from hub.state.store import open_store
from shared import pki, protocol
from tests.appliance.node_certificates import (
    Node,
    hub_settings,
    link_for,
    provisioning,
    serve_hub,
    served_serial,
)
from tests.conftest import free_port, kvl, make_settings
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    settings = make_settings(tmp_path / "data", embeddings={"enabled": False})
    store = AsyncStore(settings.db_path)
    await store.open()
    files = FleetFiles(settings.fleet_dir)
    node = Node(None, store, files)  # type: ignore[arg-type]
    yield node
    if node.link is not None:
        await node.link.close()
    await store.close()


async def test_renewed_before_expiry_and_on_new_addresses_and_served_without_restart(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    node: Node,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub = hub_settings(tmp_path)
    port = free_port()
    await serve_hub(aiohttp_server, hub, port)
    node.link = link_for(node, tmp_path, provisioning(tmp_path, hub, port))
    monkeypatch.setattr(node.link, "addresses", lambda: ["192.0.2.70"])
    await node.tick()  # enrolls, heartbeats
    certificate = node.files.certificate
    assert certificate.present
    assert "192.0.2.70" in certificate.names()
    # The LAN API's server on this certificate (as `kvl appliance serve` serves it).
    lan = web.Application()
    lan_port = free_port()
    await aiohttp_server(lan, port=lan_port, ssl=certificate.server(require_client=False).outer)
    trust = certificate.trust()
    assert trust is not None
    first = await asyncio.to_thread(served_serial, lan_port, trust)

    # The node's address changed (DHCP): renewed at the next heartbeat, served at once.
    monkeypatch.setattr(node.link, "addresses", lambda: ["192.0.2.71"])
    await node.tick()
    assert "192.0.2.71" in certificate.names()
    second = await asyncio.to_thread(served_serial, lan_port, trust)
    assert second != first

    # Nothing due: no renewal.
    await node.tick()
    assert await asyncio.to_thread(served_serial, lan_port, trust) == second

    # A third of its lifetime left: renewed, well before it expires.
    not_after = certificate.not_after()
    assert not_after is not None
    renew_at = pki.renew_at(certificate.cert_path.read_bytes()).timestamp()
    node.link.clock = lambda: renew_at + 1
    await node.tick()
    third = await asyncio.to_thread(served_serial, lan_port, trust)
    assert third != second
    assert (certificate.not_after() or 0) >= not_after
    assert node.failures == 0


async def test_ca_rotation_with_overlap_and_a_new_hub_certificate_lose_no_call(
    aiohttp_server: AiohttpServer, tmp_path: Path, node: Node
) -> None:
    hub = hub_settings(tmp_path)
    port = free_port()
    server = await serve_hub(aiohttp_server, hub, port)
    node.link = link_for(node, tmp_path, provisioning(tmp_path, hub, port))
    await node.tick()
    await node.sync()
    certificate = node.files.certificate
    old_ca = certificates(hub)[0]
    hub_tls: HubTls = server.app[TLS]

    async def rotate(expect: str) -> None:
        done = await asyncio.to_thread(kvl, "hub", "ca", "rotate", "--data-dir", str(hub.data_dir))
        assert done.returncode == 0, done.stderr
        await until(lambda: Authority(hub).phase().name == expect)
        await until(lambda: hub_tls.phase.name == expect)  # the running hub followed
        await node.tick()
        await node.sync()

    # 1. Staged: the node fetches the bundle with the new CA; its certificate is still
    # the old CA's, and the hub still signs with it.
    data = str(hub.data_dir)
    await rotate("staged")
    phase = Authority(hub).phase()
    assert certificate.trust() == phase.bundle
    assert phase.staged is not None
    # 2. Switched, once the node holds the new CA (the CLI checks its heartbeat): the new
    # CA signs the hub's certificate and, at the node's next heartbeat, the node's.
    await node.tick()  # the heartbeat reports the bundle the node now holds
    await until(lambda: _digest_reported(hub) == phase.digest)
    await rotate("switched")
    new_ca = Authority(hub).phase().signing
    assert new_ca.fingerprint != old_ca.fingerprint
    await node.tick()  # the hub says renew: renewed under the new CA
    issued = pki.load_certificate(certificate.cert_path.read_bytes())
    assert issued.issuer == new_ca.certificate.subject
    assert issued.issuer != old_ca.certificate.subject  # each CA's name is its own
    # Retiring is refused while a live certificate is the old CA's.
    refused = await asyncio.to_thread(kvl, "hub", "ca", "status", "--data-dir", data)
    assert "previous:" in refused.stdout
    # 3. Retired (the node's old certificate is still live: forced).
    done = await asyncio.to_thread(kvl, "hub", "ca", "rotate", "--data-dir", data, check=False)
    assert done.returncode != 0
    assert "old CA" in done.stderr
    done = await asyncio.to_thread(kvl, "hub", "ca", "rotate", "--force", "--data-dir", data)
    await until(lambda: hub_tls.phase.name == "steady")
    await node.tick()
    await node.sync()
    assert certificate.trust() == pki.bundle([new_ca.cert_pem])

    assert node.failures == 0  # the whole rotation lost no call

    # The hub's names change (a restart with new settings): its certificate is issued
    # again, with a new key; the node trusts the CA, so it keeps its hub. (The restart
    # may cut the connection a call was about to reuse: that call is tried again at the
    # next round, as any call to a hub that was away.)
    before = certificates(hub)[1].fingerprint
    await server.close()
    renamed = hub_settings(tmp_path, names=["hub.example", "localhost", "127.0.0.1"])
    await serve_hub(aiohttp_server, renamed, port)
    assert certificates(renamed)[1].fingerprint != before
    errors = []
    for _ in range(2):
        await node.link.tick()
        errors.append(node.link.error)
    assert errors[-1] is None, errors
    assert not any("certificate" in e or "fingerprint" in e for e in errors if e), errors
    assert await node.link.sync() >= 0
    assert node.link.error is None


def _digest_reported(hub: HubSettings) -> Any:
    store = open_store(hub)
    try:
        (registered,) = store.nodes.all()
    finally:
        store.close()
    return registered.capacity.trust_digest


async def test_a_node_enrolled_before_certificates_gets_its_first_and_must_use_it(
    aiohttp_server: AiohttpServer, tmp_path: Path, node: Node
) -> None:
    """A node of protocol 2 (enrolled without a signing request, the CA it was given in
    its identity) is served on its node token until it asks for its first certificate;
    from then on the hub refuses it without one."""
    from appliance.fleet.identity import HubPeer, Identity  # noqa: PLC0415

    hub = settings_for(tmp_path)
    port = free_port()
    await serve_hub(aiohttp_server, hub, port)
    ca, served = certificates(hub)
    store = open_store(hub)
    try:
        token = store.tokens.create("school-a", uses=1, expires_in_s=600).plaintext
        keys = node.files.wireguard_key()
        enrolled = store.nodes.enroll(
            token, name="old-node", wg_public_key=keys.public_key,
            overlay_prefix=hub.overlay.prefix, labels={}, versions={},
        )  # fmt: skip
    finally:
        store.close()
    url = f"https://127.0.0.1:{port}"
    node.files.save(
        Identity(
            node_id=enrolled.node.id, name="old-node", site="school-a",
            node_token=enrolled.node_token, overlay_address=enrolled.node.overlay_address,
            overlay_prefix=hub.overlay.prefix,
            hub=HubPeer(wg_public_key=keys.public_key, overlay_address="100.64.0.1",
                        endpoint="127.0.0.1:51820", api_url=url, ca_pem=ca.cert_pem.decode()),
            hub_url=url, hub_fingerprint=served.fingerprint,
        )
    )  # fmt: skip
    node.link = link_for(node, tmp_path, tmp_path / "unused.json")
    certificate = node.files.certificate
    assert certificate.trust() == ca.cert_pem  # the CA its identity holds
    assert not certificate.cert_path.exists()
    await node.tick()  # served on its token; asks for its first certificate
    assert node.link.error is None
    assert certificate.cert_path.exists()
    await node.tick()
    await node.sync()
    assert node.failures == 0
    # From now on, a call without it is refused.
    client = node.link._client
    assert client is not None
    certificate.cert_path.rename(tmp_path / "kept.crt")
    certificate._client = None
    with pytest.raises(HubRefusedError) as refused:
        await client.heartbeat({}, protocol.Capacity())
    assert refused.value.code == "client_certificate_required"
