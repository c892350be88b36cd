"""Serving a content-addressed file over HTTP: its sha256 is its strong ETag.

Both the appliance's package cache and the hub's model artifacts hold files named by their
own digest, which never change. ``send_blob`` answers GET and HEAD for such a file from an
already open descriptor, without a thread hop (aiohttp's FileResponse makes two a request,
and names its ETag after the modification time, which says less than the digest):

- ``If-None-Match`` with the digest (or ``*``) gets 304; ``If-Match`` without it gets 412;
- one ``Range`` (``bytes=a-b``, ``a-``, ``-n``) gets 206 with ``Content-Range``, honoured
  only when ``If-Range``, if sent, is the digest; a range that cannot be met gets 416 with
  ``Content-Range: bytes */size``, as does a malformed or multiple range;
- the body goes out with ``sendfile(2)`` on plain TCP, and through reads on TLS.

The caller owns the descriptor and closes it after.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, BinaryIO

from aiohttp import hdrs, web
from aiohttp.helpers import ETAG_ANY, ETag

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

IMMUTABLE = "private, max-age=31536000, immutable"
PACED_CHUNK = 64 << 10  # bytes sent between two waits of a paced answer
REVALIDATE = "private, no-cache"


async def send_blob(
    request: web.Request,
    blob: BinaryIO,
    *,
    sha256: str,
    media_type: str,
    cache_control: str = REVALIDATE,
    pace: Callable[[int], Awaitable[None]] | None = None,
) -> web.StreamResponse:
    """`blob` as the answer (Range, If-Match and If-None-Match honoured), sent by the
    kernel (sendfile); with `pace`, a chunk at a time, each after `pace(its size)`."""
    size = os.fstat(blob.fileno()).st_size
    response = web.StreamResponse(
        headers={
            hdrs.CONTENT_TYPE: media_type,
            hdrs.ACCEPT_RANGES: "bytes",
            hdrs.CACHE_CONTROL: cache_control,
        }
    )
    response.etag = sha256
    if (wanted := request.if_match) is not None and not _matches(sha256, wanted, weak=False):
        return await _empty(request, response, 412)
    if (fresh := request.if_none_match) is not None and _matches(sha256, fresh, weak=True):
        return await _empty(request, response, 304)
    start, count = 0, size
    if request.headers.get(hdrs.RANGE) is not None and _if_range_holds(request, sha256):
        try:
            asked = request.http_range
            start, count = resolve_range(asked.start, asked.stop, size)
        except ValueError:
            response.headers[hdrs.CONTENT_RANGE] = f"bytes */{size}"
            return await _empty(request, response, 416)
        response.set_status(206)
        response.headers[hdrs.CONTENT_RANGE] = f"bytes {start}-{start + count - 1}/{size}"
    response.content_length = count
    await response.prepare(request)
    if count and request.method != hdrs.METH_HEAD:
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        loop = asyncio.get_running_loop()
        if pace is None:
            await loop.sendfile(transport, blob, start, count)
        else:
            end = start + count
            for offset in range(start, end, PACED_CHUNK):
                size_now = min(PACED_CHUNK, end - offset)
                await pace(size_now)
                await loop.sendfile(transport, blob, offset, size_now)
    await response.write_eof()
    return response


def satisfiable(request: web.Request, size: int) -> bool:
    """Whether the request's Range, if it sends one, can be met from ``size`` bytes (what
    ``send_blob`` answers 206 to, not 416)."""
    if request.headers.get(hdrs.RANGE) is None:
        return True
    try:
        asked = request.http_range
        resolve_range(asked.start, asked.stop, size)
    except ValueError:
        return False
    return True


def _matches(sha256: str, etags: tuple[ETag, ...], *, weak: bool) -> bool:
    return any(t.value in (sha256, ETAG_ANY) and (weak or not t.is_weak) for t in etags)


def _if_range_holds(request: web.Request, sha256: str) -> bool:
    """RFC 9110 §13.1.5: a Range is honoured only if If-Range, when sent, names this
    representation by a strong ETag; a date cannot (no Last-Modified is sent)."""
    condition = request.headers.get(hdrs.IF_RANGE)
    return condition is None or condition.strip() == f'"{sha256}"'


def resolve_range(start: int | None, stop: int | None, size: int) -> tuple[int, int]:
    """(offset, count) of an aiohttp range slice in a file of ``size`` bytes; ValueError
    when it cannot be met."""
    if start is None and stop is None:
        return 0, size
    if start is not None and start < 0:  # bytes=-n: the last n
        offset = max(0, size + start)
        if size == 0:
            raise ValueError("an empty file has no last bytes")
        return offset, size - offset
    offset = start or 0
    end = size if stop is None else min(stop, size)
    if offset >= size or end <= offset:
        raise ValueError(f"range starts at {offset} of {size} bytes")
    return offset, end - offset


async def _empty(
    request: web.Request, response: web.StreamResponse, status: int
) -> web.StreamResponse:
    response.set_status(status)
    if status != 304:
        response.content_length = 0
    await response.prepare(request)
    await response.write_eof()
    return response
