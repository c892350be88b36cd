"""Fetching a file the hub gives this node (a model, a release bundle) through the tunnel
(`GET /v1/node/artifacts/SHA256`) into a partial file: a cut download resumes where it
stopped (HTTP Range, `If-Range` on the digest, so a resume never splices two files), the
file never grows past the size the hub named, and it is checked against its sha256 before
it is used; one that does not match is deleted."""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    import aiohttp

    from appliance.fleet.client import HubClient

CHUNK = 1 << 20


class DownloadError(Exception):
    """The hub refused the file, sent more than it said, or one whose sha256 is not the
    one it named (the partial file is then deleted)."""


def _resume_offset(partial: Path, size: int) -> int:
    """Where a fetch of `size` bytes into `partial` resumes (a partial file longer than
    the file is dropped)."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    offset = partial.stat().st_size if partial.exists() else 0
    if offset > size:
        partial.unlink()
        return 0
    return offset


async def fetch_checked(client: HubClient, sha256: str, size: int, partial: Path) -> None:
    """The file of `sha256` and `size` whole in `partial`, checked. HubError when the
    hub cannot be reached (what came is kept, to resume from)."""
    await fetch_checked_from(lambda offset: client.artifact(sha256, offset), sha256, size, partial)


async def fetch_checked_from(
    source: Callable[[int], Awaitable[aiohttp.ClientResponse]],
    sha256: str,
    size: int,
    partial: Path,
    what: str = "the hub",
) -> None:
    """`fetch_checked` from `source` (the answer to a fetch from an offset): the hub, or
    a peer of the node's site (`what` names it in errors). The checks are the same: a
    peer's word counts for nothing but the bytes, checked against the digest."""
    offset = await asyncio.to_thread(_resume_offset, partial, size)
    # Hashed as it arrives, not read again after: on a node with a slow disk or CPU a
    # release bundle (600 MiB) read twice was a third of its fetch. A resumed fetch hashes
    # what came before first.
    digest = await asyncio.to_thread(_hash_prefix, partial, offset)
    written = offset
    if offset < size:  # a whole file left by a stop before its check needs no fetch
        response = await source(offset)
        try:
            if response.status not in {200, 206}:
                raise DownloadError(f"{what} answered {response.status} for {sha256[:12]}")
            # 206 appends to what came before; 200: the hub sent it whole, from the start.
            if response.status == 200:
                written, digest = 0, hashlib.sha256()
            with open_for(partial, append=response.status == 206) as out:
                async for chunk in response.content.iter_chunked(CHUNK):
                    written += len(chunk)
                    if written > size:
                        out.truncate(0)  # checked below: deleted as not the file
                        raise DownloadError(f"{what} sent more than the {size} bytes named")
                    out.write(chunk)
                    digest.update(chunk)
        finally:
            response.release()
    if digest.hexdigest() != sha256 or written != size:
        await asyncio.to_thread(partial.unlink, missing_ok=True)
        raise DownloadError(
            f"the fetched file's sha256 is {digest.hexdigest()}, not {sha256}: deleted"
        )


def _hash_prefix(partial: Path, length: int) -> hashlib._Hash:
    digest = hashlib.sha256()
    if length:
        with partial.open("rb") as src:
            while block := src.read(min(CHUNK, length)):
                digest.update(block)
                length -= len(block)
    return digest


def open_for(partial: Path, *, append: bool) -> BinaryIO:
    return partial.open("ab" if append else "wb")
