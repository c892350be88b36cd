"""The loopback server RAUC streams a release bundle from (appliance/update/stream.py): a real
aiohttp server standing for the hub (shared.blobs, as the hub serves artifacts, Range and
all), the stream in front of it, and an aiohttp client asking what RAUC's libcurl asks:
"bytes=0-3" first (the squashfs magic, and whether ranges work), then ranges of the bundle;
a downloader without streaming asks for the whole file. Only the bytes asked for are
fetched; a source that fails fails the read, never the server."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

import aiohttp
import pytest
from aiohttp import web

from appliance.update.stream import BundleStream
from shared.blobs import IMMUTABLE, send_blob

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

DATA = os.urandom(300_000)
SHA = hashlib.sha256(DATA).hexdigest()


class Origin:
    """The hub's side: the blob by Range, each range it served noted; `mode` breaks it."""

    def __init__(self) -> None:
        self.served: list[str | None] = []
        self.mode = "whole"  # or: "refuse", "cut", "fewer", "ignore-range"
        self.url = ""

    async def serve(self, request: web.Request) -> web.StreamResponse:
        self.served.append(request.headers.get("Range"))
        if self.mode == "refuse":
            raise web.HTTPNotFound
        if self.mode == "ignore-range":
            return web.Response(body=DATA)
        if self.mode == "fewer":  # a whole answer, of less than was asked
            return web.Response(status=206, body=DATA[:10])
        if self.mode == "cut":
            response = web.StreamResponse(status=206)
            response.content_length = 1000
            await response.prepare(request)
            await response.write(DATA[:10])
            request.transport.close()  # type: ignore[union-attr]
            return response
        with (self.path).open("rb") as blob:
            return await send_blob(
                request, blob, sha256=SHA, media_type="application/octet-stream",
                cache_control=IMMUTABLE,
            )  # fmt: skip

    path: Path


@pytest.fixture
async def stream(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> AsyncIterator[tuple[BundleStream, Origin]]:
    origin = Origin()
    origin.path = tmp_path / SHA
    origin.path.write_bytes(DATA)
    app = web.Application()
    app.router.add_get("/{sha}", origin.serve)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:

        async def source(start: int, end: int | None) -> aiohttp.ClientResponse:
            headers = {"Range": f"bytes={start}-{'' if end is None else end}"}
            if start == 0 and end is None:
                headers = {}
            return await session.get(server.make_url(f"/{SHA}"), headers=headers)

        async with BundleStream(source, sha256=SHA, size=len(DATA)) as bundle:
            yield bundle, origin


async def _get(
    url: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as answer:
        try:
            body = await answer.read()
        except aiohttp.ClientPayloadError:
            body = b"<cut>"
        return answer.status, dict(answer.headers), body


async def test_ranges_are_fetched_as_asked_and_only_those(
    stream: tuple[BundleStream, Origin],
) -> None:
    bundle, origin = stream
    assert bundle.url.startswith("http://127.0.0.1:")
    assert bundle.url.endswith(f"/{SHA}.raucb")
    status, headers, body = await _get(bundle.url, {"Range": "bytes=0-3"})
    assert (status, body) == (206, DATA[:4])
    assert headers["Content-Range"] == f"bytes 0-3/{len(DATA)}"
    status, headers, body = await _get(bundle.url, {"Range": "bytes=100000-165535"})
    assert (status, body) == (206, DATA[100_000:165_536])
    # the last bytes (RAUC reads the signature at the end first)
    status, headers, body = await _get(bundle.url, {"Range": "bytes=-100"})
    assert (status, body) == (206, DATA[-100:])
    assert headers["Content-Range"] == f"bytes {len(DATA) - 100}-{len(DATA) - 1}/{len(DATA)}"
    assert origin.served == [
        "bytes=0-3", "bytes=100000-165535", f"bytes={len(DATA) - 100}-{len(DATA) - 1}"
    ]  # fmt: skip
    assert bundle.fetched == 4 + 65_536 + 100
    assert bundle.requests == 3
    assert bundle.error is None


async def test_a_downloader_without_streaming_gets_it_whole(
    stream: tuple[BundleStream, Origin],
) -> None:
    bundle, origin = stream
    status, headers, body = await _get(bundle.url)
    assert (status, body) == (200, DATA)
    assert headers["Accept-Ranges"] == "bytes"
    assert origin.served == [None]
    assert bundle.fetched == len(DATA)
    async with aiohttp.ClientSession() as session, session.head(bundle.url) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Length"] == str(len(DATA))
    assert origin.served == [None]  # a HEAD fetches nothing


@pytest.mark.parametrize(
    "path",
    ["/wrong-token/{sha}.raucb", "/{token}/{other}.raucb", "/{token}/{sha}", "/"],
)
async def test_only_its_own_url_answers(stream: tuple[BundleStream, Origin], path: str) -> None:
    bundle, origin = stream
    token = bundle.url.split("/")[3]
    base = bundle.url.split("/" + token)[0]
    url = base + path.format(token=token, sha=SHA, other="0" * 64)
    status, _, _ = await _get(url)
    assert status == 404
    assert origin.served == []


async def test_a_range_past_the_bundle_is_416(stream: tuple[BundleStream, Origin]) -> None:
    bundle, origin = stream
    status, headers, _ = await _get(bundle.url, {"Range": f"bytes={len(DATA)}-"})
    assert status == 416
    assert headers["Content-Range"] == f"bytes */{len(DATA)}"
    status, _, _ = await _get(bundle.url, {"Range": "bytes=oops"})
    assert status == 416
    assert origin.served == []


@pytest.mark.parametrize(
    ("mode", "status", "error"),
    [
        ("refuse", 502, "answered 404"),
        ("ignore-range", 502, "answered 200"),
        ("cut", 206, "failed within bytes 10-"),
        ("fewer", 206, "bytes short"),
    ],
)
async def test_a_failing_source_fails_the_read_and_says_why(
    stream: tuple[BundleStream, Origin], mode: str, status: int, error: str
) -> None:
    bundle, origin = stream
    origin.mode = mode
    got, _, body = await _get(bundle.url, {"Range": "bytes=10-2000"})
    assert got == status
    assert body != DATA[10:2001]
    assert bundle.error is not None
    assert error in bundle.error
    # the server goes on: the next read, from a mended source, is whole
    origin.mode = "whole"
    got, _, body = await _get(bundle.url, {"Range": "bytes=10-2000"})
    assert (got, body) == (206, DATA[10:2001])
