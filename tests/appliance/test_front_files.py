"""Package files sent by the TLS front's nginx itself (appliance/gateway/front.py): a real
`kvl appliance serve` with TLS and HTTP/2 (nginx in front), real clients on loopback.

The app still decides: each answer is compared with the app's own (asked on its private
socket, as nginx asks it), every refusal is the app's, in the error shape, and a decision
nginx kept is used within its second only.
"""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest

from appliance.gateway.front import DECIDE, nginx_binary
from appliance.packages.cache import PackageCache, blob_dir
from appliance.state.store import Store
from tests.appliance.front_processes import HOST, Appliance, start, stop
from tests.packages import package
from tests.rawhttp import dechunk
from tests.waiting import until_sync

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.skipif(
    nginx_binary() is None, reason="nginx is not installed: `just setup-system`"
)

WAV = bytes(range(256)) * 800  # 200 KiB: sent with sendfile, ranges within it
POLL_S = 5.0  # a decision nginx keeps lasts less than 2 s: refused well before this


@dataclass
class Seeded:
    appliance: Appliance
    mine: str  # a package of the key's account
    theirs: str  # another account's
    version: str
    other_key: str  # the other account's key, revoked by one test
    socket: Path  # the app's private socket (nginx's upstream)
    data: Path

    @property
    def blobs(self) -> Path:
        return blob_dir(self.data / "packages")

    def url(self, package_id: str, path: str) -> str:
        return f"/v1/packages/{package_id}/files/{path}"


def _seed(data: Path, into: dict[str, str]) -> None:
    mine, mine_files = package(
        1,
        files={
            "items.json": b'{"items": []}',
            "audio/intro.wav": WAV,
            "broken.bin": b"intact " * 1000,  # damaged by one test
        },
    )
    theirs, theirs_files = package(2, files={"items.json": b'{"theirs": true}'})
    cache = PackageCache(data / "packages", max_bytes=64 << 20)
    cache.put(mine, mine_files, "key-1")
    cache.put(theirs, theirs_files, "key-2")
    store = Store(data / "appliance.db")
    try:
        other = store.create_key("other").plaintext
        accounts = {a.name: a.id for a in store.list_accounts()}
        store.add_package_owner(mine.id, mine.version, accounts["h2"])
        store.add_package_owner(theirs.id, theirs.version, accounts["other"])
    finally:
        store.close()
    into.update(mine=mine.id, theirs=theirs.id, version=mine.version, other_key=other)


def _app_socket(appliance: Appliance) -> Path:
    """The app's private socket: in the folder nginx was started in (`-p <folder>/`)."""
    (master,) = [p for p in psutil.Process(appliance.process.pid).children() if p.name() == "nginx"]
    args = master.cmdline()
    return Path(args[args.index("-p") + 1]) / "app.sock"


def _start_seeded(names: dict[str, str]) -> tuple[Path, Appliance]:
    # Not pytest's folder, which is root's alone: the appliance opens nothing above its
    # data directory to nginx's workers (nobody). The data directory is private (made
    # under umask 077, as a hardened service's): the appliance lets them through it.
    folder = Path(tempfile.mkdtemp(prefix="kvl-front-files-"))
    folder.chmod(0o711)
    umask = os.umask(0o077)
    try:
        return folder, start(folder, seed=lambda data: _seed(data, names))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        os.umask(umask)


@pytest.fixture(scope="module")
def seeded() -> Iterator[Seeded]:
    names: dict[str, str] = {}
    folder, appliance = _start_seeded(names)
    try:
        yield Seeded(
            appliance,
            names["mine"],
            names["theirs"],
            names["version"],
            names["other_key"],
            _app_socket(appliance),
            folder / "data",
        )
    finally:
        stop(appliance)
        shutil.rmtree(folder, ignore_errors=True)


def _direct(seeded: Seeded, key: str | None = None) -> httpx.Client:
    """The app itself, on its private socket, as nginx asks it."""
    return httpx.Client(
        base_url="http://appliance",
        transport=httpx.HTTPTransport(uds=str(seeded.socket)),
        headers={"Authorization": f"Bearer {key or seeded.appliance.key}"},
        timeout=30,
    )


def _answered(client: httpx.Client, route: str) -> float:
    """How many requests of ``route`` the app has answered (its request metrics)."""
    text = client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvl_http_requests_total{") and f'route="{route}"' in line
    )


FILES = "/v1/packages/{id}/files/{path}"  # the app's route: it sent the file itself
DECISIONS = f"{DECIDE}{FILES}"  # nginx asked the app
SAME = ("etag", "content-type", "cache-control", "content-length")


def _by_app(client: httpx.Client, url: str, headers: dict[str, str] | None = None) -> bool:
    """Whether the app answered GET ``url`` itself (else nginx sent the file), asserting
    the one or the other."""
    before = _answered(client, FILES)
    client.get(url, headers=headers)
    made = _answered(client, FILES) - before
    assert made in (0, 1)
    return made == 1


@pytest.mark.parametrize("query", ["", "?version={version}"])
@pytest.mark.parametrize("path", ["items.json", "audio/intro.wav"])
def test_nginx_sends_the_bytes_and_headers_the_app_would(
    seeded: Seeded, path: str, query: str
) -> None:
    url = seeded.url(seeded.mine, path) + query.format(version=seeded.version)
    with seeded.appliance.client() as client, _direct(seeded) as app:
        before = _answered(client, FILES)
        sent = client.get(url)
        head = client.head(url)
        assert _answered(client, FILES) == before  # nginx sent both, not the app
        own = app.get(url)
    assert own.status_code == 200
    assert sent.status_code == 200
    assert sent.http_version == "HTTP/2"
    assert sent.content == own.content
    assert {h: sent.headers.get(h) for h in SAME} == {h: own.headers.get(h) for h in SAME}
    assert ("immutable" in sent.headers["cache-control"]) == bool(query)
    assert "last-modified" not in sent.headers
    assert sent.headers["accept-ranges"] == own.headers["accept-ranges"] == "bytes"
    assert head.status_code == 200
    assert head.content == b""
    assert {h: head.headers.get(h) for h in SAME} == {h: own.headers.get(h) for h in SAME}


def test_a_range_is_sent_by_nginx_as_the_app_would(seeded: Seeded) -> None:
    url = seeded.url(seeded.mine, "audio/intro.wav")
    with seeded.appliance.client() as client, _direct(seeded) as app:
        for asked in ("bytes=10-99", "bytes=1000-", "bytes=-300", "bytes=0-999999999"):
            before = _answered(client, FILES)
            sent = client.get(url, headers={"Range": asked})
            assert _answered(client, FILES) == before, asked  # nginx sent it
            own = app.get(url, headers={"Range": asked})
            assert own.status_code == 206, asked
            assert sent.status_code == 206, asked
            assert sent.content == own.content, asked
            assert sent.headers["content-range"] == own.headers["content-range"], asked
        # A range that cannot be met, or several, or another unit, is the app's to answer.
        for asked in ("bytes=999999-", "bytes=0-1,5-9", "bytes=-0", "lines=1-2"):
            before = _answered(client, FILES)
            sent = client.get(url, headers={"Range": asked})
            assert _answered(client, FILES) == before + 1, asked
            own = app.get(url, headers={"Range": asked})
            assert sent.status_code == own.status_code, asked
            assert sent.content == own.content, asked
            assert sent.headers.get("content-range") == own.headers.get("content-range")


def test_conditions_are_answered_by_the_app(seeded: Seeded) -> None:
    url = seeded.url(seeded.mine, "items.json")
    with seeded.appliance.client() as client:
        etag = client.get(url).headers["etag"]  # nginx's, the decision kept
        before = _answered(client, FILES)
        fresh = client.get(url, headers={"If-None-Match": etag})
        stale = client.get(url, headers={"If-None-Match": '"0000"'})
        moved = client.get(url, headers={"If-Range": '"0000"', "Range": "bytes=0-3"})
        assert _answered(client, FILES) == before + 3
        assert not _by_app(client, url)  # the decision nginx keeps is still used
    assert fresh.status_code == 304
    assert fresh.headers["etag"] == etag
    assert stale.status_code == 200
    assert stale.content == b'{"items": []}'
    assert moved.status_code == 200  # If-Range names another version: the whole file
    assert moved.content == b'{"items": []}'


def test_refusals_are_the_apps_in_the_error_shape(seeded: Seeded) -> None:
    with seeded.appliance.client() as client:
        theirs = client.get(seeded.url(seeded.theirs, "items.json"))
        absent = client.get(seeded.url(seeded.mine, "absent.json"))
        old = client.get(seeded.url(seeded.mine, "items.json") + "?version=0")
        posted = client.post(seeded.url(seeded.mine, "items.json"))
        bad_key = client.get(
            seeded.url(seeded.mine, "items.json"), headers={"Authorization": "Bearer kvl_wrong"}
        )
        # Hostile names reach the app as sent, and nginx serves no file for them.
        hostile = [
            client.get(f"/v1/packages/{seeded.mine}/files/{name}")
            for name in ("..%2F..%2Fappliance.db", "../../index.json", "%2e%2e/oci-layout")
        ]
        long = client.get(seeded.url(seeded.mine, "a" * 6000))
    assert theirs.status_code == 404
    assert theirs.json()["error"]["code"] == "package_not_found"  # not forbidden
    assert absent.status_code == 404
    assert absent.json()["error"]["code"] == "package_not_found"
    assert old.status_code == 404
    assert old.json()["error"]["code"] == "package_not_found"
    assert posted.status_code == 405
    assert posted.json()["error"]["code"]
    assert bad_key.status_code == 401
    assert bad_key.json()["error"]["code"] == "invalid_api_key"
    for response in [*hostile, long]:
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["code"], response.text
        assert b"SQLite" not in response.content


def test_the_decision_route_answers_nginx_only(seeded: Seeded) -> None:
    url = DECIDE + seeded.url(seeded.mine, "items.json")
    with seeded.appliance.client() as client, _direct(seeded) as app:
        outside = client.get(url)
        forged = app.get(url, headers={"X-Kvl-Front": "guessed"})
    for response in (outside, forged):
        assert response.status_code == 404
        assert response.json()["error"]["code"]
        assert "x-kvl-blob" not in response.headers


def test_a_repeated_download_within_the_second_does_not_reach_the_app(seeded: Seeded) -> None:
    # A URI no other test asks for (the app ignores `again`): no decision is kept for it.
    url = seeded.url(seeded.mine, "audio/intro.wav") + f"?version={seeded.version}&again=1"
    with seeded.appliance.client() as client:
        before = _answered(client, DECISIONS)
        started = time.monotonic()
        for _ in range(5):
            response = client.get(url)
            assert response.status_code == 200
            assert response.content == WAV
        elapsed = time.monotonic() - started
        made = _answered(client, DECISIONS) - before
    # One decision for the five, when they took less than its second (a slow machine may
    # take two); never one each.
    assert made == 1 if elapsed < 0.9 else made <= 3, (made, elapsed)


def test_a_revoked_key_is_refused_once_the_decision_expired(seeded: Seeded) -> None:
    url = seeded.url(seeded.theirs, "items.json")
    with seeded.appliance.client() as client:
        headers = {"Authorization": f"Bearer {seeded.other_key}"}
        assert client.get(url, headers=headers).status_code == 200  # decided, kept
        _revoke(seeded)
        revoked = time.monotonic()
        while (response := client.get(url, headers=headers)).status_code == 200:
            assert time.monotonic() - revoked < POLL_S, "the revoked key still downloads"
            time.sleep(0.05)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "revoked_api_key"
    assert time.monotonic() - revoked < 3  # nginx kept the decision under 2 s


def _revoke(seeded: Seeded) -> None:
    store = Store(seeded.data / "appliance.db")
    try:
        (prefix,) = [k.prefix for k in store.list_keys() if k.account.name == "other"]
        store.revoke_key(prefix)
    finally:
        store.close()


def test_a_corrupt_blob_is_refused_once_the_decision_expired(seeded: Seeded) -> None:
    url = seeded.url(seeded.mine, "broken.bin")
    with seeded.appliance.client() as client:
        before = _answered(client, FILES)
        good = client.get(url)
        assert good.status_code == 200
        assert _answered(client, FILES) == before  # nginx sent it, and keeps the decision
        blob = seeded.blobs / good.headers["etag"].strip('"')
        blob.write_bytes(b"broken " * 1000)  # as long, other bytes, a new mtime
        damaged = time.monotonic()
        while (response := client.get(url)).status_code == 200:
            assert time.monotonic() - damaged < POLL_S, "the corrupt blob is still sent"
            time.sleep(0.05)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "package_corrupt"


@pytest.mark.skipif(os.geteuid() != 0, reason="nginx's workers are nobody only under root")
def test_nobody_reads_the_blobs_sent_and_nothing_else(seeded: Seeded) -> None:
    url = seeded.url(seeded.mine, "items.json")
    with seeded.appliance.client() as client:
        etag = client.get(url).headers["etag"].strip('"')
    workers = [
        p
        for master in psutil.Process(seeded.appliance.process.pid).children()
        if master.name() == "nginx"
        for p in master.children()
    ]
    assert workers
    assert {w.username() for w in workers} == {"nobody"}
    data = seeded.data
    assert re.fullmatch("[0-9a-f]{64}", etag)
    blob = seeded.blobs / etag
    assert blob.stat().st_mode & 0o777 == 0o640

    def nobody_reads(path: Path) -> bool:
        return (
            subprocess.run(
                ["runuser", "-u", "nobody", "--", "cat", str(path)],
                capture_output=True,
                check=False,
            ).returncode
            == 0
        )

    assert nobody_reads(blob)
    for private in (data / "appliance.db", data / "packages" / "index.json"):
        assert private.exists()
        assert not nobody_reads(private), private
    # The folders down to the blobs: nogroup goes through them, and lists none.
    nogroup = grp.getgrnam("nogroup").gr_gid
    for folder in (data, data / "packages", seeded.blobs):
        assert folder.stat().st_gid == nogroup, folder
        assert folder.stat().st_mode & 0o777 == 0o710, folder
    listing = subprocess.run(
        ["runuser", "-u", "nobody", "--", "ls", str(seeded.blobs)], capture_output=True, check=False
    )
    assert listing.returncode != 0


def test_a_failed_key_is_counted_once_and_a_throttled_address_refused() -> None:
    """Three failures a minute are allowed (test_http2's start): the decision does not
    count them, the app's answer does, once; then the address waits, whatever key it
    sends. (An appliance of its own: loopback is throttled after this.)"""
    names: dict[str, str] = {}
    folder, appliance = _start_seeded(names)
    url = f"/v1/packages/{names['mine']}/files/items.json"
    try:
        with appliance.client() as client:
            wrong = {"Authorization": "Bearer kvl_wrong"}
            codes = [client.get(url, headers=wrong).json()["error"]["code"] for _ in range(4)]
            throttled = client.get(url)  # the valid key, asked for the first time
    finally:
        stop(appliance)
        shutil.rmtree(folder, ignore_errors=True)
    assert codes == ["invalid_api_key"] * 3 + ["too_many_auth_failures"], codes
    assert throttled.status_code == 429
    assert throttled.json()["error"]["code"] == "too_many_auth_failures"


@pytest.mark.skipif(os.geteuid() != 0, reason="nginx's workers are nobody only under root")
def test_a_private_data_directory_is_not_opened_files_go_through_the_app(
    tmp_path: Path,
) -> None:
    """A data directory in a folder root's alone: nginx's workers cannot reach the blobs,
    and the appliance does not open it to them; the app sends the files itself."""
    tmp_path.chmod(0o700)
    names: dict[str, str] = {}
    appliance = start(tmp_path, seed=lambda data: _seed(data, names))
    try:
        with appliance.client() as client:
            url = f"/v1/packages/{names['mine']}/files/items.json"
            assert _by_app(client, url)
            response = client.get(url)
    finally:
        stop(appliance)
    assert response.status_code == 200
    assert response.content == b'{"items": []}'
    assert tmp_path.stat().st_mode & 0o777 == 0o700  # left as it was
    assert tmp_path.stat().st_gid == 0
    assert "package files go through the app" in appliance.log.read_text()


# -- paths no route takes, and the decisions' cache ------------------------------------------

# Paths a client may send for a package file: braces (no route of the app takes them: its
# decision route answered nginx 404, which auth_request made a 500), encoded slashes,
# spaces, Unicode, bytes that are no UTF-8, dot segments, a NUL. Sent as they are written
# (on a socket of HTTP/1.1: a client library would encode or normalise some), and over
# HTTP/2 by httpx.
ODD_NAMES = [
    "%7Bx%7D", "{x}", "a%7B%7Db", "%7B", "%7D", "a%2Fb", "%2F", "..%2F..%2Fappliance.db",
    "a%20b", "a b", "%C3%A9t%C3%A9.json", "%F0%9F%98%80", "\u00e9t\u00e9.json", "%FF%FE",
    "../../index.json", "%2e%2e/%2e%2e/oci-layout", "./items.json", "items.json/..", "%00",
    "items.json%00", "a%5C..%5Cb", "items.json?version=%7B%7D", "items.json?version=%FF",
]  # fmt: skip
ODD_IDS = ["%7Bid%7D", "{id}", "a%2Fb", "%20", "..", "%C3%A9"]


def _raw_get(seeded: Seeded, target: str) -> tuple[int, bytes, bytes]:
    """GET ``target`` exactly as written, over HTTP/1.1: (status, head, body)."""
    appliance = seeded.appliance
    request = (
        f"GET {target} HTTP/1.1\r\nHost: appliance\r\nAuthorization: Bearer {appliance.key}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with (
        socket.create_connection((HOST, appliance.port), timeout=30) as raw,
        appliance.context(["http/1.1"]).wrap_socket(raw, server_hostname=HOST) as tls,
    ):
        tls.sendall(request)
        data = b""
        while chunk := tls.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    return int(head.split(b" ", 2)[1]), head, body


def _refusal_problems(status: int, body: bytes) -> list[str]:
    """Why an answer to an odd path is not one the app could give (none: it is)."""
    if status >= 500:
        return [f"{status}: {body[:300]!r}"]
    if status < 400:
        return []
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return [f"{status}, not the error shape: {body[:300]!r}"]
    return [] if error.get("code") else [f"{status}, no code: {body[:300]!r}"]


def test_odd_paths_are_the_apps_answer_never_a_5xx(seeded: Seeded) -> None:
    targets = [seeded.url(seeded.mine, name) for name in ODD_NAMES]
    targets += [f"/v1/packages/{name}/files/items.json" for name in ODD_IDS]
    problems: dict[str, list[str]] = {}
    with seeded.appliance.client() as client:
        for target in targets:
            status, _, body = _raw_get(seeded, target)
            found = _refusal_problems(status, body)
            sent = client.get(target)  # HTTP/2; httpx encodes braces, spaces and Unicode
            found += _refusal_problems(sent.status_code, sent.content)
            if found:
                problems[target] = found
        braces = client.get(seeded.url(seeded.mine, "%7Bx%7D"))
        good = client.get(seeded.url(seeded.mine, "items.json"))
    assert not problems, problems
    # No file by that name: the app's 404, in the error shape.
    assert braces.status_code == 404, braces.text
    assert braces.json()["error"]["code"] in ("not_found", "package_not_found")
    assert good.status_code == 200  # and the front still sends the files it may


def _cache_folder(seeded: Seeded) -> Path:
    """Where nginx keeps the decisions: its configuration says."""
    config = (_app_socket(seeded.appliance).parent / "nginx.conf").read_text()
    found = re.search(r"proxy_cache_path (\S+)", config)
    assert found is not None, config
    return Path(found.group(1))


def test_the_decisions_cache_holds_no_key(seeded: Seeded) -> None:
    key = seeded.appliance.key
    secret = key.rsplit("_", 1)[1]
    folder = _cache_folder(seeded)
    with seeded.appliance.client() as client:
        for path in ("items.json", "audio/intro.wav"):
            # URIs of this test's own: each a decision nginx keeps, a file in the cache.
            url = seeded.url(seeded.mine, path) + "?kept=no-key"
            assert client.get(url).status_code == 200
            assert client.get(url, headers={"Range": "bytes=0-9"}).status_code == 206
    until_sync(lambda: any(p.is_file() for p in folder.rglob("*")), "a decision kept")
    files = [p for p in folder.rglob("*") if p.is_file()]
    for file in files:
        content = file.read_bytes()
        assert key.encode() not in content, file
        assert secret.encode() not in content, file
        assert b"Bearer" not in content, file


def test_a_key_that_only_shares_a_prefix_is_refused_while_a_decision_is_kept(
    seeded: Seeded,
) -> None:
    """The cache knows a key by its prefix; the decision it keeps is for one key's whole
    header: another with the same prefix is the app's to refuse, never sent the file."""
    url = seeded.url(seeded.mine, "items.json") + "?kept=prefix"
    key = seeded.appliance.key
    forged = key[: -len(key.rsplit("_", 1)[1])] + "x" * len(key.rsplit("_", 1)[1])
    with seeded.appliance.client() as client:
        assert client.get(url).status_code == 200  # decided, kept for a second
        refused = client.get(url, headers={"Authorization": f"Bearer {forged}"})
        again = client.get(url)
    # Three failures a minute are allowed here (test_http2's start): refused either way.
    assert refused.status_code in (401, 429), refused.text
    assert refused.json()["error"]["code"] in ("invalid_api_key", "too_many_auth_failures")
    assert again.status_code == 200
    assert again.content == b'{"items": []}'
