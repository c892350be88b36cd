"""OCI layout archives: deterministic, and refused whole when anything is off."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from shared.oci import LayoutError, read_layout, write_layout

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
