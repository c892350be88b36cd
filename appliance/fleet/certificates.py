"""This node's side of the fleet's trust: the CA bundle it trusts the hub by, and its own
certificate (the hub's CA signs it; the key never leaves the node), which serves the LAN
API, goes with every call to the hub, and serves the hub's calls on the fleet listener.

The certificate is short-lived. The link asks for it again through the tunnel when a
third of its lifetime is left, when the hub says it is due (a CA rotation), and when the
node's LAN addresses changed; the servers take it from the next handshake on, with no
restart (shared/tls.py `LiveContext`). A revoked node is renewed no more, so its
certificate dies within its lifetime.

Files, in the fleet directory: `node.key` (mode 0600), `node.crt`, `trust.pem`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
from typing import TYPE_CHECKING

import psutil

from shared import tls
from shared.files import write_private, write_public

# shared.pki (cryptography: about 14 MiB) is imported where a certificate is handled, not
# with this module: a node that has none (one outside a fleet) never loads it.

if TYPE_CHECKING:
    import ssl
    from pathlib import Path

log = logging.getLogger(__name__)

LOOPBACK = ("localhost", "127.0.0.1", "::1")


def lan_addresses(exclude: ipaddress.IPv4Network | ipaddress.IPv6Network | None) -> list[str]:
    """This machine's unicast addresses a LAN client may call it at: not loopback, not
    link-local, not in ``exclude`` (the fleet's overlay: only the node's own address
    there is its, and the hub adds that one)."""
    found: set[str] = set()
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                address = ipaddress.ip_address(addr.address.split("%")[0])
            except ValueError:
                continue
            if address.is_loopback or address.is_link_local or address.is_multicast:
                continue
            if exclude is not None and address.version == exclude.version and address in exclude:
                continue
            found.add(str(address))
    return sorted(found)


class NodeCertificate:
    """The node's certificate, key and trust bundle in ``directory``; the TLS contexts
    made from them, kept current as they change."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.key_path = directory / "node.key"
        self.cert_path = directory / "node.crt"
        self.trust_path = directory / "trust.pem"
        self._pending_key: bytes | None = None
        self._servers: list[tls.LiveContext] = []
        self._client: ssl.SSLContext | None = None
        self._hub_uri: str | None = None
        # Addresses the hub refused because another node's certificate holds them: not
        # asked for again by this process (nodes side by side on one host share them).
        self.refused: set[str] = set()

    # ---- what is on disk

    @property
    def present(self) -> bool:
        """A certificate, its key and the trust bundle are here, and the key is the
        certificate's (a node that lost power between writing the two has none: it asks
        again)."""
        if not (self.cert_path.is_file() and self.key_path.is_file() and self.trust_path.is_file()):
            return False
        from shared import pki  # noqa: PLC0415

        try:
            issued = pki.Issued(self.cert_path.read_bytes(), self.key_path.read_bytes())
            return pki.key_matches(issued)
        except ValueError:
            return False

    @property
    def files(self) -> tuple[Path, Path]:
        return self.cert_path, self.key_path

    def trust(self) -> bytes | None:
        return self.trust_path.read_bytes() if self.trust_path.is_file() else None

    def trust_digest(self) -> str | None:
        trust = self.trust()
        return None if trust is None else "sha256:" + hashlib.sha256(trust).hexdigest()

    def names(self) -> list[str]:
        if not self.cert_path.is_file():
            return []
        from shared import pki  # noqa: PLC0415

        return pki.names_of(self.cert_path.read_bytes())

    def hub_uri(self) -> str | None:
        """The identity the hub's certificate carries: the fleet domain is in ours."""
        if self._hub_uri is None and self.cert_path.is_file():
            from shared import pki  # noqa: PLC0415

            for uri in pki.uris_of(pki.load_certificate(self.cert_path.read_bytes())):
                head, _, _ = uri.rpartition("/node/")
                if head.startswith("spiffe://"):
                    self._hub_uri = f"{head}/hub"
        return self._hub_uri

    # ---- asking for it

    def request(self, name: str, addresses: list[str]) -> str:
        """A signing request for a new key (kept until the certificate comes back), for
        this node's name, its `.local` name, ``addresses`` and loopback; the hub adds its
        name under the fleet's domain and its overlay address."""
        from shared import pki  # noqa: PLC0415

        key_pem, csr_pem = pki.new_request(sorted({name, f"{name}.local", *LOOPBACK, *addresses}))
        self._pending_key = key_pem
        return csr_pem.decode()

    def save(self, cert_pem: str, trust_pem: str | None) -> None:
        """Keep a certificate the hub issued for the last request (and the trust bundle
        it came with); the servers and the client use it from the next handshake on."""
        if self._pending_key is None:
            raise RuntimeError("a certificate came back for no request of this node")
        self.directory.mkdir(parents=True, exist_ok=True)
        write_private(self.key_path, self._pending_key)
        write_public(self.cert_path, cert_pem)
        self._pending_key = None
        if trust_pem is not None:
            self.save_trust(trust_pem.encode())
        self._refresh()

    def save_trust(self, trust_pem: bytes) -> None:
        from shared import pki  # noqa: PLC0415

        pki.split_bundle(trust_pem)  # certificates only, or ValueError
        self.directory.mkdir(parents=True, exist_ok=True)
        write_public(self.trust_path, trust_pem)
        self._refresh()

    def due(self, at: float, addresses: list[str]) -> str | None:
        """Why the certificate should be asked for again now (None: it need not be):
        none yet, a third of its lifetime left, or LAN addresses it does not name."""
        if not self.present:
            return "no certificate yet"
        from shared import pki  # noqa: PLC0415

        pem = self.cert_path.read_bytes()
        if at >= pki.renew_at(pem).timestamp():
            return "a third of its lifetime is left"
        missing = sorted(set(addresses) - set(pki.names_of(pem)) - self.refused)
        if missing:
            return f"the node's addresses changed ({', '.join(missing)} not in it)"
        return None

    def not_after(self) -> float | None:
        if not self.cert_path.is_file():
            return None
        from shared import pki  # noqa: PLC0415

        return pki.load_certificate(self.cert_path.read_bytes()).not_valid_after_utc.timestamp()

    # ---- TLS contexts

    def client_context(self) -> ssl.SSLContext:
        """For calls to the hub: the trust bundle only (the hub's certificate may be
        issued again at will), the hub's URI required of its certificate, this node's
        certificate presented."""
        if self._client is None:
            trust = self.trust()
            if trust is None:
                raise RuntimeError("no trust bundle yet: the node has not enrolled")
            # The hub, by the URI its certificate carries: a node's certificate chains
            # to the same CA and may name an address of this LAN, so the chain alone
            # would let another node of the fleet answer as the hub.
            self._client = tls.client_context(
                trust,
                self.files if self.present else None,
                identity=tls.hub_identity(self.hub_uri()),
            )
        return self._client

    def server(self, *, require_client: bool) -> tls.LiveContext:
        """A server context on this certificate that follows its renewals; with
        ``require_client``, a handshake without a certificate of the fleet fails (the
        fleet listener, which serves the hub's calls)."""

        def make() -> ssl.SSLContext:
            return tls.server_context(
                self.files, self.trust() if require_client else None, require=require_client
            )

        live = tls.LiveContext(make)
        self._servers.append(live)
        return live

    def _refresh(self) -> None:
        self._client = None
        self._hub_uri = None
        if not self.present:
            return
        for live in self._servers:
            try:
                live.replace()
            except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
                log.error("TLS: the renewed certificate cannot be served: %s", err)  # noqa: TRY400
