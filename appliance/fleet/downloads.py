"""Fetching a file the hub gives this node (a model, a release bundle) through the tunnel
(`GET /v1/node/artifacts/SHA256`) into a partial file: a cut download resumes where it
stopped (HTTP Range, `If-Range` on the digest, so a resume never splices two files), the
file never grows past the size the hub named, and it is checked against its sha256 before
it is used; one that does not match is deleted."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, BinaryIO

from appliance.serving.catalog import sha256_file

if TYPE_CHECKING:
    from pathlib import Path

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


def _check(partial: Path, sha256: str, size: int) -> None:
    got = sha256_file(partial)
    if got != sha256 or partial.stat().st_size != size:
        partial.unlink(missing_ok=True)
        raise DownloadError(f"the fetched file's sha256 is {got}, not {sha256}: deleted")


async def fetch_checked(client: HubClient, sha256: str, size: int, partial: Path) -> None:
    """The file of `sha256` and `size` whole in `partial`, checked. HubError when the
    hub cannot be reached (what came is kept, to resume from)."""
    offset = await asyncio.to_thread(_resume_offset, partial, size)
    if offset < size:  # a whole file left by a stop before its check needs no fetch
        response = await client.artifact(sha256, offset)
        try:
            if response.status not in {200, 206}:
                raise DownloadError(f"the hub answered {response.status} for {sha256[:12]}")
            # 206 appends to what came before; 200: the hub sent it whole, from the start.
            written = offset if response.status == 206 else 0
            with open_for(partial, append=response.status == 206) as out:
                async for chunk in response.content.iter_chunked(CHUNK):
                    written += len(chunk)
                    if written > size:
                        out.truncate(0)  # checked below: deleted as not the file
                        raise DownloadError(f"the hub sent more than the {size} bytes it named")
                    out.write(chunk)
        finally:
            response.release()
    await asyncio.to_thread(_check, partial, sha256, size)


def open_for(partial: Path, *, append: bool) -> BinaryIO:
    return partial.open("ab" if append else "wb")
