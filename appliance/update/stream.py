"""A release bundle served to RAUC on loopback while RAUC streams it: each HTTP Range RAUC
asks for is fetched from the bundle's source (the hub, through the tunnel, with the node's
credentials and the site's proxy), and only those bytes.

RAUC (built with streaming, image/raucdeb.py) installs from a URL by reading the bundle
through a network block device: first its signature and manifest, then the blocks of the
image it cannot find in either root slot (the bundle's block-hash index, adaptive updates),
each checked against the bundle's hash tree as it arrives. The node's credentials, its
site's proxy and the hub's trust stay with the appliance: RAUC is given a loopback URL that
holds a one-time token, and this server is its only way out. It answers only that URL, only
with the bundle's bytes, and counts what it fetched (`fetched`): what a release cost the
site's link.

A RAUC without streaming given the same URL downloads the bundle whole first: the install
still works, and costs the whole bundle.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import hdrs, web

from shared.blobs import resolve_range

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    # (first byte, last byte or None for the end) -> the source's answer, 206 or 200
    Source = Callable[[int, int | None], Awaitable[aiohttp.ClientResponse]]

CHUNK = 1 << 16
HOST = "127.0.0.1"


class BundleStream:
    """The bundle of `sha256` and `size` on a loopback port while the context is open."""

    def __init__(self, source: Source, *, sha256: str, size: int) -> None:
        self._source = source
        self.sha256 = sha256
        self.size = size
        self._token = secrets.token_urlsafe(24)
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.fetched = 0  # bytes the source sent
        self.requests = 0  # ranges asked for
        self.error: str | None = None  # the source's last failure, for the install's error

    async def __aenter__(self) -> BundleStream:
        app = web.Application()
        app.router.add_get("/{token}/{name}", self._serve)  # HEAD too
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        self._runner = runner
        port = runner.addresses[0][1]  # the one the kernel picked
        self.url = f"http://{HOST}:{port}/{self._token}/{self.sha256}.raucb"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        wanted = f"{self.sha256}.raucb"
        if not secrets.compare_digest(request.match_info["token"], self._token) or (
            request.match_info["name"] != wanted
        ):
            raise web.HTTPNotFound
        ranged = request.headers.get(hdrs.RANGE) is not None
        start, count = self._range(request) if ranged else (0, self.size)
        response = web.StreamResponse(status=206 if ranged else 200)
        response.headers[hdrs.ACCEPT_RANGES] = "bytes"
        response.headers[hdrs.CONTENT_TYPE] = "application/octet-stream"
        if ranged:
            response.headers[hdrs.CONTENT_RANGE] = f"bytes {start}-{start + count - 1}/{self.size}"
        response.content_length = count
        if request.method == hdrs.METH_HEAD or count == 0:
            await response.prepare(request)
            return response
        self.requests += 1
        try:
            answer = await self._source(start, start + count - 1 if ranged else None)
        except Exception as err:  # noqa: BLE001 - the source's own errors: RAUC's read fails
            self.error = str(err)
            raise web.HTTPBadGateway(text=self.error) from None
        try:
            # the source must send the range asked: a 200 is the whole file from its start,
            # which is what was asked only when that is the range
            if answer.status != 206 and not (answer.status == 200 and start == 0):
                self.error = f"the source answered {answer.status} to bytes {start}-"
                raise web.HTTPBadGateway(text=self.error)
            await response.prepare(request)
            if not await self._relay(answer, response, start, count):
                # RAUC sees the answer cut short of its length, and fails that read (or it
                # is gone already)
                if request.transport is not None:
                    request.transport.close()
                return response
        finally:
            answer.release()
        await response.write_eof()
        return response

    def _range(self, request: web.Request) -> tuple[int, int]:
        try:
            asked = request.http_range
            return resolve_range(asked.start, asked.stop, self.size)
        except ValueError:
            raise web.HTTPRequestRangeNotSatisfiable(
                headers={hdrs.CONTENT_RANGE: f"bytes */{self.size}"}
            ) from None

    async def _relay(
        self,
        answer: aiohttp.ClientResponse,
        response: web.StreamResponse,
        start: int,
        count: int,
    ) -> bool:
        """`count` bytes of `answer` into `response`; whether they all went."""
        left = count
        try:
            async for chunk in answer.content.iter_chunked(CHUNK):
                part = chunk[:left]
                self.fetched += len(chunk)
                await response.write(part)
                left -= len(part)
                if left == 0:
                    return True
        except ConnectionError:  # RAUC went away: its install ended, or failed
            return False
        except (aiohttp.ClientError, TimeoutError) as err:
            self.error = f"the source failed within bytes {start}-: {err}"
            return False
        self.error = f"the source ended {left} bytes short of bytes {start}-"
        return False
