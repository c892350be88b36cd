"""A restore trusts nothing in an archive (shared/backup_archive.py `read_archive`): a genuine
hub backup, altered each way an archive can lie or attack, is refused with an error that
says what is wrong, nothing is written outside the data directory, and the data directory
is left as it was (empty). Its tar headers and its manifest are bounded before they are
read: a restore's memory stays bounded whatever the archive claims."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from typing import TYPE_CHECKING, Any

import pytest

from hub.backup import backup, restore
from hub.identity import certificates, hub_keys
from hub.state.store import open_store
from shared.backup_archive import MAX_HEADER_BYTES, BackupError, occupied
from tests.conftest import REPO, kvl
from tests.hubs import settings_for
from tests.tarballs import pax_record

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

# (the manifest as JSON, every other member: its name and bytes), in the archive's order.
Parts = tuple[dict[str, Any], list[tuple[str, bytes]]]


@pytest.fixture
def genuine(tmp_path: Path) -> Parts:
    """A real backup of a hub with a store, a CA and a WireGuard key, taken apart."""
    hub = settings_for(tmp_path / "source", {})
    store = open_store(hub)
    try:
        store.accounts.put("acme", "S1")
    finally:
        store.close()
    certificates(hub)
    hub_keys(hub)
    archive = tmp_path / "genuine.tar"
    backup(hub, archive)
    with tarfile.open(archive) as tar:
        members = []
        for info in tar.getmembers():
            handle = tar.extractfile(info)
            assert handle is not None
            members.append((info.name, handle.read()))
    (_, manifest), *rest = members
    return json.loads(manifest), rest


def forge(
    path: Path, manifest: dict[str, Any] | bytes, members: list[tarfile.TarInfo | tuple[str, bytes]]
) -> Path:
    """An archive of the manifest first, then `members` as given: (name, bytes) for a
    regular file, or a header of any kind."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        body = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
        _file(tar, "manifest.json", body)
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                _file(tar, *member)
    return path


def _file(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _entry(name: str, data: bytes) -> dict[str, Any]:
    import hashlib  # noqa: PLC0415

    return {"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "private": False}  # fmt: skip


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def _alter(
    genuine: Parts,
    manifest: Callable[[dict[str, Any]], None] | None = None,
    members: Callable[[list[Any]], list[Any]] | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    document = json.loads(json.dumps(genuine[0]))
    if manifest is not None:
        manifest(document)
    rest: list[Any] = list(genuine[1])
    return document, members(rest) if members is not None else rest


def _with_member(document: dict[str, Any], name: str, data: bytes) -> None:
    document["members"].append(_entry(name, data))


CASES: dict[str, tuple[Callable[[Parts], tuple[dict[str, Any] | bytes, list[Any]]], str]] = {
    # Names that would escape the data directory, in the manifest or only in the tar.
    "traversal in the manifest": (
        lambda g: _alter(g, lambda m: _with_member(m, "../evil", b"x"),
                         lambda r: [*r, ("../evil", b"x")]),
        "'../evil', which a backup of hub never holds",
    ),
    "absolute path in the manifest": (
        lambda g: _alter(g, lambda m: _with_member(m, "/evil", b"x")),
        "'/evil', which a backup of hub never holds",
    ),
    "traversal in the tar only": (
        lambda g: _alter(g, members=lambda r: [("../evil", b"x"), *r]),
        "'../evil': a member the manifest does not name",
    ),
    "a name hidden under an allowed folder": (
        lambda g: _alter(g, lambda m: _with_member(m, "pki/../../evil", b"x")),
        "'pki/../../evil', which a backup of hub never holds",
    ),
    "a symlink": (
        lambda g: _alter(g, members=lambda r: [
            _link(n, "/etc/passwd", tarfile.SYMTYPE) if n == "pki/ca.crt" else (n, d)
            for n, d in r]),
        "'pki/ca.crt' is a link",
    ),
    "a hard link": (
        lambda g: _alter(g, members=lambda r: [
            _link(n, "hub.db", tarfile.LNKTYPE) if n == "pki/ca.key" else (n, d)
            for n, d in r]),
        "'pki/ca.key' is a link",
    ),
    "a device": (
        lambda g: _alter(g, members=lambda r: [
            _link(n, "", tarfile.CHRTYPE) if n == "pki/ca.key" else (n, d) for n, d in r]),
        "'pki/ca.key' is not a regular file",
    ),
    "an oversized member": (
        lambda g: _alter(g, members=lambda r: [
            (n, d + b"\0" * 4096 if n == "hub.db" else d) for n, d in r]),
        "oversized or altered member",
    ),
    "a member that does not match its digest": (
        lambda g: _alter(g, members=lambda r: [
            (n, d[:-1] + bytes([d[-1] ^ 1]) if n == "pki/ca.crt" else d) for n, d in r]),
        "'pki/ca.crt' does not match its digest",
    ),
    "a member twice": (
        lambda g: _alter(g, members=lambda r: [*r, r[-1]]),
        "appears twice",
    ),
    "a truncated archive": (
        lambda g: _alter(g, members=lambda r: r[:-1]),
        "missing 1 member(s)",
    ),
    "more than the disk holds": (
        lambda g: _alter(g, lambda m: m["members"].append(
            {**_entry("artifacts/" + "0" * 64, b""), "size": 1 << 60, "sha256": "0" * 64})),
        "make room first",
    ),
    "an artifact not named by its digest": (
        lambda g: _alter(g, lambda m: _with_member(m, "artifacts/" + "a" * 64, b"model"),
                         lambda r: [*r, ("artifacts/" + "a" * 64, b"model")]),
        "is not named by its digest",
    ),
    "a newer schema": (
        lambda g: _alter(g, lambda m: m["migrations"].append("m999_from_the_future")),
        "newer than this hub's (migration m999_from_the_future",
    ),
    "a newer format": (
        lambda g: _alter(g, lambda m: m.update(version=2, anything="new")),
        "format 2, made by a newer kvl",
    ),
    "an appliance's backup": (
        lambda g: _alter(g, lambda m: m.update(kind="appliance")),
        "is a backup of appliance, not of hub",
    ),
    "a store of another kind": (
        lambda g: _alter(g, lambda m: m.update(store="postgres")),
        "holds a hub's store on PostgreSQL",
    ),
    "a manifest that is not JSON": (lambda g: (b"{nope", g[1]), "its manifest is not JSON"),
    "a manifest nested 100,000 deep": (
        lambda g: (b'{"format": "kvl-backup", "members": ' + b"[" * 100_000 + b"]" * 100_000
                   + b"}", g[1]),
        "its manifest is refused: nested deeper than",
    ),
    "a manifest of a million objects": (
        lambda g: (b'{"format": "kvl-backup", "members": [' + b"{}," * 1_000_000 + b"{}]}", g[1]),
        "its manifest holds more objects, arrays or values than a backup of 200000 members",
    ),
    "a manifest of something else": (
        lambda g: ({"format": "tar"}, g[1]),
        "is not a kvl backup",
    ),
    "a malformed manifest": (
        lambda g: _alter(g, lambda m: m["members"][0].update(size=-1)),
        "its manifest is malformed",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_or_altered_archive_is_refused_and_nothing_is_written(
    tmp_path: Path, genuine: Parts, case: str
) -> None:
    make, message = CASES[case]
    manifest, members = make(genuine)
    archive = forge(tmp_path / "forged.tar", manifest, members)
    hub = settings_for(tmp_path / "target", {})
    with pytest.raises(BackupError) as refused:
        restore(hub, archive)
    assert message in str(refused.value)
    assert occupied(hub.data_dir) == []  # not even the staging folder is left
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "target" / "evil").exists()


def test_an_archive_that_does_not_begin_with_its_manifest_is_refused(
    tmp_path: Path, genuine: Parts
) -> None:
    manifest, members = genuine
    archive = tmp_path / "late.tar"
    with tarfile.open(archive, "w") as tar:
        for name, data in [*members, ("manifest.json", json.dumps(manifest).encode())]:
            _file(tar, name, data)
    hub = settings_for(tmp_path / "target", {})
    with pytest.raises(BackupError, match=r"does not begin with manifest\.json"):
        restore(hub, archive)
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(BackupError, match="not a readable backup"):
        restore(hub, tmp_path / "junk.tar")
    assert occupied(hub.data_dir) == []


def test_the_cli_says_why_it_refuses(tmp_path: Path, genuine: Parts) -> None:
    manifest, members = genuine
    archive = forge(tmp_path / "forged.tar", manifest, [("../evil", b"x"), *members])
    refused = kvl("hub", "restore", str(archive), "--data-dir", str(tmp_path / "t"), check=False)
    assert refused.returncode == 1
    assert "a member the manifest does not name" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "evil").exists()


# -- tar headers: bounded before they are read ---------------------------------------------

HUGE = 256 << 20
MiB = 1 << 20
EXTENDED = {
    "a PAX header": tarfile.XHDTYPE,
    "a GNU long name": tarfile.GNUTYPE_LONGNAME,
    "a GNU long link": tarfile.GNUTYPE_LONGLINK,
}


def _header(kind: bytes, size: int) -> bytes:
    """The header block of an extended header whose body is `size` bytes."""
    info = tarfile.TarInfo("././@PaxHeader" if kind == tarfile.XHDTYPE else "././@LongLink")
    info.type = kind
    info.size = size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _genuine_tar(tmp_path: Path, genuine: Parts) -> bytes:
    manifest, members = genuine
    return forge(tmp_path / "genuine-again.tar", manifest, [*members]).read_bytes()


def _bomb(path: Path, kind: bytes, tail: bytes) -> Path:
    """A gzipped archive of an extended header of 256 MiB (a PAX record, or a long name,
    of '0's: a few hundred KiB once gzipped), then `tail`."""
    with gzip.open(path, "wb") as out:
        out.write(_header(kind, HUGE))
        head = f"{HUGE} comment=".encode() if kind == tarfile.XHDTYPE else b""
        out.write(head)
        left = HUGE - len(head) - 1
        while left > 0:
            out.write(b"0" * min(MiB, left))
            left -= MiB
        out.write(b"\n")
        out.write(tail)
    return path


# The restore in a process of its own: its peak resident memory (VmHWM) against what it held
# resident just before (VmRSS; not its peak before, which could hide what the restore
# took). Not getrusage's ru_maxrss: Linux carries that over an exec, so it starts at the
# size of the process that ran this one.
MEASURE = """
import json, re, sys
from pathlib import Path
from shared.backup_archive import BackupError
from shared.cli import settings_from

def status(field):
    with open("/proc/self/status") as status:
        return int(re.search(field + r":\\s+(\\d+) kB", status.read()).group(1)) * 1024

entry, archive, data_dir = sys.argv[1:]
if entry == "hub":
    from hub.backup import restore
    from hub.settings import HubSettings as Settings
else:
    from appliance.backup import restore
    from appliance.settings import ApplianceSettings as Settings
settings = settings_from(Settings, None, Path(data_dir))
resident = status("VmRSS")
try:
    restore(settings, Path(archive))
    refused = None
except BackupError as err:
    refused = str(err)[:500]
print(json.dumps({"refused": refused, "grew": status("VmHWM") - resident}))
"""


@pytest.mark.parametrize(
    ("entry", "header"),
    [("hub", "a PAX header"), ("hub", "a GNU long name"), ("appliance", "a PAX header")],
)
def test_an_extended_header_of_256_mib_is_refused_before_it_is_read(
    tmp_path: Path, genuine: Parts, entry: str, header: str
) -> None:
    archive = _bomb(tmp_path / "bomb.tar.gz", EXTENDED[header], _genuine_tar(tmp_path, genuine))
    assert archive.stat().st_size < 2 * MiB
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
    ran = subprocess.run(
        [sys.executable, "-c", MEASURE, entry, str(archive), str(tmp_path / "target")],
        capture_output=True, text=True, check=True, cwd=REPO, env=env, timeout=120,
    )  # fmt: skip
    result = json.loads(ran.stdout)
    assert f"an extended tar header of {HUGE} bytes" in (result["refused"] or "")
    assert result["grew"] < 64 * MiB, f"the restore took {result['grew'] / MiB:.0f} MiB"
    assert occupied(tmp_path / "target") == []


@pytest.mark.parametrize("header", sorted(EXTENDED))
def test_an_extended_header_is_refused_by_the_size_it_claims(tmp_path: Path, header: str) -> None:
    # The claim alone (no body follows): refused before a byte of it is read.
    archive = tmp_path / "claims.tar"
    archive.write_bytes(_header(EXTENDED[header], MAX_HEADER_BYTES + 1))
    hub = settings_for(tmp_path / "target", {})
    with pytest.raises(BackupError, match=f"an extended tar header of {MAX_HEADER_BYTES + 1} "):
        restore(hub, archive)
    assert occupied(hub.data_dir) == []


def test_a_chain_of_extended_headers_is_refused(tmp_path: Path, genuine: Parts) -> None:
    # tarfile follows such a chain by recursion: 10,000 ended in a RecursionError.
    record = pax_record("comment", "x")
    block = _header(tarfile.XHDTYPE, len(record)) + record.ljust(tarfile.BLOCKSIZE, b"\0")
    archive = tmp_path / "chain.tar"
    archive.write_bytes(block * 10_000 + _genuine_tar(tmp_path, genuine))
    hub = settings_for(tmp_path / "target", {})
    with pytest.raises(BackupError, match="more than 4 extended tar headers before one member"):
        restore(hub, archive)
    assert occupied(hub.data_dir) == []


def _with_pax(name: str, data: bytes, records: dict[str, str]) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.pax_headers = records
    return info


def test_pax_headers_as_other_tars_write_them_are_read(tmp_path: Path, genuine: Parts) -> None:
    """A genuine backup whose members each carry a PAX header (times, their name, their
    size: what GNU tar or another writer may add) restores whole."""
    manifest, members = genuine
    archive = tmp_path / "pax.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        body = json.dumps(manifest).encode()
        records = {"mtime": "1767225600.5", "atime": "1767225600.5", "comment": "é=ü\n"}
        tar.addfile(_with_pax("manifest.json", body, records), io.BytesIO(body))
        for name, data in members:
            info = _with_pax("placeholder", data, {"path": name, "size": str(len(data))})
            tar.addfile(info, io.BytesIO(data))
    hub = settings_for(tmp_path / "target", {})
    restored = restore(hub, archive)
    assert {m.path for m in restored.manifest.members} == {name for name, _ in members}
    for name, data in members:
        if name != "hub.db":  # the restore moved its serials on
            assert (hub.data_dir / name).read_bytes() == data
    store = open_store(hub)
    try:
        assert [a["name"] for a in store.accounts.all()] == ["acme"]
    finally:
        store.close()


def test_a_sparse_member_is_refused(tmp_path: Path, genuine: Parts) -> None:
    # GNU's sparse PAX format 1.0 keeps the member's map in its data: tarfile reads it
    # whole, as long as the map says.
    manifest, members = genuine
    sparse = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "1"}
    name = members[-1][0]
    last = _with_pax(name, b"", sparse)
    archive = forge(tmp_path / "sparse.tar", manifest, [*members[:-1], last])
    hub = settings_for(tmp_path / "target", {})
    with pytest.raises(BackupError, match=re.escape(f"{name!r} is not a regular file")):
        restore(hub, archive)
    assert occupied(hub.data_dir) == []
