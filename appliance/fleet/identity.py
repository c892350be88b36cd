"""What the appliance knows of its fleet: the provisioning file it enrolls with, and the
identity enrollment gave it (kept in the data directory, so a restart does not re-enroll)."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from appliance.fleet.certificates import NodeCertificate
from shared.files import write_private
from shared.provisioning import BootstrapKey, Provisioning, ProvisioningError
from shared.wireguard import KeyPair, ensure_keypair

if TYPE_CHECKING:
    from pathlib import Path

    from appliance.settings import ApplianceSettings

log = logging.getLogger(__name__)


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
        from shared import pki  # noqa: PLC0415 - cryptography (14 MiB): only when enrolling

        return pki.fingerprint_bytes(self.hub_fingerprint)


class FleetFiles:
    """The fleet files in the data directory: the WireGuard private key (never leaves the
    node), the identity, and the node's certificate (appliance/fleet/certificates.py)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.key_path = directory / "wireguard.key"
        self.identity_path = directory / "identity.json"
        self.certificate = NodeCertificate(directory)

    def lan_tls(self) -> tuple[Path, Path] | None:
        """(certificate, key) when the hub issued this node its certificate."""
        return self.certificate.files if self.certificate.present else None

    def wireguard_key(self) -> KeyPair:
        """This node's WireGuard key pair, made on first use (the private key, mode 0600,
        never leaves the node)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return ensure_keypair(self.key_path)

    def identity(self) -> Identity | None:
        if not self.identity_path.is_file():
            return None
        identity = Identity.model_validate(json.loads(self.identity_path.read_text()))
        if self.certificate.trust() is None and identity.hub.ca_pem.strip():
            # Enrolled before trust bundles (protocol 2): the CA it was given then.
            with contextlib.suppress(ValueError):  # not a certificate: the hub sends one
                self.certificate.save_trust(identity.hub.ca_pem.encode())
        return identity

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


@dataclass(frozen=True)
class Provisioned:
    """What the provisioning file says, as read at start."""

    hub: bool  # the node is to be in a fleet: it enrolls, and its hub owns its accounts
    bootstrap_key: BootstrapKey | None = None  # a site without a hub: its first admin key


def provisioned(path: Path | None) -> Provisioned:
    """The provisioning file at `path` (`fleet.provisioning_file`), read at start. A file
    that cannot be read counts as a fleet's, as it did before files without a hub: the
    fleet link tries it again at every heartbeat and logs why it fails, and the node does
    not take local account writes meanwhile (the safe side, for a node meant for a hub)."""
    if path is None:
        return Provisioned(hub=False)
    try:
        document = Provisioning.load(path)
    except ProvisioningError as err:
        log.error("%s; the fleet link tries it again at every heartbeat", err)  # noqa: TRY400
        return Provisioned(hub=True)
    return Provisioned(hub=document.hub is not None, bootstrap_key=document.bootstrap_key)
