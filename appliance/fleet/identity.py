"""What the appliance knows of its fleet: the provisioning file it enrolls with, and the
identity enrollment gave it (kept in the data directory, so a restart does not re-enroll)."""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from appliance.discovery.mdns import lan_addresses
from shared import pki
from shared.files import write_private
from shared.wireguard import KeyPair, ensure_keypair

if TYPE_CHECKING:
    from pathlib import Path

    from appliance.settings import ApplianceSettings


class HubPeer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    wg_public_key: str
    overlay_address: str
    endpoint: str
    api_url: str
    ca_pem: str


class Identity(BaseModel):
    """What enrollment gave this node. Holds the node token: the file is mode 0600."""

    model_config = ConfigDict(extra="forbid")

    node_id: str
    name: str
    site: str
    node_token: str
    overlay_address: str
    overlay_prefix: str
    hub: HubPeer
    hub_url: str
    hub_fingerprint: str

    def pin(self) -> bytes:
        return pki.fingerprint_bytes(self.hub_fingerprint)


class FleetFiles:
    """The fleet files in the data directory: the WireGuard private key (never leaves the
    node) and the identity."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.key_path = directory / "wireguard.key"
        self.identity_path = directory / "identity.json"
        # The LAN API's TLS key and the certificate the hub's CA signed for it.
        self.lan_key_path = directory / "lan.key"
        self.lan_cert_path = directory / "lan.crt"

    def lan_request(self, name: str) -> str:
        """A signing request for this node's LAN certificate; its key (mode 0600) is kept
        for the certificate the hub sends back."""
        names = sorted(
            {name, socket.gethostname(), "localhost", "127.0.0.1", *lan_addresses("0.0.0.0")}  # noqa: S104 - every address, not a bind
        )
        key_pem, csr_pem = pki.new_request(name, names)
        self.directory.mkdir(parents=True, exist_ok=True)
        write_private(self.lan_key_path, key_pem.decode())
        return csr_pem.decode()

    def save_lan_certificate(self, cert_pem: str) -> None:
        self.lan_cert_path.write_text(cert_pem)

    def lan_tls(self) -> tuple[Path, Path] | None:
        """(certificate, key) when the hub issued this node a LAN certificate."""
        if self.lan_cert_path.is_file() and self.lan_key_path.is_file():
            return self.lan_cert_path, self.lan_key_path
        return None

    def wireguard_key(self) -> KeyPair:
        """This node's WireGuard key pair, made on first use (the private key, mode 0600,
        never leaves the node)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return ensure_keypair(self.key_path)

    def identity(self) -> Identity | None:
        if not self.identity_path.is_file():
            return None
        return Identity.model_validate(json.loads(self.identity_path.read_text()))

    def save(self, identity: Identity) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_private(self.identity_path, identity.model_dump_json(indent=2) + "\n")


def lan_tls_files(settings: ApplianceSettings) -> tuple[Path, Path] | None:
    """The LAN API's certificate and key: the operator's, else the one the fleet's hub
    issued at enrollment (with `fleet.lan_tls`), else none (plain HTTP)."""
    server = settings.server
    if server.tls_cert_file is not None and server.tls_key_file is not None:
        return server.tls_cert_file, server.tls_key_file
    if settings.fleet.lan_tls:
        return FleetFiles(settings.fleet_dir).lan_tls()
    return None
