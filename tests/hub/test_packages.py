"""Content packages at the hub: what nodes report through the outbox (each event applied
once, in order), archives the hub keeps and seeds by site, served to the seeded nodes
only, over the operator API and the CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from pydantic import ValidationError
from wireguard_tools import WireguardKey

from appliance.packages.cache import PackageCache
from hub.app import create_app
from hub.identity import certificates, ssl_context
from hub.settings import HubSettings
from hub.state.nodes import Node
from hub.state.store import HubStore, open_store
from shared import pki, protocol
from shared.protocol import EVENTS
from tests.conftest import kvl
from tests.hubs import settings_for
from tests.packages import package

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase


def _settings(tmp_path: Path, database: HubDatabase) -> HubSettings:
    return settings_for(tmp_path, database)


def _enroll(store: HubStore, name: str, site: str) -> tuple[Node, str]:
    token = store.tokens.create(site, uses=1, expires_in_s=60).plaintext
    key = str(WireguardKey.generate().public_key())
    enrolled = store.nodes.enroll(token, name=name, wg_public_key=key,
                                  overlay_prefix="100.64.0.0/10", labels={},
                                  versions={})  # fmt: skip
    return enrolled.node, enrolled.node_token


def _report(n: int, event_id: str, kind: str = "package") -> dict[str, Any]:
    manifest, _ = package(n)
    body: dict[str, Any] = {"id": manifest.id, "version": manifest.version}
    if kind == "package":
        body |= {"title": manifest.title, "topic": manifest.topic, "level": "beginner",
                 "items": 1, "size": 1234, "digest": "sha256:" + "1" * 64,
                 "lineage": manifest.lineage.model_dump(mode="json"),
                 "created_at": manifest.created_at, "origin": "made"}  # fmt: skip
    return {"id": event_id, "kind": kind, "body": body}


def test_package_reports_are_applied_once_and_in_order(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    store = open_store(_settings(tmp_path, hub_database))
    a, _ = _enroll(store, "node-a", "north")
    b, _ = _enroll(store, "node-b", "south")
    ids, new = store.ledger.ingest(
        a.id, EVENTS.validate_python([_report(1, "e1"), _report(2, "e2")])
    )
    assert (ids, new) == (["e1", "e2"], 2)
    store.ledger.ingest(b.id, EVENTS.validate_python([_report(1, "e3")]))
    found = {p.id: p for p in store.packages.find()}
    one = found[package(1)[0].id]
    assert (one.origin_node, one.nodes, one.lineage["model"]["name"]) == (
        a.id, sorted([a.id, b.id]), "gemma3-270m")  # fmt: skip
    assert store.packages.find("topic 2")[0].id == package(2)[0].id

    # Removed by node A, then the same report resent (an ack lost): still removed.
    removed = {
        "id": "e4",
        "kind": "package_removed",
        "body": {"id": one.id, "version": one.version},
    }
    store.ledger.ingest(a.id, EVENTS.validate_python([removed]))
    store.ledger.ingest(a.id, EVENTS.validate_python([_report(1, "e1")]))
    assert {p.id: p for p in store.packages.find()}[one.id].nodes == [b.id]

    # A malformed report never reaches the store: the protocol refuses it whole.
    with pytest.raises(ValidationError):
        EVENTS.validate_python([{"id": "e5", "kind": "package", "body": {"id": "x"}}])
    store.close()


async def test_archives_are_kept_seeded_by_site_and_served_to_seeded_nodes_only(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = _settings(tmp_path, hub_database)
    data = str(hub.data_dir)
    operator = kvl("hub", "operators", "create", "--name", "ops", "--data-dir", data).stdout.strip()
    store = open_store(hub)
    north, north_token = _enroll(store, "node-n", "north")
    south, south_token = _enroll(store, "node-s", "south")
    serial = store.serials.desired()
    store.close()
    cache = PackageCache(tmp_path / "cache", max_bytes=1 << 30)
    manifest, files = package(7, files={"items.json": b"[7]", "audio/intro.wav": b"RIFF" * 99})
    cache.put(manifest, files, "key-7")
    archive = cache.bundle(manifest.id)

    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    base = f"https://127.0.0.1:{server.port}"

    async def call(method: str, path: str, token: str = operator, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {token}", **protocol.HEADERS}
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, base + path, headers=headers, ssl=pin, **kw) as response,
        ):
            body = await response.read()
            return response.status, body

    status, body = await call("POST", "/v1/admin/packages?seed=north", data=archive)
    assert status == 201, body
    status, body = await call("POST", "/v1/admin/packages", data=b"not an archive")
    assert status == 400
    assert b"not a package archive" in body

    store = open_store(hub)
    try:
        assert store.serials.desired() > serial  # the nodes pull their state again
        seeded = store.desired.of(north).packages
        assert [(p.id, p.version) for p in seeded] == [(manifest.id, manifest.version)]
        assert store.desired.of(south).packages == []
    finally:
        store.close()
    sha256 = seeded[0].sha256
    status, body = await call("GET", f"/v1/node/artifacts/{sha256}", north_token)
    assert (status, body) == (200, archive)
    status, _ = await call("GET", f"/v1/node/artifacts/{sha256}", south_token)
    assert status == 404

    # The CLI sees and steers the same: seeded to every node, then to none.
    listed = kvl("hub", "packages", "list", "--data-dir", data).stdout
    assert f"{manifest.id}@{manifest.version}" in listed
    assert "held by the hub, seeded to north" in listed
    kvl("hub", "packages", "seed", manifest.id, "--data-dir", data)
    store = open_store(hub)
    assert len(store.desired.of(south).packages) == 1
    store.close()
    status, body = await call("DELETE", f"/v1/admin/packages/{manifest.id}/seed")
    assert status == 200, body
    status, body = await call("DELETE", f"/v1/admin/packages/{manifest.id}/seed")
    assert status == 404
    refused = kvl("hub", "packages", "seed", "pkg_nope", "--data-dir", data, check=False)
    assert refused.returncode != 0
    assert "holds no archive of pkg_nope" in refused.stderr
    status, body = await call("GET", "/v1/admin/packages?q=lesson 7")
    assert status == 200
    assert b'"seeded_to": null' in body
    assert b'"held_by_hub": true' in body
