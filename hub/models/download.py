"""One file fetched over HTTPS into the hub's data directory, resumable and checked.

The bytes go to a part file beside the artifacts, hashed as they are written; a pull cut off
(a reset, a stall, a 5xx, the hub stopped) goes on from what the part holds, with `Range`
and `If-Range` (the ETag or Last-Modified the first answer gave, kept in a sidecar), so a
changed file is never spliced onto an old one. Redirects are followed here, not by the
client library: the token goes to the host it was given for and never to another (the Hub
sends large files to a storage host). Proxies come from `HTTPS_PROXY`/`NO_PROXY` (the
session trusts the environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import urljoin, urlsplit

import aiohttp

from hub.models.errors import PullError
from hub.models.huggingface import failure

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

MAX_REDIRECTS = 10
CHUNK = 1 << 20
RETRIES = 5  # cuts in a row, each resumed from where it stopped, before the pull fails
READ_STALL_S = 60.0
_RETRIED = {500, 502, 503, 504}


@dataclass(frozen=True)
class Wanted:
    url: str
    size: int | None  # what the source's listing says, when it says
    sha256: str | None
    token: str | None = None  # sent to `url`'s own host only


@dataclass(frozen=True)
class Bounds:
    max_bytes: int
    keep_free_bytes: int


class CutError(Exception):
    """The connection ended before the file did: resumed from what arrived."""


async def download(
    session: aiohttp.ClientSession,
    wanted: Wanted,
    part: Path,
    bounds: Bounds,
    *,
    progress: Callable[[int, int | None], None] = lambda done, total: None,
    backoff_s: float = 1.0,
) -> tuple[str, int]:
    """Fetch `wanted` into `part` (going on from what it holds); its sha256 and size.
    PullError when it cannot, or when its bytes are not the ones wanted (`part` deleted)."""
    if wanted.size is not None and wanted.size > bounds.max_bytes:
        raise PullError("too_large", _too_large(wanted.size, bounds.max_bytes))
    fetch = _Fetch(session, wanted, _Part(part), bounds, progress)
    await asyncio.to_thread(fetch.part.open)
    cuts = 0
    while True:
        try:
            await fetch.attempt()
            break
        except CutError as cut:
            cuts += 1
            if cuts > RETRIES:
                raise PullError(
                    "unavailable", f"the download was cut off {cuts} times in a row ({cut})"
                ) from cut
            await asyncio.sleep(backoff_s * cuts)
    await asyncio.to_thread(fetch.part.catch_up)
    sha256, size = fetch.part.digest.hexdigest(), fetch.part.size
    wrong = None
    if wanted.sha256 is not None and sha256 != wanted.sha256:
        wrong = f"its sha256 is {sha256}, not the {wanted.sha256} its source lists"
    elif wanted.size is not None and size != wanted.size:
        wrong = f"it has {size} bytes, not the {wanted.size} its source lists"
    if wrong is not None:
        await asyncio.to_thread(fetch.part.delete)
        raise PullError("checksum_mismatch", f"the file was deleted, not kept: {wrong}")
    await asyncio.to_thread(fetch.part.sidecar.unlink, missing_ok=True)
    return sha256, size


class _Part:
    """The part file, its sidecar (the validator a resume sends), and the sha256 of its
    bytes so far: hashed as they are written (one pass over gigabytes), what an earlier run
    of the pull left read and hashed first."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sidecar = path.with_name(path.name + ".json")
        self.validator: str | None = None
        self.reset()

    def reset(self) -> None:
        self.digest = hashlib.sha256()
        self.size = 0

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            value = json.loads(self.sidecar.read_text()).get("validator")
            if isinstance(value, str) and 0 < len(value) < 300:
                self.validator = value
        if self.validator is None:  # nothing a resume could be checked against
            self.path.unlink(missing_ok=True)

    def held(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def restart(self, validator: str | None) -> None:
        self.path.unlink(missing_ok=True)
        self.reset()
        self.keep(validator)

    def keep(self, validator: str | None) -> None:
        self.validator = validator
        self.sidecar.write_text(json.dumps({"validator": validator}))

    def catch_up(self) -> None:
        if not self.path.exists():
            self.reset()
            return
        with self.path.open("rb") as f:
            f.seek(self.size)
            while chunk := f.read(CHUNK):
                self.digest.update(chunk)
                self.size += len(chunk)

    def write(self, out: BinaryIO, chunk: bytes) -> None:
        out.write(chunk)
        self.digest.update(chunk)
        self.size += len(chunk)

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)
        self.sidecar.unlink(missing_ok=True)


@dataclass
class _Fetch:
    session: aiohttp.ClientSession
    wanted: Wanted
    part: _Part
    bounds: Bounds
    progress: Callable[[int, int | None], None]

    async def attempt(self) -> None:
        offset = await asyncio.to_thread(self.part.held)
        if self.wanted.size is not None and offset == self.wanted.size:
            return  # all there already: the digest says whether it is right
        ranged = bool(offset and self.part.validator)
        headers = {"Range": f"bytes={offset}-", "If-Range": self.part.validator} if ranged else {}
        response = await self._follow(headers)  # type: ignore[arg-type]
        try:
            start = await self._start(response, offset if ranged else 0)
            if start is not None:
                await self._read(response, start)
        finally:
            response.release()

    async def _start(self, response: aiohttp.ClientResponse, offset: int) -> int | None:
        """Where the answer's bytes go (None: nothing more to fetch), its bounds checked."""
        validator = response.headers.get("ETag") or response.headers.get("Last-Modified")
        if response.status == 416 and offset:
            if _total(response.headers.get("Content-Range", "")) == offset:
                return None
            await asyncio.to_thread(self.part.restart, None)
            raise CutError("the source refused the range asked for: starting again")
        if response.status == 200:  # whole: a first try, a changed file, or no ranges there
            offset = 0
        elif response.status == 206:
            start = response.headers.get("Content-Range", "").removeprefix("bytes ").split("-")[0]
            if start != str(offset):
                raise PullError("unavailable", "the source sent a range other than the one asked")
        elif response.status in _RETRIED:
            raise CutError(f"the source answered {response.status}")
        else:
            sent_token = "Authorization" in response.request_info.headers
            raise failure(response, str(response.url.with_query(None)), sent_token)
        length = response.content_length
        total = self.wanted.size or (offset + length if length is not None else None)
        if total is not None and total > self.bounds.max_bytes:
            raise PullError("too_large", _too_large(total, self.bounds.max_bytes))
        free = (await asyncio.to_thread(shutil.disk_usage, self.part.path.parent)).free
        needed = total - offset if total is not None else 0
        if free < needed + self.bounds.keep_free_bytes:
            raise PullError(
                "disk_full",
                f"{_mib(free)} free in the hub's data directory: the file needs {_mib(needed)} "
                f"more, and {_mib(self.bounds.keep_free_bytes)} are kept free "
                "(models.keep_free_bytes)",
            )
        if response.status == 200:
            await asyncio.to_thread(self.part.restart, validator)
        return offset

    async def _read(self, response: aiohttp.ClientResponse, offset: int) -> None:
        length = response.content_length
        total = self.wanted.size or (offset + length if length is not None else None)
        done = offset
        self.progress(done, total)
        await asyncio.to_thread(self.part.catch_up)  # what an earlier attempt left
        with self.part.path.open("ab") as out:
            try:
                while True:
                    async with asyncio.timeout(READ_STALL_S):
                        chunk = await response.content.read(CHUNK)
                    if not chunk:
                        break
                    done += len(chunk)
                    if done > self.bounds.max_bytes:
                        raise PullError("too_large", _too_large(done, self.bounds.max_bytes))
                    await asyncio.to_thread(self.part.write, out, chunk)
                    self.progress(done, total)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
                raise CutError(f"{type(e).__name__}: {e}") from e
        if length is not None and done - offset < length:
            raise CutError("the answer ended before its length")

    async def _follow(self, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """The answer at the end of the URL's redirects; the token only to its own host."""
        url = self.wanted.url
        home = urlsplit(url).netloc
        for _ in range(MAX_REDIRECTS + 1):
            sent = dict(headers)
            if self.wanted.token and urlsplit(url).netloc == home:
                sent["Authorization"] = f"Bearer {self.wanted.token}"
            try:
                response = await self.session.get(
                    url,
                    headers=sent,
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(sock_connect=15, sock_read=READ_STALL_S),
                )
            except aiohttp.ClientSSLError as err:  # no use trying again
                raise PullError(
                    "unavailable", f"TLS with {urlsplit(url).netloc} failed: {err}"
                ) from err
            except (aiohttp.ClientError, TimeoutError) as err:
                raise CutError(f"{urlsplit(url).netloc} cannot be reached: {err}") from err
            if response.status not in {301, 302, 303, 307, 308}:
                return response
            location = response.headers.get("Location")
            response.release()
            if not location:
                raise PullError("unavailable", f"a redirect without a Location from {url}")
            was = urlsplit(url).scheme
            url = urljoin(url, location)
            if urlsplit(url).scheme not in {was, "https"}:  # never down to plain http
                raise PullError("unavailable", f"a redirect from {was} to {url}")
        raise PullError(
            "unavailable", f"more than {MAX_REDIRECTS} redirects from {self.wanted.url}"
        )


def _total(content_range: str) -> int | None:
    total = content_range.rpartition("/")[2]
    return int(total) if total.isdigit() else None


def _too_large(size: int, bound: int) -> str:
    return (
        f"the file is {_mib(size)}, over the hub's bound of {_mib(bound)} (models.max_pull_bytes)"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n} bytes"
