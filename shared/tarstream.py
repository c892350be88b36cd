"""A tar archive from a peer, read as a stream: one header at a time, in memory and time
bounded by what the archive holds, never by what its headers claim.

tarfile's reader is not used for what a peer sends. It reads a PAX extended header or a
GNU long name whole at whatever size its header claims (a few hundred KiB of gzip hold
hundreds of MiB of one), follows a chain of them by recursion, and, before Python
3.11.10, parses a PAX header with regular expressions that take time quadratic in its
length (CVE-2024-6232: 64 KiB of digits took it 8.5 s; 1 MiB would take half an hour).

Here each header block is parsed by tarfile (`TarInfo.frombuf`, which reads that block
alone and no PAX); the extended headers before a member (PAX, GNU long name and long link)
are read here, each one's size checked before its body is read and their number bounded,
and their records parsed in one pass. A member's bytes are read by the caller, a chunk at
a time. Of the PAX records, `path`, `linkpath` and `size` are applied; a member with GNU
sparse records is refused (its holes would read back as zeros: a few bytes of archive
could stand for terabytes). An old GNU sparse member (type `S`) is returned as its header
says, for the caller to refuse by its type: its map is not read, so `issparse()` is false
and `isreg()` true. A member of a type tarfile does not know (a PAX global header among
them) is returned as it is, its bytes, as tarfile reads them, those of a file.

Every refusal is a TarStreamError, whose message does not name the archive: its reader
knows it. What reading the stream itself raises (OSError; EOFError and zlib.error of a
gzipped one) is not caught here.
"""

from __future__ import annotations

import contextlib
import gzip
import tarfile
from typing import IO, TYPE_CHECKING, cast

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

# The body of one PAX extended header or GNU long name or link: GNU tar's hold a name up
# to PATH_MAX (4 KiB), with room for a few records more.
MAX_HEADER_BYTES = 64 << 10
# Extended headers before one member: GNU tar writes a long link, a long name and a PAX
# header at most.
MAX_EXTENDED_HEADERS = 4

# Headers whose body says something of the member that follows them.
_EXTENDED = {
    tarfile.XHDTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
}
_BLOCK = tarfile.BLOCKSIZE
_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
# The digits of a PAX record's length, or of its size: 10**20 bytes is past any archive.
_MAX_DIGITS = 20


class TarStreamError(ValueError):
    """An archive refused: its message says why (a PAX size that is not a number, a
    negative size)."""


class UnreadableError(TarStreamError):
    """Not a tar archive, or a damaged one: a header block that is not one, an archive
    that ends in a header, a malformed PAX header."""


class ExtendedHeaderTooLargeError(TarStreamError):
    """An extended header that claims more bytes than the reader's limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"an extended tar header of {size} bytes (at most {limit})")
        self.size = size
        self.limit = limit


class TooManyExtendedHeadersError(TarStreamError):
    """More extended headers before one member than the reader's limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} extended tar headers before one member")
        self.limit = limit


class SparseMemberError(TarStreamError):
    """A member with GNU sparse PAX records."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name!r} is a sparse member")
        self.name = name


class TarStream:
    """The members of a tar archive read from `stream`, in order: `next()` for each one's
    header, `read()` for its bytes. Each TarInfo has `offset` (where its first header
    begins in the stream) and `offset_data` (where its bytes do)."""

    def __init__(
        self,
        stream: IO[bytes],
        *,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_extended_headers: int = MAX_EXTENDED_HEADERS,
    ) -> None:
        self._stream = stream
        self._max_header_bytes = max_header_bytes
        self._max_extended_headers = max_extended_headers
        self._offset = 0  # how many bytes of the stream have been read
        self._data = 0  # of the current member's bytes, how many are left to read
        self._padding = 0  # and the zeros that fill its last block

    @classmethod
    @contextlib.contextmanager
    def open(
        cls,
        archive: Path,
        *,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_extended_headers: int = MAX_EXTENDED_HEADERS,
    ) -> Iterator[TarStream]:
        """The archive at `archive`, gzipped or not (told by its content, not its name, as
        tarfile's "r|*" does); offsets count the bytes of the tar, not of the gzip."""
        limits = {
            "max_header_bytes": max_header_bytes,
            "max_extended_headers": max_extended_headers,
        }
        with archive.open("rb") as raw:
            if raw.peek(len(_GZIP_MAGIC)).startswith(_GZIP_MAGIC):
                with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                    yield cls(cast("IO[bytes]", unzipped), **limits)
            else:
                yield cls(raw, **limits)

    def next(self) -> tarfile.TarInfo | None:
        """The next member's header, the extended headers before it applied; None at the
        end of the archive. Whatever of the member before was not read is skipped."""
        self._skip(self._data + self._padding)
        self._data = self._padding = 0
        start = self._offset
        pax: dict[str, str] = {}
        long_name = long_link = None
        for _ in range(self._max_extended_headers + 1):
            block = self._exactly(_BLOCK)
            if not block.strip(b"\0"):  # the end-of-archive block, or the stream's end
                return None
            if len(block) < _BLOCK:
                raise UnreadableError("it ends in a header")
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            except tarfile.HeaderError as err:  # a bad checksum, a field not a number
                raise UnreadableError(str(err)) from err
            if info.type not in _EXTENDED:
                info.offset, info.offset_data = start, self._offset
                return self._member(info, pax, long_name, long_link)
            if not 0 <= info.size <= self._max_header_bytes:
                raise ExtendedHeaderTooLargeError(info.size, self._max_header_bytes)
            body = self._exactly(_blocks(info.size))[: info.size]
            if len(body) < info.size:
                raise UnreadableError("it ends in a header")
            if info.type == tarfile.GNUTYPE_LONGNAME:
                long_name = _nts(body)
            elif info.type == tarfile.GNUTYPE_LONGLINK:
                long_link = _nts(body)
            else:
                pax.update(_pax_records(body))
        raise TooManyExtendedHeadersError(self._max_extended_headers)

    def read(self, size: int) -> bytes:
        """Up to `size` more bytes of the current member (fewer only at its end, or at the
        archive's when it is truncated)."""
        chunk = self._stream.read(min(size, self._data))
        self._data -= len(chunk)
        self._offset += len(chunk)
        return chunk

    def _member(
        self, info: tarfile.TarInfo, pax: dict[str, str], name: str | None, link: str | None
    ) -> tarfile.TarInfo:
        info.name = pax.get("path", name if name is not None else info.name)
        info.linkname = pax.get("linkpath", link if link is not None else info.linkname)
        if "size" in pax:
            size = pax["size"]
            # Bounded before int(): Python refuses to convert over 4,300 digits, with a
            # ValueError of its own.
            if not size.isascii() or not size.isdigit() or len(size) > _MAX_DIGITS:
                raise TarStreamError(f"{info.name!r} has a PAX size of {size!r:.100}")
            info.size = int(size)
        if any(key.startswith("GNU.sparse.") for key in pax):
            raise SparseMemberError(info.name)
        if info.size < 0:
            raise TarStreamError(f"{info.name!r} has a size of {info.size}")
        # What follows a header: a regular file's bytes, or those of a type tarfile does not
        # know (as it reads them: a PAX global header's body, skipped here); no other has any.
        if info.isreg() or info.type not in tarfile.SUPPORTED_TYPES:
            self._data, self._padding = info.size, _blocks(info.size) - info.size
        return info

    def _exactly(self, size: int) -> bytes:
        """`size` bytes of the stream, fewer only at its end."""
        chunks = []
        while size > 0 and (chunk := self._stream.read(size)):
            chunks.append(chunk)
            size -= len(chunk)
            self._offset += len(chunk)
        return b"".join(chunks)

    def _skip(self, size: int) -> None:
        while size > 0 and (chunk := self._stream.read(min(size, _CHUNK))):
            size -= len(chunk)
            self._offset += len(chunk)


def _pax_records(body: bytes) -> dict[str, str]:
    """The records of a PAX extended header, `LENGTH KEY=VALUE\\n` each (LENGTH counts the
    whole record), in one pass: each record's length is read, and the reading jumps past
    it (never a search through the body, which is what made tarfile's quadratic)."""
    records: dict[str, str] = {}
    limit = len(body.rstrip(b"\0"))  # some writers fill the body's end with NULs
    at = 0
    while at < limit:
        space = body.find(b" ", at, at + _MAX_DIGITS)
        digits = body[at:space] if space > at else b""
        end = at + int(digits) if digits.isdigit() else 0
        # Empty unless the record ends past its length field, within the body.
        record = body[space + 1 : end - 1] if space + 1 < end <= limit else b""
        key, equals, value = record.partition(b"=")
        if not key or not equals or body[end - 1] != ord("\n"):
            raise UnreadableError("a malformed PAX header")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at = end
    return records


def _blocks(size: int) -> int:
    """`size` bytes rounded up to whole tar blocks."""
    return -(-size // _BLOCK) * _BLOCK


def _nts(body: bytes) -> str:
    """A GNU long name or link: up to its first NUL."""
    return body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
