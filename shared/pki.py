"""The hub's small certificate authority: its own TLS certificate, which appliances pin by
fingerprint at enrollment, and the certificates it issues appliances for their LAN API."""

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

from shared.files import write_private

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

CA_DAYS = 3650
LEAF_DAYS = 825


@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert_pem)


def fingerprint(cert_pem: bytes) -> str:
    """``sha256:<hex>`` of the certificate's DER form, as appliances pin it."""
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


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def new_ca(name: str) -> Issued:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_server(ca: Issued, common_name: str, names: Sequence[str]) -> Issued:
    """A TLS server certificate signed by ``ca`` for DNS names and IP addresses."""
    key = _key()
    return Issued(_issue(ca, key.public_key(), common_name, names), _key_pem(key))


def new_request(common_name: str, names: Sequence[str]) -> tuple[bytes, bytes]:
    """A key (PEM) and a certificate signing request (PEM) for a TLS server known by
    ``names`` (DNS names and IP addresses); the key never leaves the caller."""
    key = _key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .add_extension(x509.SubjectAlternativeName(_general_names(names)), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def sign_request(ca: Issued, csr_pem: bytes, *, max_names: int = 32) -> bytes:
    """A server certificate for a signing request, signed by ``ca``: the request's common
    name and names, the request's public key. Raises ValueError for a request that is not
    well formed, not self-signed correctly, or names too much."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as err:
        raise ValueError(f"not a PEM certificate signing request: {err}") from err
    if not csr.is_signature_valid:
        raise ValueError("the signing request's signature does not verify")
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound as err:
        raise ValueError("the signing request names no DNS name or address") from err
    names = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] + list(
        san.get_values_for_type(x509.DNSName)
    )
    if not names or len(names) > max_names:
        raise ValueError(f"the signing request must name 1 to {max_names} names")
    common = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    common_name = str(common[0].value) if common else names[0]
    return _issue(ca, csr.public_key(), common_name, names)  # type: ignore[arg-type]


def _general_names(names: Sequence[str]) -> list[x509.GeneralName]:
    alternative: list[x509.GeneralName] = []
    for name in names:
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative.append(x509.DNSName(name))
    return alternative


def _issue(
    ca: Issued, public_key: ec.EllipticCurvePublicKey, common_name: str, names: Sequence[str]
) -> bytes:
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):  # pragma: no cover - ours only
        raise TypeError("the CA key is not an EC key")
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.SubjectAlternativeName(_general_names(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def load_or_create(directory: Path, name: str, names: Sequence[str]) -> tuple[Issued, Issued]:
    """The CA and the server certificate kept in ``directory`` (made on first use; keys
    mode 0600). A server certificate whose names changed is issued again by the same CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _load(directory, "ca") or _store(directory, "ca", new_ca(f"{name} CA"))
    server = _load(directory, "server")
    if server is None or _names(server) != sorted(names):
        server = _store(directory, "server", issue_server(ca, name, names))
    return ca, server


def _names(issued: Issued) -> list[str]:
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return sorted(
        [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
        + list(san.get_values_for_type(x509.DNSName))
    )


def _load(directory: Path, stem: str) -> Issued | None:
    cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
    if not (cert.is_file() and key.is_file()):
        return None
    return Issued(cert.read_bytes(), key.read_bytes())


def _store(directory: Path, stem: str, issued: Issued) -> Issued:
    write_private(directory / f"{stem}.key", issued.key_pem)
    (directory / f"{stem}.crt").write_bytes(issued.cert_pem)
    return issued
