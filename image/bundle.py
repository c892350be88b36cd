"""RAUC update bundles of the image, and the keys that sign them.

A bundle (`kovenlab-edge-<version>.raucb`) holds one root file system image for a slot and
a manifest (compatible, version), in RAUC's verity format, signed with a CMS signature. A
node installs it with `rauc install`, which checks the signature against the keyring in its
image (`/etc/rauc/keyring.pem`) and the compatible against its own before it writes a
block; while it is written, every block read is checked against the bundle's hash tree.
The image is adaptive (`block-hash-index`): a node that streams the bundle over HTTP takes
the blocks it holds already from its own slots and fetches only the rest.

Signing: by default the build makes a development CA and a signing certificate under it,
once, in its cache (`image/build/cache/signing/`, ignored by git and never in the image but
for the CA's certificate). An operator signs with their own: `--signing-cert`,
`--signing-key` and `--keyring` (or `KVL_IMAGE_SIGNING_CERT`, `KVL_IMAGE_SIGNING_KEY`,
`KVL_IMAGE_KEYRING`), all three; `rauc bundle` checks the signature against the keyring,
so a key that does not match the keyring fails the build.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

COMPATIBLE = "kovenlab-edge-x86_64"  # as /etc/rauc/system.conf says
ROOTFS_NAME = "rootfs.ext4"
# squashfs compresses the bundle's image in blocks of this size, and a streaming node fetches
# whole ones: 64 KiB (not the default 128 KiB) halves what a changed 4 KiB block costs it, for
# a bundle about 1 % larger (RAUC's documentation suggests it for adaptive updates)
SQUASHFS_BLOCK = "64K"
VALID_DAYS = 3650


@dataclass(frozen=True)
class Signing:
    """A signing certificate and its key, and the keyring (CA certificates) that checks it."""

    cert: Path
    key: Path
    keyring: Path

    def fingerprint(self) -> str:
        """What the image depends on: the keyring it carries (and the certificate that signs)."""
        digest = hashlib.sha256()
        for path in (self.keyring, self.cert):
            digest.update(path.read_bytes())
        return digest.hexdigest()


def development_signing(folder: Path) -> Signing:
    """The build's own CA and signing certificate, made once in `folder` (kept: every bundle
    of this build folder is signed by the same CA, so one image takes the next's bundles)."""
    signing = Signing(folder / "signer.cert.pem", folder / "signer.key.pem", folder / "ca.cert.pem")
    if all(path.is_file() for path in (signing.cert, signing.key, signing.keyring)):
        return signing
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True, mode=0o700)
    now = datetime.datetime.now(tz=datetime.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Kovenlab Edge development CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    signer = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Kovenlab Edge bundle signer")])
        )
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (partial / "ca.cert.pem").write_bytes(ca.public_bytes(pem))
    (partial / "signer.cert.pem").write_bytes(signer.public_bytes(pem))
    secret = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_private(partial / "signer.key.pem", secret)
    # The CA's key signs nothing else: it is not kept, so no one can sign with it later.
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)
    return signing


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _write_private(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(data)


CHUNK = 4096  # RAUC's block-hash index: a sha256 for each 4 KiB block
ZERO_CHUNK_HASH = hashlib.sha256(bytes(CHUNK)).digest()


def block_hash_index(image: Path) -> bytes:
    """RAUC's block-hash index of a file: the sha256 of each 4 KiB block, one after another,
    as `rauc bundle` writes it into a bundle and RAUC keeps it for a slot it installed."""
    return _hashes(image)[0]


def _hashes(image: Path) -> tuple[bytes, str, int]:
    """(block-hash index, sha256, size) of a file, read once."""
    out, whole, size = bytearray(), hashlib.sha256(), 0
    with image.open("rb") as f:
        while block := f.read(CHUNK * 1024):
            if len(block) % CHUNK:
                raise ValueError(f"{image} is not whole 4 KiB blocks")
            whole.update(block)
            size += len(block)
            for at in range(0, len(block), CHUNK):
                out += hashlib.sha256(block[at : at + CHUNK]).digest()
    return bytes(out), whole.hexdigest(), size


def seed_indexes(data_directory: Path, root: Path, *, slot_size: int, version: str) -> None:
    """What RAUC would know of a flashed node's slots had it installed them, in its data
    directory: root A holds the image's root file system (`root`: its sha256, size and
    version, and its block-hash index), root B `slot_size` bytes of zeros (its index: the
    first block's).

    Without them RAUC knows no checksum for either slot, keeps no index for them, and
    hashes both whole (3 GiB read, minutes on a slow disk) before the first update writes
    a block. RAUC keeps a slot's index under its checksum (`slot.NAME/hash-SHA256/`); every
    block it takes from a slot is hashed again as it is read, so a slot that is not what its
    status says costs only the blocks that differ."""
    index, sha256, size = _hashes(root)
    zeros = hashlib.sha256()
    block = bytes(1 << 20)
    for _ in range(slot_size >> 20):
        zeros.update(block)
    bundle = f"bundle.compatible={COMPATIBLE}\nbundle.version={version}\nstatus=ok\n"
    slots = {
        "rootfs.0": (sha256, size, index, bundle),
        "rootfs.1": (zeros.hexdigest(), slot_size, ZERO_CHUNK_HASH, ""),
    }
    data_directory.mkdir(parents=True, exist_ok=True)
    status = []
    for slot, (digest, length, kept, more) in slots.items():
        folder = data_directory / f"slot.{slot}" / f"hash-{digest}"
        folder.mkdir(parents=True, exist_ok=True)
        for made in (folder, folder.parent):
            made.chmod(0o700)
        (folder / "block-hash-index").write_bytes(kept)
        status.append(f"[slot.{slot}]\n{more}sha256={digest}\nsize={length}\n")
    # RAUC's central status file (system.conf's data-directory, no statusfile)
    (data_directory / "central.raucs").write_text("\n".join(status))


def manifest_text(version: str, build: str) -> str:
    return (
        "[update]\n"
        f"compatible={COMPATIBLE}\n"
        f"version={version}\n"
        f"build={build}\n"
        "\n"
        "[bundle]\n"
        "format=verity\n"
        "\n"
        "[image.rootfs]\n"
        f"filename={ROOTFS_NAME}\n"
        # a hash of each 4 KiB block: a node streaming the bundle fetches only the blocks
        # neither of its slots holds (the ext4 image is whole 4 KiB blocks)
        "adaptive=block-hash-index\n"
    )


def make_bundle(
    run: Callable[[list[str]], object],
    work: Path,
    rootfs: Path,
    out: Path,
    *,
    version: str,
    build: str,
    signing: Signing,
    level: int = 6,
) -> Path:
    """`rauc bundle` of one root file system image: squashfs compressed with zstd at `level`
    (model files do not compress; the rest does), signed, checked against the keyring."""
    content = work / "bundle"
    if content.exists():
        shutil.rmtree(content)
    content.mkdir(parents=True)
    (content / "manifest.raucm").write_text(manifest_text(version, build))
    try:
        os.link(rootfs, content / ROOTFS_NAME)
    except OSError:  # another file system
        shutil.copyfile(rootfs, content / ROOTFS_NAME)
    partial = out.with_name(f".partial-{out.name}")  # `rauc bundle` wants the .raucb suffix
    partial.unlink(missing_ok=True)
    run(
        [
            "rauc", "bundle",
            f"--cert={signing.cert}", f"--key={signing.key}", f"--keyring={signing.keyring}",
            f"--mksquashfs-args=-comp zstd -Xcompression-level {level} -b {SQUASHFS_BLOCK}",
            str(content), str(partial),
        ]
    )  # fmt: skip
    shutil.rmtree(content)
    partial.rename(out)
    return out
