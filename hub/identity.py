"""The hub's identity: its PKI (hub/certificates.py: a CA, which appliances trust, and its
own certificate) and its WireGuard key pair and overlay address. Made on first start,
kept in the data directory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hub.certificates import Authority
from shared.wireguard import KeyPair, ensure_keypair

if TYPE_CHECKING:
    import ipaddress
    import ssl

    from hub.settings import HubSettings
    from shared import pki


def overlay_address(settings: HubSettings) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    """The hub's address on the overlay: the prefix's first host, with the prefix length."""
    return settings.overlay.hub_interface


def hub_keys(settings: HubSettings) -> KeyPair:
    """The hub's WireGuard key pair (the private key stays in the data dir, mode 0600)."""
    folder = settings.data_dir / "wireguard"
    folder.mkdir(parents=True, exist_ok=True)
    return ensure_keypair(folder / "private.key")


def identity(settings: HubSettings) -> dict[str, str]:
    """The hub's WireGuard public key and its overlay address."""
    keys = hub_keys(settings)
    return {
        "wg_public_key": keys.public_key,
        "overlay_address": str(overlay_address(settings).ip),
    }


def certificates(settings: HubSettings) -> tuple[pki.Issued, pki.Issued]:
    """The hub's signing CA and its own certificate, for its names and its overlay
    address (made on first start, again when due: hub/certificates.py)."""
    authority = Authority(settings)
    return authority.phase().signing, authority.hub_certificate()


def ssl_context(settings: HubSettings) -> ssl.SSLContext:
    return Authority(settings).server_context()
