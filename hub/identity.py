"""The hub's identity: its PKI (a CA, pinned by appliances, and its TLS server certificate)
and its WireGuard key pair and overlay address. Made on first start, kept in the data
directory."""

from __future__ import annotations

import ipaddress
import ssl
from typing import TYPE_CHECKING

from shared import pki
from shared.wireguard import KeyPair, ensure_keypair

if TYPE_CHECKING:
    from hub.settings import HubSettings


def overlay_address(settings: HubSettings) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    """The hub's address on the overlay: the prefix's first host, with the prefix length."""
    network = ipaddress.ip_network(settings.overlay.prefix)
    return ipaddress.ip_interface(f"{next(network.hosts())}/{network.prefixlen}")


def hub_keys(settings: HubSettings) -> KeyPair:
    """The hub's WireGuard key pair (the private key stays in the data dir, mode 0600)."""
    folder = settings.data_dir / "wireguard"
    folder.mkdir(parents=True, exist_ok=True)
    return ensure_keypair(folder / "private.key")


def identity(settings: HubSettings) -> dict[str, str]:
    """The hub's WireGuard public key, its overlay address and its CA certificate."""
    ca, _ = certificates(settings)
    keys = hub_keys(settings)
    return {
        "wg_public_key": keys.public_key,
        "overlay_address": str(overlay_address(settings).ip),
        "ca_pem": ca.cert_pem.decode(),
    }


def certificates(settings: HubSettings) -> tuple[pki.Issued, pki.Issued]:
    """The hub's CA and its TLS server certificate, for its names and its overlay address
    (made on first start, again when the names change)."""
    names = [*settings.server.names, str(overlay_address(settings).ip)]
    return pki.load_or_create(settings.pki_dir, "kovenlab-hub", sorted(set(names)))


def ssl_context(settings: HubSettings) -> ssl.SSLContext:
    certificates(settings)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.pki_dir / "server.crt", settings.pki_dir / "server.key")
    return context
