"""A site bundle: what a site without a hub (or behind a link too narrow for one) is brought
in one signed file, made on any connected machine (`kvl bundle create`): models (GGUF),
an image release (a RAUC bundle), content packages (their archives) and a settings overlay.

The file is a tar. Its first member, `bundle.json`, is the manifest: the format and its
version, when and by which kvl it was made, a note, and every part with its kind, path,
size and sha256 (and a model's name and version, a release's version). The second,
`bundle.sig`, signs the manifest's exact bytes: the signer's X.509 certificate and its
signature (RSA-PSS, ECDSA or Ed25519 with SHA-256). The parts follow, in the manifest's
order, each named by its digest.

A node trusts a bundle only as far as its keyring (the CA certificates of the image's RAUC
keyring, `/etc/rauc/keyring.pem`: the fleet's release signer signs bundles as it signs
releases; a site's own signer is a certificate issued by a CA there, or one placed there
whole). `read` checks everything before it returns, and writes only under a staging
folder its caller made: the manifest and the signature first, bounded in size before
they are read (the manifest's signer issued by a keyring CA, valid when the manifest says
it was made, its signature good), then each part as it streams, a regular file of the
manifest's name, size and digest, within the disk's free space. A bundle that fails any
check raises BundleError naming the part, and the node changes nothing.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import os
import re
import secrets
import shutil
import tarfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared import __version__, jsonlimits, tarstream

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from typing import Self

FORMAT: Literal["kvl-bundle"] = "kvl-bundle"
FORMAT_VERSION = 1
MANIFEST = "bundle.json"
SIGNATURE = "bundle.sig"
SUFFIX = ".kvlbundle"
MAX_MANIFEST_BYTES = 1 << 20
MAX_SIGNATURE_BYTES = 64 << 10
MAX_PARTS = 256
MAX_SETTINGS_BYTES = 1 << 20
SPARE_BYTES = 1 << 30  # kept free on the disk the parts are written to
_CHUNK = 1 << 20
_SHA256 = r"^[0-9a-f]{64}$"
_PATH = re.compile(r"^(models|releases|packages)/[0-9a-f]{64}$|^settings\.json$")
_FOLDERS = {"model": "models", "release": "releases", "package": "packages"}

PartKind = Literal["model", "release", "package", "settings"]


class BundleError(Exception):
    """A bundle refused (or not made); `part`: the part that failed, when one did."""

    def __init__(self, message: str, part: str | None = None) -> None:
        super().__init__(message)
        self.part = part


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: PartKind
    path: str = Field(max_length=80)
    size: int = Field(ge=0, le=1 << 50)
    sha256: str = Field(pattern=_SHA256)
    # A model's name and version (as /v1/models lists it), a release's version.
    name: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._-]+$")
    version: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._+-]+$")

    @model_validator(mode="after")
    def _shape(self) -> Self:
        expected = "settings.json" if self.kind == "settings" else f"{_FOLDERS[self.kind]}/"
        if not _PATH.match(self.path) or not self.path.startswith(expected):
            raise ValueError(f"a {self.kind} part is not at {self.path!r}")
        if self.kind != "settings" and self.path.rsplit("/", 1)[1] != self.sha256:
            raise ValueError(f"{self.path} is not named by its sha256")
        if self.kind == "model" and (self.name is None or self.version is None):
            raise ValueError("a model part names its model and version")
        if self.kind == "release" and self.version is None:
            raise ValueError("a release part names its version")
        if self.kind == "settings" and self.size > MAX_SETTINGS_BYTES:
            raise ValueError(f"a settings overlay is at most {MAX_SETTINGS_BYTES} bytes")
        return self


class BundleManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["kvl-bundle"] = FORMAT
    version: int = Field(FORMAT_VERSION, ge=1)
    created_at: float = Field(ge=0, le=1e10, allow_inf_nan=False)
    kvl_version: str = Field(max_length=100)
    note: str = Field("", max_length=2000)
    parts: list[Part] = Field(max_length=MAX_PARTS)

    @model_validator(mode="after")
    def _once(self) -> Self:
        paths = [p.path for p in self.parts]
        if len(set(paths)) != len(paths):
            raise ValueError("a part is listed twice")
        if sum(p.kind == "release" for p in self.parts) > 1:
            raise ValueError("a bundle holds one release at most")
        return self

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


class Signature(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    certificate: str = Field(max_length=32_000)  # PEM
    signature: str = Field(max_length=2_000)  # base64


@dataclass(frozen=True)
class Source:
    """A part to put in a bundle: its kind, its file, and a model's name and version or a
    release's version."""

    kind: PartKind
    file: Path
    name: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class Verified:
    """A bundle read and checked: its manifest, who signed it (the certificate's subject),
    and each part's file under the staging folder, by its path."""

    manifest: BundleManifest
    signer: str
    files: dict[str, Path]


def create(
    out: Path,
    sources: Sequence[Source],
    *,
    certificate: bytes,
    key: bytes,
    note: str = "",
    clock: Callable[[], float] = time.time,
) -> BundleManifest:
    """The bundle of `sources` at `out`, signed with `key` (PEM) whose `certificate` (PEM)
    a node's keyring trusts; written beside `out` and renamed once whole."""
    if out.exists():
        raise BundleError(f"{out} exists already: name another file")
    parts = []
    for source in sources:
        digest, size = _hash_file(source.file)
        path = "settings.json" if source.kind == "settings" else f"{_FOLDERS[source.kind]}/{digest}"
        try:
            parts.append(
                Part(kind=source.kind, path=path, size=size, sha256=digest,
                     name=source.name, version=source.version)
            )  # fmt: skip
        except ValidationError as err:
            raise BundleError(f"{source.file}: {_first(err)}") from err
    if any(p.kind == "settings" for p in parts):
        _check_settings(next(s.file for s in sources if s.kind == "settings").read_bytes())
    try:
        manifest = BundleManifest(
            created_at=clock(), kvl_version=__version__, note=note, parts=parts
        )
    except ValidationError as err:
        raise BundleError(_first(err)) from err
    body = manifest.model_dump_json(indent=1).encode()
    signature = _sign(body, certificate, key)
    partial = out.with_name(f".{out.name}.{secrets.token_hex(4)}.partial")
    try:
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            _add(tar, MANIFEST, io.BytesIO(body), len(body), manifest.created_at)
            _add(tar, SIGNATURE, io.BytesIO(signature), len(signature), manifest.created_at)
            for part, source in zip(parts, sources, strict=True):
                with source.file.open("rb") as f:
                    _add(tar, part.path, f, part.size, manifest.created_at)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return manifest


def _first(err: ValidationError) -> str:
    first = err.errors()[0]
    return str(first.get("msg", err))


def _check_settings(raw: bytes) -> None:
    """A settings overlay is the hub's node settings (protocol.NodeSettings)."""
    from shared import protocol  # noqa: PLC0415 - the wire's models, for this part alone

    try:
        protocol.NodeSettings.model_validate(jsonlimits.loads(raw))
    except (ValueError, jsonlimits.JsonLimitError) as err:
        raise BundleError(f"the settings are not node settings: {err}", "settings.json") from err


def _add(tar: tarfile.TarFile, name: str, file: io.IOBase | object, size: int, at: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, int(at), 0o644
    tar.addfile(info, file)  # type: ignore[arg-type]


def _hash_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _sign(body: bytes, certificate: bytes, key_pem: bytes) -> bytes:
    try:
        cert = x509.load_pem_x509_certificate(certificate)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as err:
        raise BundleError(f"the signing certificate or key is not PEM: {err}") from err
    if isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(body, _PSS, hashes.SHA256())
    elif isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(body, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, ed25519.Ed25519PrivateKey):
        signature = key.sign(body)
    else:
        raise BundleError("sign with an RSA, EC or Ed25519 key")
    if cert.public_key() != key.public_key():
        raise BundleError("the signing key is not the certificate's")
    return (
        Signature(
            certificate=cert.public_bytes(serialization.Encoding.PEM).decode(),
            signature=base64.b64encode(signature).decode(),
        )
        .model_dump_json()
        .encode()
    )


_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def read(bundle: Path, staging: Path, keyring: bytes) -> Verified:
    """Every check of `bundle` against `keyring` (PEM CA certificates), its parts written
    under `staging` (an empty folder the caller made, and removes when this raises)."""
    try:
        with tarstream.TarStream.open(bundle) as tar:
            body = _member(tar, MANIFEST, MAX_MANIFEST_BYTES)
            signed = _member(tar, SIGNATURE, MAX_SIGNATURE_BYTES)
            manifest = _manifest(body)
            signer = verify_signature(body, signed, keyring, manifest.created_at)
            free = shutil.disk_usage(staging).free
            if manifest.size + SPARE_BYTES > free:
                raise BundleError(
                    f"the bundle's parts are {manifest.size} bytes; the disk has {free} free "
                    f"(and keeps {SPARE_BYTES} spare): make room first"
                )
            files = {part.path: _part(tar, part, staging) for part in manifest.parts}
            if tar.next() is not None:
                raise BundleError("the bundle holds more than its manifest lists")
    except tarstream.TarStreamError as err:
        raise BundleError(f"not a readable bundle: {err}") from err
    except (EOFError, OSError) as err:
        raise BundleError(f"not a readable bundle: {err}") from err
    return Verified(manifest, signer, files)


def _member(tar: tarstream.TarStream, name: str, limit: int) -> bytes:
    info = tar.next()
    if info is None or info.name != name or not info.isreg():
        raise BundleError(f"not a site bundle: it does not hold {name} where it should")
    if info.size > limit:
        raise BundleError(f"its {name} is {info.size} bytes (at most {limit})")
    data = tar.read(info.size)
    if len(data) != info.size:
        raise BundleError(f"its {name} is cut short")
    return data


def _manifest(body: bytes) -> BundleManifest:
    try:
        raw = jsonlimits.loads(body)
    except (ValueError, jsonlimits.JsonLimitError) as err:
        raise BundleError(f"its manifest is not JSON this reads: {err}") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise BundleError(f"not a site bundle (its manifest names no {FORMAT})")
    if isinstance(raw.get("version"), int) and raw["version"] > FORMAT_VERSION:
        raise BundleError(
            f"a bundle of format {raw['version']}, made by a newer kvl (this one reads format "
            f"{FORMAT_VERSION})"
        )
    try:
        return BundleManifest.model_validate(raw)
    except ValidationError as err:
        raise BundleError(f"its manifest is malformed: {_first(err)}") from err


def verify_signature(body: bytes, signed: bytes, keyring: bytes, at: float) -> str:
    """The subject of the certificate that signed `body`, once everything about it holds:
    issued by a CA of `keyring` (or itself there), valid at `at`, allowed to sign, and
    its signature good."""
    try:
        signature = Signature.model_validate(jsonlimits.loads(signed))
        cert = x509.load_pem_x509_certificate(signature.certificate.encode())
        raw = base64.b64decode(signature.signature, validate=True)
    except (ValueError, ValidationError, jsonlimits.JsonLimitError) as err:
        raise BundleError(f"its signature is unreadable: {str(err)[:300]}") from err
    try:
        cas = x509.load_pem_x509_certificates(keyring)
    except ValueError as err:
        raise BundleError(f"the node's keyring is unreadable: {err}") from err
    if not any(_issued(cert, ca) for ca in cas):
        raise BundleError(
            f"signed by {cert.subject.rfc4514_string()!r}, whom the node's keyring does not trust"
        )
    moment = datetime.datetime.fromtimestamp(at, datetime.UTC)
    if not cert.not_valid_before_utc <= moment <= cert.not_valid_after_utc:
        raise BundleError("its signer's certificate was not valid when the bundle was made")
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.digital_signature:
        raise BundleError("its signer's certificate may not sign")
    key = cert.public_key()
    try:
        if isinstance(key, rsa.RSAPublicKey):
            key.verify(raw, body, _PSS, hashes.SHA256())
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(raw, body, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(raw, body)
        else:
            raise BundleError("its signer's key is of a kind this does not take")
    except InvalidSignature as err:
        raise BundleError("its signature does not match its manifest: altered") from err
    return cert.subject.rfc4514_string()


def _issued(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    if cert == ca:
        return True  # a signer placed in the keyring whole
    try:
        constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    if not constraints.ca or cert.issuer != ca.subject:
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _part(tar: tarstream.TarStream, part: Part, staging: Path) -> Path:
    info = tar.next()
    if info is None:
        raise BundleError(f"{part.path} is missing: a truncated bundle", part.path)
    if info.name != part.path or not info.isreg():
        raise BundleError(f"{info.name!r:.200} is not the part its manifest lists next", part.path)
    if info.size != part.size:
        raise BundleError(f"{part.path} is {info.size} bytes, not {part.size}", part.path)
    out = staging / part.path.replace("/", "-")
    digest = hashlib.sha256()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        left = part.size
        while left:
            chunk = tar.read(min(left, _CHUNK))
            if not chunk:
                raise BundleError(f"{part.path} is cut short: a truncated bundle", part.path)
            digest.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    if digest.hexdigest() != part.sha256:
        raise BundleError(f"{part.path} does not match its sha256: altered", part.path)
    if part.kind == "settings":
        _check_settings(out.read_bytes())
    return out
