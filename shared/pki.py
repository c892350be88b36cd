"""The fleet's small certificate authority (with `cryptography`): the hub's CA, the hub's
own certificate, and the short-lived certificates it issues nodes.

Every certificate verifies under strict X.509 rules (`openssl verify -x509_strict`,
Python's `VERIFY_X509_STRICT`, the default from Python 3.13): subject and authority key
identifiers, critical basic constraints, key usage and extended key usage fitting its use.

Who a certificate speaks for is a URI name in it, as SPIFFE does: `spiffe://DOMAIN/hub`
for the hub, `spiffe://DOMAIN/node/ID` for a node. Both the hub's and a node's
certificates serve TLS and authenticate as a client (mutual TLS inside the fleet); the
URI says which one a peer is, so a node's certificate never passes for the hub's.

The CA carries no X.509 name constraints: a node's certificate names the LAN addresses
the node reports, which no constraint fixed at the CA's birth can know, and the hub's
names are the operator's to change. What a node may be named is the hub's decision,
checked before anything is signed (hub/certificates.py)."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.files import write_private, write_public

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from pathlib import Path

CA_DAYS = 3650
BACKDATE = datetime.timedelta(minutes=5)  # clocks of a fleet are never quite together


class RequestError(ValueError):
    """A certificate signing request that is not well formed or not self-signed."""


@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert_pem)

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


@dataclass(frozen=True)
class Request:
    """A checked signing request: the key it proves it holds and the names it asks for."""

    public_key: ec.EllipticCurvePublicKey
    names: tuple[str, ...]  # DNS names and IP addresses, as text


def fingerprint(cert_pem: bytes) -> str:
    """``sha256:<hex>`` of the certificate's DER form, as provisioning files pin it."""
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def fingerprint_bytes(value: str) -> bytes:
    """The digest of a ``sha256:<hex>`` fingerprint (colons allowed in the hex)."""
    algorithm, _, digest = value.partition(":")
    if algorithm != "sha256":
        raise ValueError(f"fingerprint {value!r} must start with 'sha256:'")
    raw = bytes.fromhex(digest.replace(":", ""))
    if len(raw) != 32:
        raise ValueError(f"fingerprint {value!r} is not a sha256 digest")
    return raw


def hub_uri(domain: str) -> str:
    return f"spiffe://{domain}/hub"


def node_uri(domain: str, node_id: str) -> str:
    return f"spiffe://{domain}/node/{node_id}"


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    # ECDSA keys sign (handshakes, and certificates for a CA); they never encipher.
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def new_ca(name: str, *, days: int = CA_DAYS) -> Issued:
    """A self-signed CA that signs leaf certificates only (path length 0)."""
    key = new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - BACKDATE)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), key_pem(key))


def issue(
    ca: Issued,
    public_key: ec.EllipticCurvePublicKey,
    *,
    common_name: str,
    names: Sequence[str],
    uri: str,
    lifetime: datetime.timedelta,
) -> bytes:
    """A leaf certificate signed by ``ca``: TLS server and client, for ``names`` (DNS
    names and IP addresses) and the identity ``uri``."""
    ca_cert = ca.certificate
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):  # pragma: no cover - ours only
        raise TypeError("the CA key is not an EC key")
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    start = now()
    alternative = [*_general_names(names), x509.UniformResourceIdentifier(uri)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - BACKDATE)
        .not_valid_after(min(start + lifetime, ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def issue_with_key(
    ca: Issued, *, common_name: str, names: Sequence[str], uri: str, lifetime: datetime.timedelta
) -> Issued:
    """A leaf certificate and its new key (the hub's own)."""
    key = new_key()
    cert = issue(
        ca, key.public_key(), common_name=common_name, names=names, uri=uri, lifetime=lifetime
    )
    return Issued(cert, key_pem(key))


def new_request(names: Sequence[str]) -> tuple[bytes, bytes]:
    """A key (PEM) and a certificate signing request (PEM) asking for ``names`` (DNS
    names and IP addresses); the key never leaves the caller."""
    key = new_key()
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(_general_names(names)), critical=False
        )
    csr = builder.sign(key, hashes.SHA256())
    return key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def read_request(csr_pem: bytes, *, max_names: int = 32) -> Request:
    """A signing request's key and names, checked: PEM, an EC P-256 key, a signature
    that verifies, at most ``max_names`` names. Signs nothing. Raises RequestError."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as err:
        raise RequestError(f"not a PEM certificate signing request: {err}") from err
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
        public_key.curve, ec.SECP256R1
    ):
        raise RequestError("the signing request's key must be an EC P-256 key")
    if not csr.is_signature_valid:
        raise RequestError("the signing request's signature does not verify")
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return Request(public_key, ())
    except ValueError as err:
        raise RequestError(f"the signing request's names are malformed: {err}") from err
    if any(not isinstance(n, (x509.IPAddress, x509.DNSName)) for n in san):
        raise RequestError("a signing request may ask for DNS names and IP addresses only")
    names = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] + [
        str(name) for name in san.get_values_for_type(x509.DNSName)
    ]
    if len(names) > max_names:
        raise RequestError(f"the signing request names {len(names)} names; at most {max_names}")
    return Request(public_key, tuple(dict.fromkeys(names)))


def _general_names(names: Iterable[str]) -> list[x509.GeneralName]:
    alternative: list[x509.GeneralName] = []
    for name in names:
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative.append(x509.DNSName(name))
    return alternative


def names_of(cert_pem: bytes) -> list[str]:
    """A certificate's DNS names and IP addresses, sorted."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return sorted(
        [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
        + list(san.get_values_for_type(x509.DNSName))
    )


def uris_of(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


def renew_at(cert_pem: bytes) -> datetime.datetime:
    """When a certificate is due for renewal: with a third of its lifetime left, well
    before it expires (a node that cannot reach the hub then has days to try again)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return end - (end - start) / 3


def bundle(certificates: Iterable[bytes]) -> bytes:
    """Certificates (PEM) as one PEM bundle, each once, in order."""
    return b"".join(dict.fromkeys(c.strip() + b"\n" for c in certificates))


def split_bundle(pem: bytes) -> list[bytes]:
    """A PEM bundle's certificates (each checked to be one)."""
    return [
        c.public_bytes(serialization.Encoding.PEM) for c in x509.load_pem_x509_certificates(pem)
    ]


def write_issued(folder: Path, stem: str, issued: Issued) -> Issued:
    """Keep ``issued`` as STEM.crt and STEM.key (mode 0600) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    write_private(folder / f"{stem}.key", issued.key_pem)
    write_public(folder / f"{stem}.crt", issued.cert_pem)
    return issued


def read_issued(folder: Path, stem: str) -> Issued | None:
    cert, key = folder / f"{stem}.crt", folder / f"{stem}.key"
    if not (cert.is_file() and key.is_file()):
        return None
    return Issued(cert.read_bytes(), key.read_bytes())


def load_certificate(cert_pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(cert_pem)


def key_matches(issued: Issued) -> bool:
    """Whether the key is the certificate's (two writers at once could pair them wrong)."""
    try:
        key = serialization.load_pem_private_key(issued.key_pem, password=None)
    except ValueError:
        return False
    cert_key = issued.certificate.public_key()
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) == cert_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
