"""A hub that requires node certificates, served on loopback, and a node that holds
one: its provisioning, its link, and the serial its hub serves."""

from __future__ import annotations

import json
import ssl
from typing import TYPE_CHECKING

from cryptography import x509

from appliance.fleet.identity import FleetFiles
from appliance.fleet.link import FleetLink
from appliance.observability.metrics import Metrics
from appliance.state.store import AsyncStore
from hub.app import create_app as create_hub
from hub.appkeys import TLS
from hub.identity import certificates
from hub.settings import HubSettings
from hub.state.store import open_store
from tests.conftest import NoModels, make_settings
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp.test_utils import TestServer
    from pytest_aiohttp import AiohttpServer


def hub_settings(tmp_path: Path, names: list[str] | None = None) -> HubSettings:
    return settings_for(
        tmp_path,
        names=names or ["localhost", "127.0.0.1"],
        require_node_certificates=True,
        pki={"reload_s": 0.5},
    )


async def serve_hub(aiohttp_server: AiohttpServer, hub: HubSettings, port: int) -> TestServer:
    app = create_hub(hub)
    return await aiohttp_server(app, port=port, ssl=app[TLS].server.outer)


def provisioning(tmp_path: Path, hub: HubSettings, port: int) -> Path:
    store = open_store(hub)
    try:
        token = store.tokens.create("school-a", uses=1, expires_in_s=600).plaintext
    finally:
        store.close()
    ca, _ = certificates(hub)
    path = tmp_path / "kovenlab.json"
    path.write_text(json.dumps({
        "hub_url": f"https://127.0.0.1:{port}", "token": token,
        "hub_fingerprint": ca.fingerprint, "name": "lab-server",
    }))  # fmt: skip
    return path


class Node:
    """A fleet link alone (no models), over a real store, and a TLS server on its
    certificate as the LAN API serves it."""

    def __init__(self, link: FleetLink, store: AsyncStore, files: FleetFiles) -> None:
        self.link = link
        self.store = store
        self.files = files
        self.failures = 0

    async def tick(self) -> None:
        await self.link.tick()
        if self.link.error is not None:
            self.failures += 1

    async def sync(self) -> None:
        await self.link.sync()
        if self.link.error is not None:
            self.failures += 1


def link_for(node: Node, tmp_path: Path, provisioning_file: Path) -> FleetLink:
    settings = make_settings(
        tmp_path / "data",
        embeddings={"enabled": False},
        fleet={"provisioning_file": str(provisioning_file), "tunnel": False,
               "heartbeat_s": 3600, "sync_interval_s": 3600},
    )  # fmt: skip
    return FleetLink(settings.fleet, node.files, node.store, Metrics(), NoModels())  # type: ignore[arg-type]


def served_serial(port: int, trust: bytes) -> int:
    """The serial of the certificate a TLS server on loopback serves now."""
    import socket  # noqa: PLC0415

    context = ssl.create_default_context(cadata=trust.decode())
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as wrapped,
    ):
        der = wrapped.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number
