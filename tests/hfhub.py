"""A local stand-in for the Hugging Face Hub, which these machines cannot reach: an aiohttp
server answering the endpoints `kvl hub models pull` uses, as the public Hub answers them
(hub/models/huggingface.py), and a second server on another port, the storage host its
`resolve` URLs redirect to (a different host: a token must never reach it).

- ``GET /api/models/OWNER/REPO/revision/REV?blobs=true``: the commit and the files with
  their sizes and LFS sha256, the card's licence; 401 `GatedRepo` for a gated repository
  without the right token, 404 `RepoNotFound`/`RevisionNotFound`, 429 with Retry-After;
- ``GET /OWNER/REPO/resolve/COMMIT/PATH``: 302 to the storage host;
- storage ``GET /blobs/SHA256``: the bytes, with Range, If-Range and the ETag
  (shared/blobs.py), and the faults a test asks for: a cut after so many bytes, a stall.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from shared.blobs import send_blob

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer


def tiny_gguf(tag: str, size: int = 3 << 20, strings: dict[str, str] | None = None) -> bytes:
    """A file that starts as a GGUF does (magic, version 3, no tensors, the `strings` as its
    metadata), padded to `size` bytes: the pull's subject is the bytes, not the model."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    metadata = b"".join(
        string(k) + struct.pack("<I", 8) + string(v) for k, v in (strings or {}).items()
    )
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(strings or {})) + metadata
    body = hashlib.sha256(tag.encode()).digest() * (size // 32 + 1)
    return (head + body)[:size]


def split_gguf(data: bytes, parts: int) -> list[bytes]:
    """`data` (a whole GGUF file) split as llama.cpp's `llama-gguf-split --split` splits
    it: the tensors in `parts` runs, the first part with all the metadata and the `split.*`
    keys, each other with only those; each part a GGUF of its own whose tensors' offsets
    count from its own data section. Written here from the format (the tool is not
    installed), and checked by llama.cpp loading the parts."""
    view = memoryview(data)
    at = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string() -> None:
        nonlocal at
        (length,) = struct.unpack_from("<Q", data, at)
        at += 8 + length

    def value(vtype: int) -> None:
        nonlocal at
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if vtype in sizes:
            at += sizes[vtype]
        elif vtype == 8:
            string()
        else:  # an array
            (item, count) = struct.unpack_from("<IQ", data, at)
            at += 12
            for _ in range(count):
                value(item)

    metadata = []
    alignment = 32
    for _ in range(n_kv):
        start = at
        string()
        key = bytes(view[start + 8 : at]).decode()
        (vtype,) = struct.unpack_from("<I", data, at)
        at += 4
        value(vtype)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, at - 4)
        metadata.append(bytes(view[start:at]))
    tensors = []
    for _ in range(n_tensors):
        start = at
        string()
        (n_dims,) = struct.unpack_from("<I", data, at)
        at += 4 + 8 * n_dims + 4
        (offset,) = struct.unpack_from("<Q", data, at)
        tensors.append((bytes(view[start:at]), offset))
        at += 8
    data_start = -(-at // alignment) * alignment
    ends = [o for _, o in tensors[1:]] + [len(data) - data_start]

    def kv(key: str, vtype: int, fmt: str, number: int) -> bytes:
        name = key.encode()
        return (
            struct.pack("<Q", len(name))
            + name
            + struct.pack("<I", vtype)
            + struct.pack(fmt, number)
        )

    out = []
    per = -(-len(tensors) // parts)
    for number in range(parts):
        run = range(number * per, min(len(tensors), (number + 1) * per))
        base = tensors[run.start][1]
        split = [kv("split.no", 2, "<H", number), kv("split.count", 2, "<H", parts),
                 kv("split.tensors.count", 5, "<i", len(tensors))]  # fmt: skip
        keys = [*metadata, *split] if number == 0 else split
        head = b"GGUF" + struct.pack("<IQQ", 3, len(run), len(keys)) + b"".join(keys)
        head += b"".join(tensors[i][0] + struct.pack("<Q", tensors[i][1] - base) for i in run)
        head += bytes(-(-len(head) // alignment) * alignment - len(head))
        out.append(head + bytes(view[data_start + base : data_start + ends[run.stop - 1]]))
    return out


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    license: str | None = "apache-2.0"
    gated_token: str | None = None  # set: only this token may read it
    revisions: tuple[str, ...] = ("main",)
    listed_sha256: dict[str, str] = field(default_factory=dict)  # a wrong digest to list


@dataclass
class Faults:
    cut_after: int | None = None  # bytes a storage answer sends before the connection drops
    cuts: int = 0  # how many answers are cut so
    stall_after: int | None = None  # bytes after which an answer hangs (a hub killed mid-pull)
    rate_limited: int = 0  # listing calls answered 429 first


@dataclass
class Seen:
    listing_auth: list[str | None] = field(default_factory=list)
    storage_auth: list[str | None] = field(default_factory=list)
    ranges: list[str | None] = field(default_factory=list)
    sent: int = 0  # bytes the storage host wrote


class StandIn:
    def __init__(self, repos: dict[str, Repo], folder: Path) -> None:
        self.repos = repos
        self.faults = Faults()
        self.seen = Seen()
        self.blobs: dict[str, Path] = {}
        # id(data): the bytes (held, so that no other object takes their id) and their sha256
        self.digests: dict[int, tuple[bytes, str]] = {}
        folder.mkdir(parents=True, exist_ok=True)
        for repo in repos.values():
            for data in repo.files.values():
                sha256 = self.digest(data)
                self.blobs[sha256] = folder / sha256
                self.blobs[sha256].write_bytes(data)
        self.hub_url = ""
        self.storage_url = ""

    async def start(self, aiohttp_server: AiohttpServer) -> StandIn:
        storage = web.Application()
        storage.router.add_get("/blobs/{sha256}", self._blob)
        storage_server = await aiohttp_server(storage)
        self.storage_url = str(storage_server.make_url("")).rstrip("/")
        hub = web.Application()
        hub.router.add_get("/api/models/{owner}/{repo}/revision/{revision}", self._listing)
        hub.router.add_get("/{owner}/{repo}/resolve/{revision}/{path:.+}", self._resolve)
        hub_server = await aiohttp_server(hub)
        self.hub_url = str(hub_server.make_url("")).rstrip("/")
        return self

    def digest(self, data: bytes) -> str:
        """The sha256 of a file's bytes, kept: the Hub answers from what it stored, and a
        stand-in hashing gigabytes per request would time itself, not the puller."""
        known = self.digests.get(id(data))
        if known is None:
            known = self.digests[id(data)] = (data, hashlib.sha256(data).hexdigest())
        return known[1]

    def _repo(self, request: web.Request) -> Repo:
        name = f"{request.match_info['owner']}/{request.match_info['repo']}"
        repo = self.repos.get(name)
        if repo is None:
            raise _error(401, "RepoNotFound", "Repository not found")
        token = request.headers.get("Authorization")
        if repo.gated_token is not None and token != f"Bearer {repo.gated_token}":
            raise _error(401, "GatedRepo", "Access to this model is restricted")
        revision = request.match_info["revision"]
        if revision not in {*repo.revisions, repo.commit}:
            raise _error(404, "RevisionNotFound", "Invalid rev id")
        return repo

    async def _listing(self, request: web.Request) -> web.Response:
        self.seen.listing_auth.append(request.headers.get("Authorization"))
        if self.faults.rate_limited:
            self.faults.rate_limited -= 1
            return web.json_response(
                {"error": "rate limited"}, status=429, headers={"Retry-After": "7"}
            )
        repo = self._repo(request)
        siblings: list[dict[str, Any]] = []
        for path, data in repo.files.items():
            sha256 = repo.listed_sha256.get(path) or self.digest(data)
            siblings.append(
                {"rfilename": path, "size": len(data), "lfs": {"sha256": sha256, "size": len(data)}}
            )
        siblings.append({"rfilename": "README.md", "size": 10})  # a file outside LFS
        body = {
            "id": f"{request.match_info['owner']}/{request.match_info['repo']}",
            "sha": repo.commit,
            "siblings": siblings,
            "gated": "manual" if repo.gated_token else False,
            "cardData": {"license": repo.license} if repo.license else {},
        }
        return web.json_response(body)

    async def _resolve(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        data = repo.files.get(request.match_info["path"])
        if data is None:
            raise _error(404, "EntryNotFound", "Entry not found")
        sha256 = self.digest(data)
        raise web.HTTPFound(
            f"{self.storage_url}/blobs/{sha256}",
            headers={"X-Repo-Commit": repo.commit, "X-Linked-Etag": f'"{sha256}"',
                     "X-Linked-Size": str(len(data))},
        )  # fmt: skip

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        self.seen.storage_auth.append(request.headers.get("Authorization"))
        self.seen.ranges.append(request.headers.get("Range"))
        sha256 = request.match_info["sha256"]
        path = self.blobs.get(sha256)
        if path is None:
            raise web.HTTPNotFound
        faults = self.faults
        if faults.stall_after is not None or (faults.cut_after is not None and faults.cuts):
            return await self._faulty(request, path.read_bytes(), sha256)
        with path.open("rb") as blob:
            return await send_blob(
                request, blob, sha256=sha256, media_type="application/octet-stream"
            )

    async def _faulty(self, request: web.Request, data: bytes, sha256: str) -> web.StreamResponse:
        """The file from the range asked, cut or stalled after the bytes the faults say."""
        start = 0
        if request.http_range.start is not None:
            start = request.http_range.start
        response = web.StreamResponse(status=206 if start else 200)
        response.etag = sha256
        response.content_length = len(data) - start
        if start:
            response.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        await response.prepare(request)
        limit = (
            self.faults.stall_after
            if self.faults.stall_after is not None
            else self.faults.cut_after
        )
        assert limit is not None
        await response.write(data[start : start + limit])
        self.seen.sent += min(limit, len(data) - start)
        if self.faults.stall_after is not None:
            await asyncio.sleep(3600)
        self.faults.cuts -= 1
        assert request.transport is not None
        request.transport.close()  # the connection drops mid-body
        return response


def _error(status: int, code: str, message: str) -> web.HTTPException:
    kind = {401: web.HTTPUnauthorized, 404: web.HTTPNotFound}[status]
    return kind(
        text=f'{{"error": "{message}"}}',
        content_type="application/json",
        headers={"X-Error-Code": code},
    )
