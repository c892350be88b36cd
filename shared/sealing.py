"""Backups sealed with age (age-encryption.org/v1), through pyrage, a maintained binding of
the rage implementation: no cryptography of ours. A backup is sealed to one or more X25519
recipients (`age1…`, whose identities `AGE-SECRET-KEY-1…` open it), or with a passphrase.

age seals a stream to X25519 recipients, and the sealed file is a plain age file:
`age -d -i key.txt backup.tar.age > backup.tar` opens it without kvl. age's passphrase
recipient (scrypt) is offered by pyrage only for bytes held whole in memory, and a backup
can be gigabytes: so a passphrase seals a one-time X25519 identity with scrypt, and the
backup is sealed to that identity's recipient. The sealed file is then a tar of two
members, `identity.age` first, then `backup.tar.age`, and the age tool still opens it:

    tar xf kvl-appliance-20261207T021500Z.age.tar
    age -d -i identity.age backup.tar.age > backup.tar    # asks for the passphrase

Opening trusts nothing of the file: the tar is read by `shared.tarstream` (bounded headers),
the identity member is small and read whole, its scrypt work factor is checked before it
is tried (age lets the sealer choose it, and scrypt's memory doubles with each step), and
the payload is streamed through age's authenticated chunks, so a truncated or altered one
fails before the restore reads a byte of it as a backup.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, TypeVar

from shared import tarstream
from shared.backup_archive import BackupError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

AGE_MAGIC = b"age-encryption.org/v1\n"
IDENTITY_MEMBER = "identity.age"
PAYLOAD_MEMBER = "backup.tar.age"
# What a sealed backup's name ends in: an age file, or the tar a passphrase makes.
RECIPIENTS_SUFFIX = ".tar.age"
PASSPHRASE_SUFFIX = ".age.tar"  # noqa: S105 - a file name's end, not a secret
# An identity sealed with a passphrase is ~250 bytes; anything much larger is not one.
MAX_IDENTITY_BYTES = 4096
# scrypt's log2(N): its memory is 128·8·2^N bytes (2 GiB at 21). age's sealer picks the
# factor that takes it about a second (20 on the machines measured); one above, a
# faster machine's, is taken too, and nothing that would take more memory than that.
MAX_WORK_FACTOR = 21
MAX_PASSPHRASE_BYTES = 1024
_CHUNK = 1 << 20
_RECIPIENT = re.compile(r"^age1[02-9ac-hj-np-z]{58}$")
_IDENTITY = re.compile(r"^AGE-SECRET-KEY-1[02-9AC-HJ-NP-Z]{58}$")
_SCRYPT = re.compile(rb"^-> scrypt [A-Za-z0-9+/]{22} ([0-9]{1,2})$")

Sealed = Literal["plain", "recipients", "passphrase"]
T = TypeVar("T")


def _age() -> Any:
    """pyrage (age), loaded when a backup is sealed or opened: a server that never seals
    one never loads it."""
    import pyrage  # noqa: PLC0415

    return pyrage


class SealError(BackupError):
    """A backup that cannot be sealed or opened; the message says why (never a secret)."""


@dataclass(frozen=True)
class Sealing:
    """How a backup is sealed: to `recipients` (X25519, `age1…`), or with `passphrase`."""

    recipients: tuple[str, ...] = ()
    passphrase: str | None = None

    def __post_init__(self) -> None:
        if bool(self.recipients) == (self.passphrase is not None):
            raise SealError("seal a backup to recipients or with a passphrase: one of the two")
        for recipient in self.recipients:
            check_recipient(recipient)
        if self.passphrase is not None:
            check_passphrase(self.passphrase)

    @property
    def suffix(self) -> str:
        """How the sealed backup's file name ends."""
        return PASSPHRASE_SUFFIX if self.passphrase is not None else RECIPIENTS_SUFFIX

    def __repr__(self) -> str:  # never the passphrase, in a log or a traceback
        kind = "passphrase" if self.passphrase is not None else f"{len(self.recipients)} recipients"
        return f"Sealing({kind})"


def sealing_of(recipients: Iterable[str], passphrase: str | None) -> Sealing | None:
    """The sealing asked for: None when neither recipients nor a passphrase are given."""
    given = tuple(recipients)
    if not given and passphrase is None:
        return None
    return Sealing(given, passphrase)


def check_recipient(recipient: str) -> None:
    if not _RECIPIENT.match(recipient):
        raise SealError(f"{recipient[:80]!r} is not an age X25519 recipient (age1…, 62 characters)")
    try:
        _age().x25519.Recipient.from_str(recipient)
    except _age().RecipientError as err:
        raise SealError(f"{recipient!r} is not an age X25519 recipient: {err}") from err


def check_passphrase(passphrase: str) -> None:
    size = len(passphrase.encode("utf-8", "surrogatepass"))
    if not passphrase or size > MAX_PASSPHRASE_BYTES:
        raise SealError(f"a passphrase is 1 to {MAX_PASSPHRASE_BYTES} bytes")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in passphrase):
        raise SealError("a passphrase is UTF-8 text")


def identities(text: str) -> list[str]:
    """The X25519 identities of an identity file as age writes one (`age-keygen`): its
    `AGE-SECRET-KEY-1…` lines; `#` comments and blank lines skipped."""
    found = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not _IDENTITY.match(stripped):
            raise SealError("an identity is an AGE-SECRET-KEY-1… line (comments start with #)")
        found.append(stripped)
    if not found:
        raise SealError("no AGE-SECRET-KEY-1… identity in it")
    return found


def seal(plain: Path, out: Path, sealing: Sealing) -> None:
    """`plain` sealed into `out` (mode 0600), written beside it and renamed into place once
    whole."""
    partial = out.with_name(f".{out.name}.{secrets.token_hex(4)}.partial")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as sink:
            os.fchmod(fd, 0o600)
            if sealing.passphrase is None:
                with plain.open("rb") as source:
                    recipients = [_age().x25519.Recipient.from_str(r) for r in sealing.recipients]
                    _age().encrypt_io(source, sink, recipients)
            else:
                _seal_with_passphrase(plain, sink, sealing.passphrase)
            sink.flush()
            os.fsync(fd)
        partial.replace(out)
    except (OSError, _age().EncryptError) as err:
        raise SealError(f"cannot seal {out.name}: {err}") from err
    finally:
        partial.unlink(missing_ok=True)


def write_sealed(out: Path, sealing: Sealing | None, write: Callable[[Path], T]) -> T:
    """`write` (a backup's maker) into `out`, sealed when `sealing` says so: written plain
    into a scratch folder beside `out`, sealed into `out`, the plain copy removed."""
    if sealing is None:
        return write(out)
    if out.exists() or out.is_symlink():
        raise SealError(f"{out} exists already: name another file")
    with tempfile.TemporaryDirectory(prefix=".kvl-seal-", dir=out.parent) as scratch:
        plain = Path(scratch) / "backup.tar"
        made = write(plain)
        seal(plain, out, sealing)
    return made


@contextlib.contextmanager
def opened(
    archive: Path, scratch: Path, *, identity: Iterable[str] = (), passphrase: str | None = None
) -> Iterator[Path]:
    """`archive` as a plain backup: itself when it is one, else opened into a folder made
    in `scratch` and removed afterwards. A key given for a plain archive is a mistake, said."""
    given = list(identity)
    if sealed_as(archive) == "plain":
        if given or passphrase is not None:
            raise SealError(f"{archive} is not sealed: restore it without a key")
        yield archive
        return
    scratch.mkdir(parents=True, exist_ok=True)  # the data directory's parent, say
    with tempfile.TemporaryDirectory(prefix=".kvl-opened-", dir=scratch) as folder:
        out = Path(folder) / "backup.tar"
        unseal(archive, out, identity=given, passphrase=passphrase)
        yield out


def _seal_with_passphrase(plain: Path, sink: IO[bytes], passphrase: str) -> None:
    one_time = _age().x25519.Identity.generate()
    sealed_identity = _age().passphrase.encrypt(
        f"# the one-time key of a kvl backup, sealed with its passphrase\n{one_time}\n".encode(),
        passphrase,
    )
    _tar_member(sink, IDENTITY_MEMBER, len(sealed_identity))
    sink.write(sealed_identity)
    _pad(sink, len(sealed_identity))
    # The payload's size is known once it is sealed: its header written now, again after.
    header_at = sink.tell()
    _tar_member(sink, PAYLOAD_MEMBER, 0)
    start = sink.tell()
    with plain.open("rb") as source:
        _age().encrypt_io(source, sink, [one_time.to_public()])
    size = sink.tell() - start
    _pad(sink, size)
    end = sink.tell()
    sink.seek(header_at)
    _tar_member(sink, PAYLOAD_MEMBER, size)
    sink.seek(end)
    sink.write(b"\0" * (2 * tarfile.BLOCKSIZE))  # the end of the archive


def _tar_member(sink: IO[bytes], name: str, size: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, 0
    sink.write(info.tobuf(format=tarfile.USTAR_FORMAT))


def _pad(sink: IO[bytes], size: int) -> None:
    sink.write(b"\0" * (-size % tarfile.BLOCKSIZE))


def sealed_as(path: Path) -> Sealed:
    """How the file at `path` is sealed, told by its first bytes: an age file, the tar a
    passphrase makes (its first member the sealed identity), or neither."""
    with path.open("rb") as f:
        head = f.read(tarfile.BLOCKSIZE)
    if head.startswith(AGE_MAGIC):
        return "recipients"
    if len(head) == tarfile.BLOCKSIZE:
        try:
            info = tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            return "plain"
        if info.name == IDENTITY_MEMBER:
            return "passphrase"
    return "plain"


def unseal(
    sealed: Path, out: Path, *, identity: Iterable[str] = (), passphrase: str | None = None
) -> Sealed:
    """The backup sealed in `sealed` opened into `out` (mode 0600; removed when this
    raises); how it was sealed. A plain file is refused here: the caller reads it as is."""
    kind = sealed_as(sealed)
    if kind == "plain":
        raise SealError("the file is not a sealed backup")
    if kind == "passphrase" and passphrase is None:
        raise SealError("the backup is sealed with a passphrase: give it (and no identity)")
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as sink:
            if passphrase is not None and kind == "passphrase":
                _open_with_passphrase(sealed, sink, passphrase)
            else:
                _open_with_identities(sealed, sink, list(identity))
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return kind


def _open_with_identities(sealed: Path, sink: IO[bytes], given: Sequence[str]) -> None:
    with sealed.open("rb") as source:
        stanzas = _stanzas(source.read(64 << 10))
        if stanzas and stanzas[0].startswith(b"-> scrypt "):
            raise SealError(
                "the file is sealed by `age --passphrase`: kvl opens a passphrase-sealed "
                "backup in the form it writes one (a tar of identity.age and backup.tar.age)"
            )
        if not given:
            raise SealError("the backup is sealed to age recipients: give an identity to open it")
        keys = [_identity(text) for text in given]
        source.seek(0)
        try:
            _age().decrypt_io(source, sink, keys)
        # A header no identity opens is a DecryptError; a payload chunk that fails its tag
        # (altered, truncated) an OSError from age's reader, as is the disk's own.
        except (_age().DecryptError, OSError) as err:
            raise SealError(f"the backup cannot be opened: {err}") from err


def _open_with_passphrase(sealed: Path, sink: IO[bytes], passphrase: str) -> None:
    check_passphrase(passphrase)
    try:
        with tarstream.TarStream.open(sealed) as tar:
            first = tar.next()
            if first is None or first.name != IDENTITY_MEMBER or not first.isreg():
                raise SealError(f"the sealed backup does not begin with {IDENTITY_MEMBER}")
            if first.size > MAX_IDENTITY_BYTES:
                raise SealError(f"its {IDENTITY_MEMBER} is {first.size} bytes: not a sealed key")
            key = _identity(_passphrase_open(tar.read(first.size), passphrase).decode("utf-8"))
            second = tar.next()
            if second is None or second.name != PAYLOAD_MEMBER or not second.isreg():
                raise SealError(f"the sealed backup holds no {PAYLOAD_MEMBER} after its key")
            try:
                _age().decrypt_io(_Member(tar), sink, [key])
            except (_age().DecryptError, OSError) as err:
                raise SealError(f"its {PAYLOAD_MEMBER} cannot be opened: {err}") from err
    except tarstream.TarStreamError as err:
        raise SealError(f"the sealed backup is not a readable tar: {err}") from err
    except UnicodeDecodeError as err:
        raise SealError(f"its {IDENTITY_MEMBER} does not hold an identity") from err


def _passphrase_open(sealed_identity: bytes, passphrase: str) -> bytes:
    stanzas = _stanzas(sealed_identity)
    scrypt = _SCRYPT.match(stanzas[0]) if len(stanzas) == 1 else None
    if scrypt is None:
        raise SealError(f"its {IDENTITY_MEMBER} is not sealed with a passphrase")
    factor = int(scrypt.group(1))
    if factor > MAX_WORK_FACTOR:
        raise SealError(
            f"its {IDENTITY_MEMBER} asks scrypt for a work factor of {factor} (at most "
            f"{MAX_WORK_FACTOR}: {128 * 8 << MAX_WORK_FACTOR >> 30} GiB of memory)"
        )
    try:
        opened: bytes = _age().passphrase.decrypt(sealed_identity, passphrase)
    except _age().DecryptError as err:
        raise SealError("the passphrase does not open the backup") from err
    return opened


def _identity(text: str) -> Any:  # an x25519.Identity
    found = identities(text)
    if len(found) != 1:
        raise SealError("give one identity per value")
    try:
        return _age().x25519.Identity.from_str(found[0])
    except _age().IdentityError as err:
        raise SealError("an identity that is not a valid X25519 key") from err


def _stanzas(head: bytes) -> list[bytes]:
    """The recipient lines (`-> type args`) of an age header at the start of `head`."""
    if not head.startswith(AGE_MAGIC):
        raise SealError("not an age file")
    lines = head[len(AGE_MAGIC) :].split(b"\n")
    return [line for line in lines[:64] if line.startswith(b"-> ")]


class _Member(io.RawIOBase):
    """The current member of a TarStream, as the file age reads its payload from."""

    def __init__(self, tar: tarstream.TarStream) -> None:
        self._tar = tar

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        chunk = self._tar.read(min(len(buffer), _CHUNK))
        buffer[: len(chunk)] = chunk
        return len(chunk)
