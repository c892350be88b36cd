"""The streaming tar reader: what it reads agrees with tarfile on well-formed archives, and
what it refuses is a TarStreamError (its limits the caller's), never another exception."""

from __future__ import annotations

import gzip
import io
import re
import tarfile
from typing import TYPE_CHECKING

import pytest

from shared import backup_archive
from shared.tarstream import (
    MAX_HEADER_BYTES,
    ExtendedHeaderTooLargeError,
    TarStream,
    TarStreamError,
    TooManyExtendedHeadersError,
    UnreadableError,
)
from tests.tarballs import pax_record

if TYPE_CHECKING:
    from pathlib import Path

LONG = "deep/" * 40 + "name.txt"  # past ustar's 100 bytes: a PAX path, or a GNU long name


def _archive(fmt: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in [("short", b"a" * 700), (LONG, b"b" * 512), ("empty", b"")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if fmt == tarfile.PAX_FORMAT:
                info.pax_headers = {"comment": "é=ü\n"}
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _pax(body: bytes) -> bytes:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, len(body)
    return info.tobuf(tarfile.USTAR_FORMAT) + body + b"\0" * (-len(body) % tarfile.BLOCKSIZE)


def _file(name: str) -> bytes:
    return tarfile.TarInfo(name).tobuf(tarfile.USTAR_FORMAT) + b"\0" * (2 * tarfile.BLOCKSIZE)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
def test_members_offsets_and_bytes_are_tarfiles(fmt: int) -> None:
    data = _archive(fmt)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [
            (m.name, m.size, m.offset, m.offset_data, tar.extractfile(m).read())  # type: ignore[union-attr]
            for m in tar
        ]
    reader = TarStream(io.BytesIO(data))
    got = []
    while (info := reader.next()) is not None:
        got.append((info.name, info.size, info.offset, info.offset_data, reader.read(1 << 20)))
    assert got == expected
    assert LONG in [name for name, *_ in got]


def test_a_member_left_unread_is_skipped() -> None:
    reader = TarStream(io.BytesIO(_archive(tarfile.PAX_FORMAT)))
    first = reader.next()
    assert first is not None
    assert reader.read(10) == b"a" * 10
    second = reader.next()
    assert second is not None
    assert second.name == LONG


def test_open_reads_gzip_or_plain_by_content(tmp_path: Path) -> None:
    data = _archive(tarfile.PAX_FORMAT)
    (tmp_path / "plain.tgz").write_bytes(data)  # the name says gzip: the content does not
    (tmp_path / "zipped.tar").write_bytes(gzip.compress(data))
    for name in ("plain.tgz", "zipped.tar"):
        with TarStream.open(tmp_path / name) as reader:
            info = reader.next()
            assert info is not None
            assert (info.name, reader.read(1 << 20)) == ("short", b"a" * 700)


def test_the_limits_are_the_callers() -> None:
    body = pax_record("comment", "x" * 1000)
    data = _pax(body) + _file("member")
    assert TarStream(io.BytesIO(data), max_header_bytes=len(body)).next() is not None
    with pytest.raises(ExtendedHeaderTooLargeError) as refused:
        TarStream(io.BytesIO(data), max_header_bytes=len(body) - 1).next()
    assert (refused.value.size, refused.value.limit) == (len(body), len(body) - 1)
    chain = _pax(pax_record("comment", "x")) * 3 + _file("member")
    assert TarStream(io.BytesIO(chain), max_extended_headers=3).next() is not None
    with pytest.raises(TooManyExtendedHeadersError, match="more than 2 extended tar headers"):
        TarStream(io.BytesIO(chain), max_extended_headers=2).next()


def test_a_header_is_refused_by_the_size_it_claims_before_its_body_is_read() -> None:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, MAX_HEADER_BYTES + 1
    with pytest.raises(ExtendedHeaderTooLargeError):  # no body follows
        TarStream(io.BytesIO(info.tobuf(tarfile.USTAR_FORMAT))).next()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"not a tar at all" * 64, "invalid header"),
        (_file("member")[:300], "it ends in a header"),
        (_pax(b"1" * 4096) + _file("member"), "a malformed PAX header"),
        (_pax(b"30 comment=shorter than that\n") + _file("member"), "a malformed PAX header"),
    ],
    ids=["not a tar", "truncated header", "digits", "wrong length"],
)
def test_a_damaged_archive_is_unreadable(data: bytes, reason: str) -> None:
    with pytest.raises(UnreadableError, match=reason):
        TarStream(io.BytesIO(data)).next()


def test_a_pax_size_past_what_int_converts_is_refused(tmp_path: Path) -> None:
    # Python refuses to convert a number of over 4,300 digits with a ValueError of its own,
    # which a restore did not catch: it ended in a traceback.
    data = _pax(pax_record("size", "9" * 5000)) + _file(backup_archive.MANIFEST)
    with pytest.raises(TarStreamError, match="has a PAX size of '9999") as refused:
        TarStream(io.BytesIO(data)).next()
    assert len(str(refused.value)) < 200
    archive = tmp_path / "size.tar"
    archive.write_bytes(data)
    (tmp_path / "staging").mkdir()
    with pytest.raises(
        backup_archive.BackupError, match=re.escape(f"{archive}: 'manifest.json' has a")
    ):
        backup_archive.read_archive(
            archive, tmp_path / "staging", kind="hub", allowed=lambda _: True, check=lambda _: None
        )


def test_a_member_of_a_type_tarfile_does_not_know_is_skipped_as_tarfile_does() -> None:
    # A PAX global header: its body is data, never the next header (a header block hidden
    # in it is not a member).
    hidden = tarfile.TarInfo("hidden").tobuf(tarfile.USTAR_FORMAT)
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XGLTYPE, len(hidden)
    reader = TarStream(io.BytesIO(info.tobuf(tarfile.USTAR_FORMAT) + hidden + _file("member")))
    names = []
    while (member := reader.next()) is not None:
        names.append(member.name)
    assert names == ["././@PaxHeader", "member"]
