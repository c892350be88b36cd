"""The hub's certificate authority at work: its files, its rotation, the names a node's
certificate may carry, and the TLS contexts of the hub's two ends of mutual TLS.

Files (the data directory's `pki/`, shared by every replica):

- `ca.crt`, `ca.key`: the CA that signs now.
- `ca-next.crt`, `ca-next.key`: a CA staged by `kvl hub ca rotate`: trusted, not signing.
- `ca-previous.crt`: the CA that signed before the last switch: trusted until retired.
- `server.crt`, `server.key`: the hub's own certificate, for its names and overlay
  address, serving TLS and authenticating the hub to nodes. Issued again at will (its
  names changed, its CA switched, a third of its lifetime left): nodes trust the CA, not
  this certificate.

Rotation of the CA, each step a `kvl hub ca rotate` (the running hub follows the files
within `pki.reload_s`):

1. **stage**: a new CA joins the trust bundle. Nodes see the bundle's digest change in
   their heartbeat answers and fetch it.
2. **switch** (once every node holds the new bundle: `kvl hub ca status`): the new CA
   signs; the hub's certificate is issued again under it; nodes whose certificates the
   old CA signed are told to renew at their next heartbeat.
3. **retire** (once no live node certificate is the old CA's): the old CA leaves the
   bundle.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import secrets
import socket
import time
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from cryptography import x509

from hub.state.certificates import IssuedCertificate
from shared import pki, tls
from shared.files import write_public

if TYPE_CHECKING:
    import ssl
    from collections.abc import Callable, Mapping
    from pathlib import Path

    from hub.settings import HubSettings
    from hub.state.certificates import Certificates
    from hub.state.nodes import Node

log = logging.getLogger(__name__)

CA_NAME = "kovenlab-hub CA"
HUB_NAME = "kovenlab-hub"
# Names any node may have: they are the client's own machine, never another's.
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


class RotationError(Exception):
    """A rotation step that does not fit the CA's present phase; the message says why."""


class NameRefusedError(Exception):
    """A node asked for a name that is not its own to have."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.name = name


def new_signing_ca() -> pki.Issued:
    # Each CA's name is its own (two made within a second too), so a certificate's
    # issuer says which CA signed it.
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return pki.new_ca(f"{CA_NAME} {stamp} {secrets.token_hex(4)}")


@dataclass(frozen=True)
class Phase:
    signing: pki.Issued
    staged: bytes | None  # ca-next.crt
    previous: bytes | None  # ca-previous.crt

    @property
    def name(self) -> str:
        if self.staged is not None:
            return "staged"
        if self.previous is not None:
            return "switched"
        return "steady"

    @property
    def trusted(self) -> list[bytes]:
        """Every CA certificate a peer's certificate may chain to, the signing one first."""
        return [c for c in (self.signing.cert_pem, self.staged, self.previous) if c is not None]

    # A phase never changes (a rotation step makes a new one), and every heartbeat answer
    # carries its digest and compares the caller's issuer with its signing CA's name:
    # worked out on each, they were 8 % of the hub's event loop at 10,000 nodes (the CA
    # certificate parsed again from PEM each time).
    @cached_property
    def bundle(self) -> bytes:
        return pki.bundle(self.trusted)

    @cached_property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.bundle).hexdigest()

    @cached_property
    def signing_name(self) -> str:
        """The common name of the CA that signs (a peer certificate's issuer)."""
        return issuer_name_of(self.signing)


class Authority:
    """The CA files of one hub (any replica), read again when they change."""

    def __init__(self, settings: HubSettings) -> None:
        self._settings = settings
        self.directory: Path = settings.pki_dir
        self.domain = settings.pki.fleet_domain

    # ---- the CA and its rotation

    def phase(self) -> Phase:
        signing = pki.read_issued(self.directory, "ca")
        if signing is None:
            signing = pki.write_issued(self.directory, "ca", new_signing_ca())
        staged = self._cert("ca-next")
        previous = self._cert("ca-previous")
        return Phase(signing, staged, previous)

    def _cert(self, stem: str) -> bytes | None:
        path = self.directory / f"{stem}.crt"
        return path.read_bytes() if path.is_file() else None

    def rotate(self) -> str:
        """The next rotation step: stage, switch or retire; the phase it leaves."""
        phase = self.phase()
        if phase.name == "steady":
            pki.write_issued(self.directory, "ca-next", new_signing_ca())
            log.info("CA rotation: a new CA is staged in the trust bundle")
        elif phase.name == "staged":
            staged = pki.read_issued(self.directory, "ca-next")
            if staged is None:  # pragma: no cover - a key removed by hand
                raise RotationError("ca-next.key is missing: stage again")
            write_public(self.directory / "ca-previous.crt", phase.signing.cert_pem)
            pki.write_issued(self.directory, "ca", staged)
            (self.directory / "ca-next.crt").unlink()
            (self.directory / "ca-next.key").unlink()
            log.info("CA rotation: the new CA signs; the old one is trusted until retired")
        else:
            (self.directory / "ca-previous.crt").unlink()
            log.info("CA rotation: the old CA is retired from the trust bundle")
        self.hub_certificate()
        return self.phase().name

    # ---- the hub's own certificate

    def hub_names(self) -> list[str]:
        overlay = self._settings.overlay.hub_interface.ip
        return sorted({*self._settings.server.names, str(overlay)})

    def hub_certificate(self) -> pki.Issued:
        """The hub's certificate, issued again when its names changed, its CA is not the
        signing one, or a third of its lifetime is left."""
        signing = self.phase().signing
        current = pki.read_issued(self.directory, "server")
        if current is not None and not self._hub_certificate_due(current, signing):
            return current
        issued = pki.issue_with_key(
            signing,
            common_name=HUB_NAME,
            names=self.hub_names(),
            uri=pki.hub_uri(self.domain),
            lifetime=datetime.timedelta(days=self._settings.pki.hub_certificate_days),
        )
        log.info("issued the hub's certificate for %s", ", ".join(self.hub_names()))
        return pki.write_issued(self.directory, "server", issued)

    def _hub_certificate_due(self, current: pki.Issued, signing: pki.Issued) -> bool:
        try:
            cert = current.certificate
            names = pki.names_of(current.cert_pem)
            uris = pki.uris_of(cert)
            aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
        except (ValueError, x509.ExtensionNotFound):
            return True  # an older hub's, without the extensions strict clients need
        ski = signing.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        return (
            not pki.key_matches(current)  # replicas issuing at once paired them wrong
            or names != self.hub_names()
            or uris != [pki.hub_uri(self.domain)]
            or aki.key_identifier != ski.value.digest
            or pki.now() >= pki.renew_at(current.cert_pem)
        )

    # ---- node certificates

    def node_names(self, name: str, overlay: str | None) -> list[str]:
        """The names the hub gives every node: its name, its `.local` name for the LAN,
        its name under the fleet's domain, its overlay address (each as compared:
        `canonical`)."""
        label = canonical(name)
        names = [label, f"{label}.local", f"{label}.{canonical(self.domain)}"]
        return [*names, canonical(overlay)] if overlay else names

    def check_request(
        self, request: pki.Request, *, name: str, overlay: str | None
    ) -> tuple[list[str], list[str]]:
        """(the names to issue, the names to claim for this node alone), or
        NameRefusedError for the first name the node may not have: a node name that is
        not one DNS label (an address, a dotted name), one of the hub's names or
        addresses (whichever list it came from: the node's own or the hub's decision),
        an overlay address not its own, a DNS name the hub did not give it. Its LAN
        addresses (any other unicast address) it may have. Every name is compared in
        its canonical form (`canonical`); the claim of them all, for this node alone
        against every other live node's, is the store's (`issue_for`)."""
        if _is_address(name):
            raise NameRefusedError(
                name,
                "a node name that is an IP address: revoke the node and enroll it again "
                "under a name that is one DNS label",
            )
        decided = self.node_names(name, overlay)
        hub = {canonical(n) for n in self.hub_names()}
        network = ipaddress.ip_network(self._settings.overlay.prefix)
        lan: list[str] = []
        for asked in request.names:
            requested = canonical(asked)
            if requested in decided or requested in LOOPBACK:
                continue
            try:
                address = ipaddress.ip_address(requested)
            except ValueError:
                raise NameRefusedError(
                    asked,
                    "the hub decides a node's DNS names "
                    f"({', '.join(n for n in decided if n != overlay)}): ask for those, "
                    "its LAN addresses, or loopback",
                ) from None
            if address.version == network.version and address in network:
                raise NameRefusedError(
                    asked,
                    f"an overlay address; this node's is {overlay}, given by the hub",
                )
            if address.is_multicast or address.is_unspecified or address.is_loopback:
                raise NameRefusedError(asked, "not an address of one machine")
            lan.append(requested)
        claim = sorted({*decided, *lan})
        for issued in claim:
            if issued in hub:
                raise NameRefusedError(
                    issued,
                    "a name of the hub (server.names, its overlay address): a node never "
                    "holds one; revoke the node and enroll it again under another name",
                )
        return sorted({*claim, *LOOPBACK}), claim

    def issue_node(
        self, request: pki.Request, names: list[str], node_id: str, name: str
    ) -> tuple[bytes, pki.Issued]:
        """A node certificate for a checked request: (its PEM, the signing CA)."""
        signing = self.phase().signing
        cert = pki.issue(
            signing,
            request.public_key,
            common_name=f"{name}.{self.domain}",
            names=names,
            uri=pki.node_uri(self.domain, node_id),
            lifetime=self.node_lifetime,
        )
        return cert, signing

    @property
    def node_lifetime(self) -> datetime.timedelta:
        return datetime.timedelta(days=self._settings.pki.node_certificate_days)

    # ---- TLS contexts

    def _files(self) -> tuple[Path, Path]:
        self.hub_certificate()
        return self.directory / "server.crt", self.directory / "server.key"

    def server_context(self) -> ssl.SSLContext:
        """The hub's TLS server context: its certificate, and a node's certificate asked
        for and verified against the trust bundle when the node sends one (browsers and
        operators send none: the node routes require it)."""
        return tls.server_context(self._files(), self.phase().bundle)

    def client_context(self) -> ssl.SSLContext:
        """The hub's TLS client context (offload to a node): the node's certificate must
        chain to the trust bundle and name the address called; the hub's certificate
        goes along as its client certificate."""
        return tls.client_context(self.phase().bundle, self._files(), identity=self.node_identity())

    def node_identity(self) -> Callable[[list[str]], bool]:
        """Who the hub accepts where it calls a node: a node's certificate (its URI),
        never the hub's own, which chains to the same CA."""
        return tls.node_identity(pki.node_uri(self.domain, ""))

    def state(self) -> str:
        """What the running hub's contexts depend on: a change means build them again."""
        parts = []
        for stem in ("ca", "ca-next", "ca-previous", "server"):
            path = self.directory / f"{stem}.crt"
            parts.append(path.read_bytes() if path.is_file() else b"-")
        return hashlib.sha256(b"\0".join(parts)).hexdigest()


def canonical(name: str) -> str:
    """A name as the hub compares it: an IP address in its one text form (an IPv4-mapped
    IPv6 address as the IPv4 address it maps: `::ffff:100.64.0.1` is `100.64.0.1`), a DNS
    name in lowercase without a final dot (DNS compares names case-insensitively)."""
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return name.lower().rstrip(".")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _is_address(name: str) -> bool:
    """Whether a node's name reads as an IP address: a literal, or what inet_aton takes
    for one (`100.64.1`, `0x64400001`). The protocol refuses such names now; a node
    enrolled before may have one."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        return True
    try:
        socket.inet_aton(name)
    except OSError:
        return False
    return True


def certify(
    certificates: Certificates, authority: Authority, request: pki.Request, node: Node
) -> IssuedCertificate:
    """Check a node's signing request, claim its names for it alone and sign, in one
    transaction of ``certificates``' store (on its writer thread; inside enrollment's, when the node
    enrolls). NameRefusedError, NameTakenError: nothing is signed, nothing claimed."""
    names, claim = authority.check_request(request, name=node.name, overlay=node.overlay_address)
    issued_at = time.time()
    until = issued_at + authority.node_lifetime.total_seconds()

    def sign() -> IssuedCertificate:
        pem, ca = authority.issue_node(request, names, node.id, node.name)
        cert = x509.load_pem_x509_certificate(pem)
        return IssuedCertificate(
            serial=f"{cert.serial_number:x}",
            node_id=node.id,
            ca=ca.fingerprint,
            names=names,
            issued_at=issued_at,
            not_after=cert.not_valid_after_utc.timestamp(),
            pem=pem.decode(),
        )

    return certificates.issue(node.id, claim, until, sign)


def issuer_name_of(ca: pki.Issued) -> str:
    common = ca.certificate.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
    return str(common[0].value) if common else ""


def issuer_name(peercert: Mapping[str, object] | None) -> str | None:
    """The common name of the CA that issued a verified peer certificate."""
    if not peercert:
        return None
    issuer = peercert.get("issuer", ())
    if not isinstance(issuer, tuple):
        return None
    for rdn in issuer:
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


class HubTls:
    """The running hub's TLS: its server context (replaced live when the files change),
    its client context for calls to nodes, and the trust bundle's digest that heartbeat
    answers carry."""

    def __init__(self, settings: HubSettings) -> None:
        self.authority = Authority(settings)
        self._state = ""
        self.server = tls.LiveContext(self.authority.server_context)
        self.client = self.authority.client_context()
        self.phase = self.authority.phase()
        self._state = self.authority.state()
        # Who each connection's certificate speaks for, and its issuer, read once per
        # connection (hub/api/node.py), not decoded again on every call it carries.
        self.peers: weakref.WeakKeyDictionary[object, tuple[str | None, str | None]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def digest(self) -> str:
        return self.phase.digest

    @property
    def signing_name(self) -> str:
        """The common name of the CA that signs now (a peer certificate's issuer)."""
        return self.phase.signing_name

    def node_of(self, peercert: Mapping[str, object] | None) -> str | None:
        """The node id a verified peer certificate speaks for; "" for a certificate of
        the fleet that is not a node's (the hub's); None for no certificate."""
        if not peercert:
            return None
        prefix = pki.node_uri(self.authority.domain, "")
        for uri in tls.peer_uris(peercert):
            if uri.startswith(prefix):
                return uri[len(prefix) :]
        return ""

    def refresh(self) -> bool:
        """Follow the pki/ folder (a rotation step, a certificate issued again); whether
        anything changed. The hub's certificate is issued again here when it is due."""
        self.authority.hub_certificate()
        state = self.authority.state()
        if state == self._state:
            return False
        self.phase = self.authority.phase()
        self.server.replace()
        self.client = self.authority.client_context()
        self._state = state
        log.info("TLS: serving the CA bundle %s from now on", self.phase.digest)
        return True
