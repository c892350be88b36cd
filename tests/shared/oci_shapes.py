"""Package archives whose JSON is of the wrong shape: each one a well-formed, intact OCI
layout (every blob matches its digest and size) but for one document changed: a string
where an object goes, `layers` a number, nesting far deeper than a peer may send, null,
an array for an object. Who reads a package archive from a peer (the hub's upload route,
an appliance's seeded package) must refuse each one as a domain error, never fail below.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from typing import Any

from shared.oci import (
    CACHE_KEY,
    MANIFEST_PATH,
    PACKAGE_ARTIFACT,
    PKG_ID,
    PKG_VERSION,
    TITLE,
    write_layout,
)

# The documents of a package archive a case may change.
OCI_LAYOUT, INDEX, OCI, MANIFEST = "oci-layout", "index.json", "oci manifest", MANIFEST_PATH
Change = Callable[[Any], Any]  # a document (JSON as Python) -> its replacement, or raw bytes


def _nested(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


# Past the recursion Python's json can take, and just past shared.jsonlimits' depth.
ABYSS = _nested(100_000)
DEEP = _nested(70)


def _with(field: str, value: Any) -> Change:
    def change(document: Any) -> Any:
        document[field] = value
        return document

    return change


def _with_raw(field: str, raw: bytes) -> Change:
    """The document with ``field`` set to JSON text no Python value dumps to."""

    def change(document: Any) -> bytes:
        document.pop(field, None)
        head = json.dumps(document).encode()[:-1]
        return head + (b", " if document else b"") + json.dumps(field).encode() + b": " + raw + b"}"

    return change


def _in_layers(field: str, value: Any) -> Change:
    def change(document: Any) -> Any:
        for layer in document["layers"]:
            layer[field] = value
        return document

    return change


def _annotation(name: str, value: Any) -> Change:
    def change(document: Any) -> Any:
        document["annotations"][name] = value
        return document

    return change


def _first_manifest(field: str, value: Any) -> Change:
    def change(document: Any) -> Any:
        document["manifests"][0][field] = value
        return document

    return change


def _deep_dict(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def _is(value: Any) -> Change:
    return lambda _document: value


# name: (the document changed, how)
SHAPES: dict[str, tuple[str, Change]] = {
    "oci-layout an array": (OCI_LAYOUT, _is([1, 2])),
    "oci-layout a string": (OCI_LAYOUT, _is("1.0.0")),
    "oci-layout nested past the recursion limit": (OCI_LAYOUT, _is(ABYSS)),
    "index null": (INDEX, _is(None)),
    "index a string": (INDEX, _is("manifests")),
    "index an array": (INDEX, _is([{"manifests": []}])),
    "index nested past the recursion limit": (INDEX, _is(ABYSS)),
    "index with a field nested deep": (INDEX, _with_raw("x", DEEP)),
    "index manifests an object": (INDEX, _with("manifests", {"0": {}})),
    "index manifests a string": (INDEX, _with("manifests", "sha256:00")),
    "index manifests null": (INDEX, _with("manifests", None)),
    "index manifest null": (INDEX, _with("manifests", [None])),
    "index manifest a string": (INDEX, _with("manifests", ["sha256:00"])),
    "index digest a number": (INDEX, _first_manifest("digest", 12)),
    "index digest an object": (INDEX, _first_manifest("digest", {"sha256": "00"})),
    "index size a string": (INDEX, _first_manifest("size", "12")),
    "index annotations an array": (INDEX, _first_manifest("annotations", ["a"])),
    "manifest a string": (OCI, _is("a manifest")),
    "manifest null": (OCI, _is(None)),
    "manifest an array": (OCI, _is([{"layers": []}])),
    "manifest nested past the recursion limit": (OCI, _is(ABYSS)),
    "manifest with a field nested deep": (OCI, _with_raw("x", DEEP)),
    "manifest with a field nested past the recursion limit": (OCI, _with_raw("x", ABYSS)),
    "config a string": (OCI, _with("config", "sha256:00")),
    "config null": (OCI, _with("config", None)),
    "config an array": (OCI, _with("config", [])),
    "layers an int": (OCI, _with("layers", 5)),
    "layers a string": (OCI, _with("layers", "manifest.json")),
    "layers an object": (OCI, _with("layers", {"manifest.json": {}})),
    "layers null": (OCI, _with("layers", None)),
    "layers of null": (OCI, _with("layers", [None])),
    "layers of strings": (OCI, _with("layers", ["manifest.json"])),
    "layers of arrays": (OCI, _with("layers", [[]])),
    "layer size a string": (OCI, _in_layers("size", "12")),
    "layer size a float": (OCI, _in_layers("size", 12.5)),
    "layer size a bool": (OCI, _in_layers("size", value=True)),
    "layer size negative": (OCI, _in_layers("size", -1)),
    "layer digest a number": (OCI, _in_layers("digest", 7)),
    "layer digest null": (OCI, _in_layers("digest", None)),
    "layer annotations a string": (OCI, _in_layers("annotations", TITLE)),
    "layer title a number": (OCI, _in_layers("annotations", {TITLE: 1})),
    "layer title missing": (OCI, _in_layers("annotations", {})),
    "annotations an array": (OCI, _with("annotations", [PKG_ID])),
    "annotations null": (OCI, _with("annotations", None)),
    "package id an object": (OCI, _annotation(PKG_ID, {"id": "x"})),
    "package id missing": (OCI, lambda d: {**d, "annotations": {}}),
    "artifactType a number": (OCI, _with("artifactType", 1)),
    "manifest.json a string": (MANIFEST, _is("a package")),
    "manifest.json null": (MANIFEST, _is(None)),
    "manifest.json an array": (MANIFEST, _is([])),
    "manifest.json nested past the recursion limit": (MANIFEST, _is(ABYSS)),
    "manifest.json items nested deep": (MANIFEST, _with_raw("items", DEEP)),
    "manifest.json items an int": (MANIFEST, _with("items", 3)),
    "manifest.json items null": (MANIFEST, _with("items", None)),
    "manifest.json title an object": (MANIFEST, _with("title", {"en": "x"})),
    "manifest.json title null": (MANIFEST, _with("title", None)),
    "manifest.json title with a NUL": (MANIFEST, _with("title", "a\u0000b")),
    "manifest.json level a number": (MANIFEST, _with("level", 2)),
    "manifest.json lineage a string": (MANIFEST, _with("lineage", "gemma")),
    "manifest.json lineage an array": (MANIFEST, _with("lineage", [])),
    "manifest.json lineage nested 20 deep": (MANIFEST, _with("lineage", _deep_dict(20))),
    "manifest.json created_at a number": (MANIFEST, _with("created_at", 1.7e9)),
}
# What an appliance takes of these: it reads manifest.json as its own Manifest, whose
# text may hold a NUL; the hub refuses one (no database of its keeps it).
APPLIANCE_TAKES = frozenset({"manifest.json title with a NUL"})


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dump(value: Any) -> bytes:
    """As write_layout writes a document (raw bytes as they are)."""
    if isinstance(value, bytes):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def rewrap(archive: bytes, target: str, change: Change) -> bytes:
    """``archive`` (a package archive) with one of its documents changed, and every
    digest and size that names it made again, so that only the shape is wrong. A change
    that changes nothing gives back the same archive."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    blobs = {
        n.removeprefix("blobs/sha256/"): d for n, d in members.items() if n.startswith("blobs/")
    }
    index = json.loads(members["index.json"])
    descriptor = index["manifests"][0]
    oci_raw = blobs[descriptor["digest"].removeprefix("sha256:")]
    oci = json.loads(oci_raw)
    (layer,) = [layer for layer in oci["layers"] if layer["annotations"][TITLE] == MANIFEST_PATH]
    manifest = json.loads(blobs[layer["digest"].removeprefix("sha256:")])
    documents = {OCI_LAYOUT: json.loads(members["oci-layout"]), INDEX: index, OCI: oci,
                 MANIFEST: manifest}  # fmt: skip
    changed = _dump(change(copy.deepcopy(documents[target])))

    def named(data: bytes) -> dict[str, Any]:
        blobs[_hex(data)] = data
        return {"digest": f"sha256:{_hex(data)}", "size": len(data)}

    # Each document that names the changed one is written again, and only those.
    if target == MANIFEST:
        layer.update(named(changed))
        oci_raw = _dump(oci)
    if target in (MANIFEST, OCI):
        descriptor.update(named(changed if target == OCI else oci_raw))
    files = [
        ("oci-layout", changed if target == OCI_LAYOUT else members["oci-layout"]),
        ("index.json", changed if target == INDEX else _dump(index)),
        *((f"blobs/sha256/{h}", blobs[h]) for h in sorted(blobs)),
    ]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def package_archive() -> bytes:
    """A package archive made by hand, with what the hub reads of one and no more."""
    manifest = json.dumps({
        "id": "pkg_1", "version": "1", "title": "Lesson", "topic": "Plants",
        "level": "beginner", "items": [{"id": "q1"}], "created_at": "2025-01-01T00:00:00+00:00",
        "lineage": {"model": {"name": "m", "version": "1"}, "seed": 1},
    }).encode()  # fmt: skip
    items = b'{"items": []}'
    config = b"{}"

    def descriptor(data: bytes, media_type: str, **extra: Any) -> dict[str, Any]:
        return {"mediaType": media_type, "digest": f"sha256:{_hex(data)}", "size": len(data),
                **extra}  # fmt: skip

    oci = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": PACKAGE_ARTIFACT,
        "config": descriptor(config, "application/vnd.oci.empty.v1+json"),
        "layers": [
            descriptor(manifest, "application/json", annotations={TITLE: MANIFEST_PATH}),
            descriptor(items, "application/json", annotations={TITLE: "items.json"}),
        ],
        "annotations": {PKG_ID: "pkg_1", PKG_VERSION: "1", CACHE_KEY: "key-1"},
    }).encode()  # fmt: skip
    index = {"schemaVersion": 2, "manifests": [
        descriptor(oci, "application/vnd.oci.image.manifest.v1+json")]}  # fmt: skip
    return write_layout(index, {_hex(b): b for b in (manifest, items, config, oci)})


def sparse_member(name: str, stored: bytes, real_size: int) -> bytes:
    """A GNU sparse member (type S): `stored` at offset 0, then a hole up to `real_size`,
    which reads back as zeros. tarfile reads these but cannot write them."""
    info = tarfile.TarInfo(name)
    info.type, info.size = tarfile.GNUTYPE_SPARSE, len(stored)
    header = tar_header(info)
    header[386:398] = octal(0)  # the first (offset, numbytes) of the sparse map
    header[398:410] = octal(len(stored))
    header[483:495] = octal(real_size)  # the size the member expands to
    return sealed(header) + padded(stored)


def with_last_member(valid: bytes, last: bytes) -> bytes:
    """A well-formed archive, then one hand-made member, then the end of the archive."""
    with tarfile.open(fileobj=io.BytesIO(valid)) as tar:
        final = tar.getmembers()[-1]
    # write_layout's end-of-archive blocks are cut off: the hostile member goes last, so
    # that a reader going member by member would have read every good one before it.
    members = valid[: final.offset_data + len(padded(b"x" * final.size))]
    return members + last + b"\0" * (2 * tarfile.BLOCKSIZE)


def octal(value: int, width: int = 12) -> bytes:
    return f"{value:0{width - 1}o}\0".encode()


def tar_header(info: tarfile.TarInfo) -> bytearray:
    return bytearray(info.tobuf(tarfile.GNU_FORMAT))


def sealed(header: bytearray) -> bytes:
    """The header with its checksum made again (after fields were written by hand)."""
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    return bytes(header)


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)
