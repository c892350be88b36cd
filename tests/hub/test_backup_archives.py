"""A restore trusts nothing in an archive (shared/backup.py `read_archive`): a genuine
hub backup, altered each way an archive can lie or attack, is refused with an error that
says what is wrong, nothing is written outside the data directory, and the data directory
is left as it was (empty)."""

from __future__ import annotations

import io
import json
import tarfile
from typing import TYPE_CHECKING, Any

import pytest

from hub.backup import backup, restore
from hub.identity import certificates, hub_keys
from hub.state.store import open_store
from shared.backup import BackupError, occupied
from tests.conftest import kvl
from tests.hub.test_hub import settings_for

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
        store.set_account("acme", "S1")
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
