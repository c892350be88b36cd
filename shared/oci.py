"""One OCI image layout in one tar archive: how a content package travels between the
appliance's cache, the hub and other appliances (image-spec ``image-layout.md``).

The archive holds ``oci-layout``, ``index.json`` and ``blobs/sha256/<hex>``, nothing else.
``write_layout`` is deterministic (sorted members, fixed owner, mode and time), so the same
package always makes the same archive and the same digest. ``read_layout`` fails closed:
any other member, a link, a device, a sparse member, a name that escapes, a duplicate, a
member that declares more bytes than the archive holds (all refused from the headers,
before any member is read), a blob that does not match its name, a size above the limit,
or an index that names a missing blob raises LayoutError.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

LAYOUT = b'{"imageLayoutVersion":"1.0.0"}'
BUNDLE_MEDIA_TYPE = "application/vnd.oci.image.layout.v1+tar"
# A content package as an OCI artifact: its annotations and its manifest.json layer.
PACKAGE_ARTIFACT = "application/vnd.kovenlab.package.v1+json"
TITLE = "org.opencontainers.image.title"
PKG_ID = "dev.kovenlab.package.id"
PKG_VERSION = "dev.kovenlab.package.version"
CACHE_KEY = "dev.kovenlab.cache-key"
MANIFEST_PATH = "manifest.json"
_BLOB = re.compile(r"^blobs/sha256/([0-9a-f]{64})$")


class LayoutError(ValueError):
    """Not a well-formed, intact OCI layout archive."""


@dataclass(frozen=True)
class Layout:
    index: dict[str, Any]
    blobs: dict[str, bytes]  # by hex sha256, each checked

    def json_blob(self, descriptor: dict[str, Any]) -> dict[str, Any]:
        """A JSON blob by its descriptor (LayoutError when absent or not a JSON object)."""
        hex_digest = str(descriptor.get("digest", "")).removeprefix("sha256:")
        try:
            document = json.loads(self.blobs[hex_digest])
        except (KeyError, ValueError) as err:
            raise LayoutError(f"blob {hex_digest[:12]} is missing or not JSON") from err
        if not isinstance(document, dict):
            raise LayoutError(f"blob {hex_digest[:12]} is not a JSON object")
        return document


def write_layout(index: dict[str, Any], blobs: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    members = [
        ("oci-layout", LAYOUT),
        ("index.json", _canonical(index)),
        *((f"blobs/sha256/{h}", blobs[h]) for h in sorted(blobs)),
    ]
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def read_layout(data: bytes, *, max_bytes: int) -> Layout:
    if len(data) > max_bytes:
        raise LayoutError(f"the archive is {len(data)} bytes, above the limit of {max_bytes}")
    try:
        members = _members(data)
    except LayoutError:
        raise
    except (tarfile.TarError, ValueError, AttributeError) as err:
        raise LayoutError(f"not a readable OCI layout archive: {err}") from err
    blobs = {m.group(1): content for name, content in members.items()
             if (m := _BLOB.match(name)) is not None}  # fmt: skip
    try:
        layout_ok = json.loads(members["oci-layout"]).get("imageLayoutVersion") == "1.0.0"
        index = json.loads(members["index.json"])
    except (KeyError, ValueError, AttributeError) as err:
        raise LayoutError("oci-layout (version 1.0.0) and index.json are required") from err
    if not layout_ok or not isinstance(index, dict):
        raise LayoutError("oci-layout (version 1.0.0) and index.json are required")
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise LayoutError("index.json lists no manifests")
    layout = Layout(index, blobs)
    for descriptor in manifests:
        if not isinstance(descriptor, dict):
            raise LayoutError("index.json: a manifest descriptor is not an object")
        manifest = layout.json_blob(descriptor)
        for blob in [manifest.get("config", {}), *manifest.get("layers", [])]:
            hex_digest = str(blob.get("digest", "")).removeprefix("sha256:")
            if hex_digest not in blobs or len(blobs[hex_digest]) != blob.get("size"):
                raise LayoutError(f"blob {hex_digest[:12]} is missing or of another size")
    return layout


def package_summary(layout: Layout) -> dict[str, Any]:
    """What the hub keeps of the one package an archive holds: id, version, title, topic,
    level, item count, file bytes, the OCI manifest's digest, lineage, created_at
    (LayoutError when the archive is not one content package)."""
    descriptors = layout.index["manifests"]
    if len(descriptors) != 1:
        raise LayoutError("a package archive holds exactly one package")
    oci = layout.json_blob(descriptors[0])
    if oci.get("artifactType") != PACKAGE_ARTIFACT:
        raise LayoutError("the archive's manifest is not a content package")
    layers = {str(layer.get("annotations", {}).get(TITLE)): layer for layer in oci["layers"]}
    if MANIFEST_PATH not in layers:
        raise LayoutError(f"the package has no {MANIFEST_PATH}")
    manifest = layout.json_blob(layers[MANIFEST_PATH])
    annotations = oci.get("annotations", {})
    try:
        return {
            "id": str(annotations[PKG_ID]),
            "version": str(annotations[PKG_VERSION]),
            "title": str(manifest["title"]),
            "topic": str(manifest["topic"]),
            "level": str(manifest["level"]),
            "items": len(manifest["items"]),
            "size": sum(int(layer["size"]) for layer in oci["layers"]),
            "digest": str(descriptors[0]["digest"]),
            "lineage": manifest["lineage"],
            "created_at": str(manifest["created_at"]),
        }
    except (KeyError, TypeError, ValueError) as err:
        raise LayoutError(f"the package manifest lacks {err}") from err


def _members(data: bytes) -> dict[str, bytes]:
    """Every file of the archive by name, each blob checked against its name.

    Every header is checked before any member is read: an archive with one bad member is
    refused without a byte of another decompressed, copied or hashed."""
    members: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        files: dict[str, tarfile.TarInfo] = {}
        # getmembers() reads headers only, seeking past each member's data.
        for member in tar.getmembers():
            if not _admitted(member, len(data)):
                continue
            name = member.name.removeprefix("./")
            if name in files:
                raise LayoutError(f"{name} appears twice")
            files[name] = member
        for name, member in files.items():
            blob = _BLOB.match(name)
            content = _read(tar, member)
            if blob is not None and hashlib.sha256(content).hexdigest() != blob.group(1):
                raise LayoutError(f"{name} does not match its digest")
            members[name] = content
    return members


def _admitted(member: tarfile.TarInfo, archive_bytes: int) -> bool:
    """Whether a member is a file of the layout (False: one of its directories); raises
    LayoutError for anything else, from its header alone."""
    name = member.name.removeprefix("./")
    path = PurePosixPath(name)
    if name.startswith("/") or ".." in path.parts or "\\" in name or "\0" in name:
        raise LayoutError(f"{name!r}: a name that escapes the layout")
    # isfile() is True for GNU sparse members, whose holes read back as zeros: a few
    # bytes of archive could stand for terabytes. Only plain files and the layout's own
    # directories belong here.
    if member.issparse():
        raise LayoutError(f"{name}: a sparse member")
    if member.islnk() or member.issym():
        raise LayoutError(f"{name}: a link (only regular files belong in a layout)")
    if member.ischr() or member.isblk() or member.isfifo():
        raise LayoutError(f"{name}: a device (only regular files belong in a layout)")
    if member.isdir() and name.rstrip("/") in {"", "blobs", "blobs/sha256"}:
        return False
    if member.type not in {tarfile.REGTYPE, tarfile.AREGTYPE}:
        raise LayoutError(f"{name}: only regular files belong in a layout")
    # A plain member's bytes lie in the archive: a header that says otherwise is a lie
    # about how much a read would produce.
    if member.size < 0 or member.offset_data + member.size > archive_bytes:
        raise LayoutError(
            f"{name}: declares {member.size} bytes, more than the {archive_bytes}-byte "
            "archive holds"
        )
    if name not in {"oci-layout", "index.json"} and _BLOB.match(name) is None:
        raise LayoutError(f"{name}: not part of an OCI layout")
    return True


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise LayoutError(f"{member.name} cannot be read")
    return handle.read()


def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
