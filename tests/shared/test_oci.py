"""OCI layout archives: deterministic, and refused whole when anything is off."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile

import pytest

from shared import oci
from shared.oci import LayoutError, package_summary, read_layout, write_layout
from tests.conftest import REPO
from tests.shared.oci_shapes import (
    INDEX,
    SHAPES,
    octal,
    package_archive,
    padded,
    rewrap,
    sealed,
    sparse_member,
    tar_header,
    with_last_member,
)
from tests.tarballs import pax_record

CONFIG = b"{}"
LAYER = b"hello, layer"


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _layout() -> tuple[dict[str, object], dict[str, bytes]]:
    manifest = json.dumps({
        "schemaVersion": 2,
        "config": {"digest": f"sha256:{_hex(CONFIG)}", "size": len(CONFIG)},
        "layers": [{"digest": f"sha256:{_hex(LAYER)}", "size": len(LAYER)}],
    }).encode()  # fmt: skip
    index = {"schemaVersion": 2, "manifests": [
        {"digest": f"sha256:{_hex(manifest)}", "size": len(manifest)}]}  # fmt: skip
    blobs = {_hex(b): b for b in (CONFIG, LAYER, manifest)}
    return index, blobs


def _tar(members: list[tuple[str, bytes]], *, link: str | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return out.getvalue()


def _members(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]  # type: ignore[union-attr]


def test_a_layout_round_trips_and_is_the_same_archive_every_time() -> None:
    index, blobs = _layout()
    data = write_layout(index, blobs)
    assert data == write_layout(index, dict(reversed(blobs.items())))
    layout = read_layout(data, max_bytes=1 << 20)
    assert layout.index == index
    assert layout.blobs == blobs
    names = [name for name, _ in _members(data)]
    assert names[:2] == ["oci-layout", "index.json"]
    assert names[2:] == sorted(f"blobs/sha256/{h}" for h in blobs)


@pytest.mark.parametrize(
    "spoil",
    ["tampered blob", "extra member", "missing blob", "no index", "duplicate", "link",
     "not a tar", "bad index", "path escape"],
)  # fmt: skip
def test_anything_off_is_refused(spoil: str) -> None:
    index, blobs = _layout()
    members = _members(write_layout(index, blobs))
    link = None
    if spoil == "tampered blob":
        name, data = members[-1]
        members[-1] = (name, data + b"!")
    elif spoil == "extra member":
        members.append(("README", b"hi"))
    elif spoil == "missing blob":
        members = [m for m in members if m[0] != f"blobs/sha256/{_hex(LAYER)}"]
    elif spoil == "no index":
        members = [m for m in members if m[0] != "index.json"]
    elif spoil == "duplicate":
        members.append(members[-1])
    elif spoil == "link":
        link = f"blobs/sha256/{'0' * 64}"
    elif spoil == "bad index":
        members[1] = ("index.json", b"[1, 2]")
    elif spoil == "path escape":
        members.append((f"../blobs/sha256/{_hex(LAYER)}", LAYER))
    data = b"not a tar at all" if spoil == "not a tar" else _tar(members, link=link)
    with pytest.raises(LayoutError):
        read_layout(data, max_bytes=1 << 20)


def test_an_archive_above_the_limit_is_refused_unread() -> None:
    data = write_layout(*_layout())
    with pytest.raises(LayoutError, match="above the limit"):
        read_layout(data, max_bytes=len(data) - 1)


# -- hostile archives: refused from their headers, before any member is read -------------------


def _lying(name: str, stored: bytes, declared: int) -> bytes:
    """A plain member whose header declares more bytes than follow it."""
    info = tarfile.TarInfo(name)
    info.size = len(stored)
    header = tar_header(info)
    header[124:136] = octal(declared)
    return sealed(header) + padded(stored)


def _special(name: str, kind: bytes, linkname: str = "") -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    if kind in {tarfile.CHRTYPE, tarfile.BLKTYPE}:
        info.devmajor, info.devminor = 1, 3
    return bytes(tar_header(info))


def _archive(last: bytes) -> bytes:
    return with_last_member(write_layout(*_layout()), last)


BLOB_NAME = f"blobs/sha256/{'a' * 64}"
HOSTILE: dict[str, tuple[bytes, str]] = {
    "sparse, expanding to 64 GiB": (sparse_member(BLOB_NAME, b"x" * 10, 64 << 30), "sparse"),
    "sparse, even a small one": (sparse_member(BLOB_NAME, b"x" * 10, 100), "sparse"),
    # tarfile itself notices that the data ends early; the reader checks it too.
    "declared size above the archive": (
        _lying(BLOB_NAME, b"x" * 10, 8 << 20),
        "declares|unexpected end of data",
    ),
    "hard link": (_special(BLOB_NAME, tarfile.LNKTYPE, "oci-layout"), "link"),
    "symbolic link": (_special(BLOB_NAME, tarfile.SYMTYPE, "/etc/passwd"), "link"),
    "character device": (_special(BLOB_NAME, tarfile.CHRTYPE), "device"),
    "block device": (_special(BLOB_NAME, tarfile.BLKTYPE), "device"),
    "fifo": (_special(BLOB_NAME, tarfile.FIFOTYPE), "device"),
    "parent escape": (_lying("../../etc/cron.d/x", b"", 0), "escapes"),
    "escape inside blobs": (_lying(f"blobs/sha256/../../{'a' * 64}", b"", 0), "escapes"),
    "absolute name": (_lying("/etc/passwd", b"", 0), "escapes"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_member_is_refused_before_any_member_is_read(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    member, reason = HOSTILE[case]
    data = _archive(member)
    read: list[str] = []
    read_member = oci._read

    def spy(data: bytes, member: tarfile.TarInfo) -> bytes:
        read.append(member.name)
        return read_member(data, member)

    monkeypatch.setattr(oci, "_read", spy)
    with pytest.raises(LayoutError, match=reason):
        read_layout(data, max_bytes=1 << 20)
    assert read == [], "members were read before the hostile one was refused"


def test_the_hand_made_archives_are_otherwise_well_formed() -> None:
    """The same construction with a good last member reads: the refusals above are the
    hostile member's, not the construction's."""
    extra = b"extra blob"
    name = f"blobs/sha256/{_hex(extra)}"
    layout = read_layout(_archive(_lying(name, extra, len(extra))), max_bytes=1 << 20)
    assert layout.blobs[_hex(extra)] == extra
    assert layout.blobs[_hex(LAYER)] == LAYER


# -- JSON of the wrong shape: refused as LayoutError, never a TypeError below ------------------


def test_the_hand_made_package_archive_reads_and_sums_up() -> None:
    """The archive the shape cases change is one package, read whole: their refusals are
    the changed document's, not the construction's."""
    data = rewrap(package_archive(), INDEX, lambda index: index)
    assert data == package_archive()
    summary = package_summary(read_layout(data, max_bytes=1 << 20))
    assert summary["id"] == "pkg_1"
    assert summary["items"] == 1
    assert summary["lineage"] == {"model": {"name": "m", "version": "1"}, "seed": 1}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_json_of_the_wrong_shape_is_a_layout_error(case: str) -> None:
    target, change = SHAPES[case]
    data = rewrap(package_archive(), target, change)
    with pytest.raises(LayoutError):
        package_summary(read_layout(data, max_bytes=1 << 20))


@pytest.mark.parametrize(
    ("manifest", "reason"),
    [
        (b'"a manifest"', "not a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        (b'{"config": "sha256:00", "layers": []}', "config"),
        (b'{"config": {"digest": "sha256:' + b"0" * 64 + b'", "size": 2}, "layers": 5}', "layers"),
    ],
    ids=["a string", "nested past the recursion limit", "config a string", "layers an int"],
)
def test_a_manifest_of_the_wrong_shape_names_what_is_wrong(manifest: bytes, reason: str) -> None:
    index, blobs = _layout()
    index = {"schemaVersion": 2, "manifests": [
        {"digest": f"sha256:{_hex(manifest)}", "size": len(manifest)}]}  # fmt: skip
    with pytest.raises(LayoutError, match=reason):
        read_layout(write_layout(index, blobs | {_hex(manifest): manifest}), max_bytes=1 << 20)


# -- CVE-2024-6232: a PAX header tarfile parses in quadratic time ------------------------------

# The reproducer's shape: a PAX header that is one long run of digits. Python before 3.11.10
# (this project runs 3.11.7) looks for a `hdrcharset` record in it with a regular expression
# that backtracks from every digit to the end of the run: time quadratic in the header.
# Measured on 3.11.7 with tarfile reading the archive: 16 KiB of digits 0.56 s, 32 KiB
# 2.1 s, 64 KiB 8.5 s, each header; the archives below hold 25 headers of 64 KiB (the most
# shared.tarstream reads of one) and took tarfile 227 s ("digits") and 232 s ("comment") of
# CPU, both read as good; here, read_layout takes 0.2 ms and 4 ms, and the whole process,
# Python's start included, 0.4 s. With tarfile, each test's process is killed at 20 s.
PAX_BYTES = 64 << 10
EXTRA_BLOBS = 20
CPU_SECONDS = 20
# The read in a process of its own, its CPU time bounded: a reader that takes minutes is
# killed (SIGXCPU) instead of holding the test run for them.
BOUNDED_READ = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, ({CPU_SECONDS}, {CPU_SECONDS} + 1))
from shared.oci import LayoutError, read_layout
try:
    layout = read_layout(sys.stdin.buffer.read(), max_bytes=1 << 30)
except LayoutError as err:
    print("refused:", err)
else:
    print("read:", len(layout.blobs), "blobs")
"""


def _pax(body: bytes) -> bytes:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, len(body)
    return info.tobuf(tarfile.USTAR_FORMAT) + padded(body)


def _each_after(body: bytes) -> tuple[bytes, int]:
    """A layout of 25 members, each after a PAX header of `body`; how many blobs it holds."""
    index, blobs = _layout()
    blobs |= {_hex(b): b for b in (f"extra blob {i}".encode() for i in range(EXTRA_BLOBS))}
    valid = write_layout(index, blobs)
    with tarfile.open(fileobj=io.BytesIO(valid)) as tar:
        spans = [(m.offset, m.offset_data + len(padded(b"x" * m.size))) for m in tar]
    parts = [_pax(body) + valid[start:end] for start, end in spans]
    return b"".join(parts) + b"\0" * (2 * tarfile.BLOCKSIZE), len(blobs)


def _digits() -> bytes:
    return b"1" * PAX_BYTES


def _comment() -> bytes:
    # A well-formed record whose value is the run: a comment, which a reader ignores.
    record = pax_record("comment", "1" * (PAX_BYTES - 15))
    assert len(record) == PAX_BYTES
    return record


def _bounded_read(data: bytes) -> str:
    ran = subprocess.run(
        [sys.executable, "-c", BOUNDED_READ],
        input=data, capture_output=True, cwd=REPO, timeout=300, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, (
        f"the read ended with {ran.returncode} (killed past {CPU_SECONDS} s of CPU?): "
        f"{ran.stderr.decode()[-500:]}"
    )
    return ran.stdout.decode()


def test_a_pax_header_of_the_cve_2024_6232_shape_is_refused_fast() -> None:
    data, _ = _each_after(_digits())
    assert len(data) < 2 << 20
    refused = _bounded_read(data)
    assert refused.startswith("refused: not a readable OCI layout archive: a malformed PAX")


def test_a_well_formed_pax_header_of_that_shape_is_read_as_fast() -> None:
    """The same run of digits as a comment's value, which a PAX reader must accept: the
    archive reads whole, as fast."""
    data, blobs = _each_after(_comment())
    assert _bounded_read(data) == f"read: {blobs} blobs\n"


def test_a_pax_header_past_the_readers_limit_is_refused_by_the_size_it_claims() -> None:
    # The run of digits at 1 MiB: tarfile would take 256 times 64 KiB's 8.5 s, half an hour
    # (quadratic; not measured). Its size is refused before a byte of it is read.
    data = _archive(_pax(b"1" * (1 << 20)) + _lying(BLOB_NAME, b"x", 1))
    assert _bounded_read(data).startswith(
        "refused: not a readable OCI layout archive: an extended tar header of 1048576 bytes"
    )
