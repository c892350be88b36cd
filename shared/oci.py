"""One OCI image layout in one tar archive: how a content package travels between the
appliance's cache, the hub and other appliances (image-spec ``image-layout.md``).

The archive holds ``oci-layout``, ``index.json`` and ``blobs/sha256/<hex>``, nothing else.
``write_layout`` is deterministic (sorted members, fixed owner, mode and time), so the same
package always makes the same archive and the same digest. ``read_layout`` fails closed:
any other member, a link, a device, a sparse member, a name that escapes, a duplicate, a
member that declares more bytes than the archive holds, an extended tar header larger or
a chain of them longer than ``shared.tarstream`` reads (all refused from the headers,
before any member is read), a blob that does not match its name, a size above the limit,
or an index that names a missing blob raises LayoutError. So does any JSON of the layout
(``oci-layout``, ``index.json``, a manifest) that is not what the image spec says: nested
deeper than ``shared.jsonlimits`` allows, or of another shape (a string where an object
goes, ``layers`` that is a number, a descriptor without a digest, a size that is not a
whole number). The archive comes from a peer (an operator's upload to the hub, the hub's
seed to a node): whatever it holds is refused as LayoutError, never a TypeError below.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from shared import jsonlimits, protocol, tarstream

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
_M = TypeVar("_M", bound=BaseModel)


class LayoutError(ValueError):
    """Not a well-formed, intact OCI layout archive."""


class _Shape(BaseModel):
    """JSON of the layout as the image spec shapes it. Strict: a number is not a string,
    nor a string a number; fields this module does not read are kept as they are."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class Descriptor(_Shape):
    """An OCI content descriptor (image-spec ``descriptor.md``), sha256 only."""

    mediaType: str | None = None  # noqa: N815 - the spec's name
    digest: Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]
    size: int = Field(ge=0)
    artifactType: str | None = None  # noqa: N815 - the spec's name
    annotations: dict[str, str] = Field(default_factory=dict)

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")


class ImageIndex(_Shape):
    manifests: list[Descriptor] = Field(min_length=1)


class ImageManifest(_Shape):
    artifactType: str | None = None  # noqa: N815 - the spec's name
    config: Descriptor
    layers: list[Descriptor] = Field(default_factory=list)
    annotations: dict[str, str] = Field(default_factory=dict)


class _PackageManifest(_Shape):
    """What the hub reads of a package's ``manifest.json`` (the appliance's Manifest has
    these and more; the hub needs only these, of these types)."""

    title: str
    topic: str
    level: str
    items: list[Any]
    lineage: dict[str, Any]
    created_at: str


@dataclass(frozen=True)
class Layout:
    index: dict[str, Any]  # as the archive has it; its shape checked (``manifests``)
    manifests: tuple[Descriptor, ...]  # the index's, each naming a manifest checked whole
    blobs: dict[str, bytes]  # by hex sha256, each checked

    def json_blob(self, descriptor: Descriptor) -> dict[str, Any]:
        """A JSON blob by its descriptor (LayoutError when absent, not a JSON object, or
        nested deeper than a peer's JSON may be)."""
        try:
            document = jsonlimits.loads(self.blobs[descriptor.hex])
        except (KeyError, ValueError) as err:  # JsonLimitError is a ValueError
            raise LayoutError(f"blob {descriptor.hex[:12]} is missing or not JSON") from err
        if not isinstance(document, dict):
            raise LayoutError(f"blob {descriptor.hex[:12]} is not a JSON object")
        return document

    def manifest(self, descriptor: Descriptor) -> ImageManifest:
        """The image manifest a descriptor of the index names, its shape checked."""
        return _shaped(ImageManifest, self.json_blob(descriptor), f"manifest {descriptor.hex[:12]}")


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
    members = _members(data)
    blobs = {m.group(1): content for name, content in members.items()
             if (m := _BLOB.match(name)) is not None}  # fmt: skip
    try:
        layout_doc = jsonlimits.loads(members["oci-layout"])
        index = jsonlimits.loads(members["index.json"])
    except (KeyError, ValueError) as err:  # JsonLimitError is a ValueError
        raise LayoutError("oci-layout (version 1.0.0) and index.json are required") from err
    if not isinstance(layout_doc, dict) or layout_doc.get("imageLayoutVersion") != "1.0.0":
        raise LayoutError("oci-layout (version 1.0.0) and index.json are required")
    if not isinstance(index, dict):
        raise LayoutError("index.json is not a JSON object")
    manifests = _shaped(ImageIndex, index, "index.json").manifests
    layout = Layout(index, tuple(manifests), blobs)
    for descriptor in manifests:
        manifest = layout.manifest(descriptor)
        for blob in [manifest.config, *manifest.layers]:
            if blob.hex not in blobs or len(blobs[blob.hex]) != blob.size:
                raise LayoutError(f"blob {blob.hex[:12]} is missing or of another size")
    return layout


def package_layers(manifest: ImageManifest) -> dict[str, Descriptor]:
    """A package's files by path (each layer's title), ``manifest.json`` among them
    (LayoutError when a layer has no title, two share one, or manifest.json is absent)."""
    layers: dict[str, Descriptor] = {}
    for layer in manifest.layers:
        title = layer.annotations.get(TITLE)
        if title is None or title in layers:
            raise LayoutError(f"a layer without a title, or a title twice: {title!r:.200}")
        layers[title] = layer
    if MANIFEST_PATH not in layers:
        raise LayoutError(f"the package has no {MANIFEST_PATH}")
    return layers


def package_summary(layout: Layout) -> dict[str, Any]:
    """What the hub keeps of the one package an archive holds: id, version, title, topic,
    level, item count, file bytes, the OCI manifest's digest, lineage, created_at
    (LayoutError when the archive is not one content package). Each value is bounded as
    a node's report of a package is (``protocol.PackageBody``): the hub keeps the one as
    it keeps the other."""
    if len(layout.manifests) != 1:
        raise LayoutError("a package archive holds exactly one package")
    (descriptor,) = layout.manifests
    oci = layout.manifest(descriptor)
    if oci.artifactType != PACKAGE_ARTIFACT:
        raise LayoutError("the archive's manifest is not a content package")
    layers = package_layers(oci)
    manifest = _shaped(_PackageManifest, layout.json_blob(layers[MANIFEST_PATH]), MANIFEST_PATH)
    try:
        summary = {
            "id": oci.annotations[PKG_ID],
            "version": oci.annotations[PKG_VERSION],
            "title": manifest.title,
            "topic": manifest.topic,
            "level": manifest.level,
            "items": len(manifest.items),
            "size": sum(layer.size for layer in oci.layers),
            "digest": descriptor.digest,
            "lineage": manifest.lineage,
            "created_at": manifest.created_at,
        }
    except KeyError as err:
        raise LayoutError(f"the package's OCI manifest lacks the annotation {err}") from err
    body = _shaped(protocol.PackageBody, summary, "the package")
    return body.model_dump(mode="json", include=set(summary))


def _shaped(model: type[_M], document: object, what: str) -> _M:
    """``document`` as ``model``, or LayoutError naming the first field that is wrong."""
    try:
        return model.model_validate(document)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the document"
        # The place, not the value: a peer's text goes back cut short.
        raise LayoutError(f"{what}: {where:.200}: {first['msg']}") from err


def _members(data: bytes) -> dict[str, bytes]:
    """Every file of the archive by name, each blob checked against its name.

    Every header is checked before any member is read: an archive with one bad member is
    refused without a byte of another copied or hashed. The headers are read by
    ``shared.tarstream``, not by tarfile, whose PAX parsing on this Python takes time
    quadratic in a header's length (CVE-2024-6232) and which reads an extended header
    whole at whatever size it claims."""
    files: dict[str, tarfile.TarInfo] = {}
    try:
        # The headers alone: the reader skips each member's bytes.
        reader = tarstream.TarStream(io.BytesIO(data))
        while (member := reader.next()) is not None:
            if not _admitted(member, len(data)):
                continue
            name = member.name.removeprefix("./")
            if name in files:
                raise LayoutError(f"{name} appears twice")
            files[name] = member
    except tarstream.SparseMemberError as err:
        raise LayoutError(f"{err.name.removeprefix('./')}: a sparse member") from err
    except tarstream.TarStreamError as err:
        raise LayoutError(f"not a readable OCI layout archive: {err}") from err
    members: dict[str, bytes] = {}
    for name, member in files.items():
        blob = _BLOB.match(name)
        content = _read(data, member)
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
    # directories belong here. The reader refuses PAX sparse members itself, and returns an
    # old GNU one (type S) without its map: issparse() is False for it.
    if member.issparse() or member.type == tarfile.GNUTYPE_SPARSE:
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


def _read(data: bytes, member: tarfile.TarInfo) -> bytes:
    """A member's bytes, where its header put them (``_admitted`` checked they lie in the
    archive)."""
    return data[member.offset_data : member.offset_data + member.size]


def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
