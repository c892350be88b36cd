"""send_blob on a real aiohttp server on loopback: the digest as ETag, conditional requests,
ranges, HEAD, and the bytes themselves."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from shared.blobs import IMMUTABLE, resolve_range, send_blob

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp.test_utils import TestClient
    from pytest_aiohttp.plugin import AiohttpClient

    Client = TestClient[web.Request, web.Application]

DATA = os.urandom(10_000)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
async def client(aiohttp_client: AiohttpClient, tmp_path: Path) -> Client:
    (tmp_path / SHA).write_bytes(DATA)
    (tmp_path / "empty").write_bytes(b"")

    async def serve(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        with (tmp_path / name).open("rb") as blob:
            sha = SHA if name == SHA else hashlib.sha256(b"").hexdigest()
            return await send_blob(
                request, blob, sha256=sha, media_type="audio/wav", cache_control=IMMUTABLE
            )

    app = web.Application()
    app.router.add_get("/{name}", serve)
    return await aiohttp_client(app)


async def test_a_whole_file_with_its_digest_as_strong_etag(client: Client) -> None:
    response = await client.get(f"/{SHA}")
    assert response.status == 200
    assert await response.read() == DATA
    assert response.headers["ETag"] == f'"{SHA}"'
    assert response.headers["Content-Length"] == str(len(DATA))
    assert response.headers["Content-Type"] == "audio/wav"
    assert response.headers["Accept-Ranges"] == "bytes"
    assert response.headers["Cache-Control"] == IMMUTABLE


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"If-None-Match": f'"{SHA}"'}, 304),
        ({"If-None-Match": f'W/"{SHA}"'}, 304),  # If-None-Match compares weakly
        ({"If-None-Match": "*"}, 304),
        ({"If-None-Match": f'"other", "{SHA}"'}, 304),
        ({"If-None-Match": '"other"'}, 200),
        ({"If-Match": f'"{SHA}"'}, 200),
        ({"If-Match": f'W/"{SHA}"'}, 412),  # If-Match compares strongly
        ({"If-Match": '"other"'}, 412),
    ],
)
async def test_conditional_requests(client: Client, headers: dict[str, str], status: int) -> None:
    response = await client.get(f"/{SHA}", headers=headers)
    assert response.status == status
    body = await response.read()
    assert body == (DATA if status == 200 else b"")
    assert response.headers["ETag"] == f'"{SHA}"'


@pytest.mark.parametrize(
    ("header", "start", "stop"),
    [
        ("bytes=0-0", 0, 1),
        ("bytes=10-99", 10, 100),
        ("bytes=9990-", 9990, 10_000),
        ("bytes=9990-20000", 9990, 10_000),  # an end past the file is the file's end
        ("bytes=-25", 9975, 10_000),
        ("bytes=-20000", 0, 10_000),  # a suffix longer than the file is all of it
    ],
)
async def test_ranges(client: Client, header: str, start: int, stop: int) -> None:
    response = await client.get(f"/{SHA}", headers={"Range": header})
    assert response.status == 206
    assert await response.read() == DATA[start:stop]
    assert response.headers["Content-Range"] == f"bytes {start}-{stop - 1}/{len(DATA)}"


@pytest.mark.parametrize("header", ["bytes=10000-", "bytes=20000-20010", "bytes=5-1", "lines=1-2"])
async def test_a_range_that_cannot_be_met_is_416(client: Client, header: str) -> None:
    response = await client.get(f"/{SHA}", headers={"Range": header})
    assert response.status == 416
    assert response.headers["Content-Range"] == f"bytes */{len(DATA)}"
    assert await response.read() == b""


async def test_if_range_honours_a_range_only_for_this_digest(client: Client) -> None:
    same = await client.get(f"/{SHA}", headers={"Range": "bytes=0-9", "If-Range": f'"{SHA}"'})
    assert (same.status, await same.read()) == (206, DATA[:10])
    other = await client.get(f"/{SHA}", headers={"Range": "bytes=0-9", "If-Range": '"other"'})
    assert (other.status, await other.read()) == (200, DATA)
    dated = await client.get(
        f"/{SHA}", headers={"Range": "bytes=0-9", "If-Range": "Wed, 21 Oct 2015 07:28:00 GMT"}
    )
    assert (dated.status, await dated.read()) == (200, DATA)


async def test_head_and_an_empty_file(client: Client) -> None:
    head = await client.head(f"/{SHA}")
    assert head.status == 200
    assert head.headers["Content-Length"] == str(len(DATA))
    assert await head.read() == b""
    empty = await client.get("/empty")
    assert (empty.status, await empty.read()) == (200, b"")
    suffix = await client.get("/empty", headers={"Range": "bytes=-5"})
    assert suffix.status == 416


RANGES = st.one_of(
    st.tuples(st.integers(0, 1200), st.integers(0, 1200)).map(  # bytes=a-b: a..b inclusive
        lambda ab: (min(ab), max(ab) + 1)
    ),
    st.tuples(st.integers(0, 1200), st.none()),  # bytes=a-
    st.tuples(st.integers(-1200, -1), st.none()),  # bytes=-n
)


@given(size=st.integers(0, 1000), asked=RANGES)
def test_resolve_agrees_with_python_slicing(size: int, asked: tuple[int, int | None]) -> None:
    """For every range aiohttp parses, the bytes sent are exactly Python's slice of the
    file, and a range is refused exactly when that slice is empty: never an empty 206."""
    data = (bytes(range(256)) * 4)[:size]
    start, stop = asked
    try:
        offset, count = resolve_range(start, stop, size)
    except ValueError:
        assert data[start:stop] == b""
        return
    assert count > 0
    assert data[offset : offset + count] == data[start:stop]
