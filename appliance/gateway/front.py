"""HTTP/2 on the LAN API's TLS port: nginx (Debian's) in front of the app.

With TLS on and `server.http2`, the appliance starts nginx as its child. nginx listens on
`server.host`:`server.port` with the LAN certificate, offers h2 and http/1.1 by ALPN, and
passes each request over HTTP/1.1 (on kept connections, unbuffered both ways, so server-sent
events go out as they are written) to the app on a unix socket in a private directory
(mode 0700) of its own. nginx sets X-Forwarded-For to the client's address itself, and a
request on that socket takes its client's address from it: nothing else reaches the
socket. Measured (docs/benchmarks.md): HTTP/2 served in the appliance's own process (the
`h2` library) cost 2.5-3.3 times the CPU of HTTP/1.1 per short request; through nginx it
costs 1.1-1.5 times, and an event stream less than HTTP/1.1 straight to the app.

Hostile clients meet nginx's limits: `server.http2_max_streams` streams per connection,
8 KiB a header line and 32 KiB all of them, `server.max_body_bytes` a body; nginx's own
answers (a bad request, a body too large, headers too large, the app unreachable) are in
the API's error shape. The certificate files are watched: a renewed certificate (the
fleet's, or the operator's file replaced) is taken once it pairs with its key, by a reload
(SIGHUP) that keeps open connections; an nginx that exits is started again.

Package files (`GET`/`HEAD /v1/packages/{id}/files/{path}`) are sent by nginx itself, with
sendfile, from the package cache's blob folder, once the app has decided: nginx asks it
first (an `auth_request` subrequest to DECIDE + the request's URI, with the client's
headers and a token only nginx has), the app checks all that `package_file` checks (the
key and its throttle, without counting a failure; the account's packages; `?version=`; a
blob known good; a range that can be met) and answers 200 with the blob's name (the
sha256 it checked: nginx serves no name from the URL) and the headers to send, or 204:
the app answers itself, as it does a request with a condition (`If-*`), an `Origin`, a
range other than one plain one, or a method other than GET and HEAD, which nginx passes
on whole (a 418 of its own leads there): every refusal is the app's, in the error shape.
(X-Accel-Redirect would need no subrequest, but nginx never caches such an answer.) Any
other answer to the question (a 404 for a path no route takes, the app unreachable) is
taken as a 204: nginx's auth_request would make it a 500.
nginx keeps a 200 for DECISION_S (it counts whole seconds: under 2 s), so repeated
downloads never reach the interpreter: a key revoked or a package withdrawn may still
download that long. The cache (a private folder on /dev/shm, memory, where there is one)
holds no Authorization header: a decision is kept by the key's prefix (public: listed and
logged, it only finds the key's row), the Range and the URI, and carries a check, a hash
of the header it was made for keyed on a secret new at each start (Front.check); nginx
sends the blob only when the request's header has that check, and passes it to the app
otherwise. Folders an earlier start left (a crash, a kill) are removed at the next start.
Run as root, nginx's workers are nobody: a blob the app decides on is made readable to
their group (0640, nogroup), and a folder from the data directory down to the blobs that
keeps them out is given to that group to go through only (0710), where nothing else in it
is open to others (let_through); otherwise, or above the data directory, nothing is
opened and the app sends the files.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import grp
import hashlib
import json
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import ssl
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from aiohttp import web

from shared.errors import ErrorCode, error_body
from shared.files import write_private

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aiohttp.abc import AbstractStreamWriter
    from aiohttp.http_parser import RawRequestMessage
    from aiohttp.streams import StreamReader
    from aiohttp.web_protocol import RequestHandler
    from aiohttp.web_request import BaseRequest

log = logging.getLogger(__name__)

# How often the certificate files are looked at (a stat of each).
WATCH_S = 2.0
# Open requests may finish this long when nginx stops (then they are cut).
SHUTDOWN_S = 10.0


class ParserLimits(TypedDict):
    max_line_size: int
    max_field_size: int
    max_headers: int


# What the app's HTTP/1.1 parser takes on the private socket: more than nginx passes
# (an HTTP/2 header is bounded compressed), so a refusal is nginx's, in the error shape,
# and logged with the client's address (a request the app cannot parse has no
# X-Forwarded-For to take it from).
UPSTREAM_LIMITS = ParserLimits(max_line_size=65_536, max_field_size=65_536, max_headers=1024)
# nginx's own errors, in the API's error shape: (statuses, code, message).
_ERRORS = (
    (
        (400, 494, 495, 496, 497),
        ErrorCode.bad_request,
        "the request or its headers are malformed or too large",
    ),
    ((414,), ErrorCode.bad_request, "the request line is longer than 8 KiB"),
    ((413,), ErrorCode.request_too_large, "the body is larger than the limit of {limit} bytes"),
    ((500, 502, 503, 504), ErrorCode.internal_error, "the API did not answer the TLS front"),
)
_PR_SET_PDEATHSIG = 1
START_ATTEMPTS = 3  # nginx starts at most this many times before the appliance gives up
# Package files nginx may send itself: the app's decision is asked at DECIDE + the URI.
DECIDE = "/.kvl-front/decide"
FILES_ROUTE = "/v1/packages/{id}/files/{path:[^{}]+}"
# nginx's token: the decision route answers nobody else.
TOKEN_HEADER = "X-Kvl-Front"  # noqa: S105 (a header's name, no secret)
METHOD_HEADER = "X-Kvl-Method"  # the client's method (a subrequest is a GET)
BLOB_HEADER = "X-Kvl-Blob"  # the decision: the blob's sha256 (its file's name)
TYPE_HEADER = "X-Kvl-Content-Type"
CACHE_CONTROL_HEADER = "X-Kvl-Cache-Control"
CHECK_HEADER = "X-Kvl-Check"  # the decision's: for which Authorization header (Front.check)
DECISION_S = 1  # nginx keeps a decision this long (it counts whole seconds)
# The requests nginx may answer from a blob: GET or HEAD, no condition, no CORS, and at
# most one plain range (nginx and the app answer other ranges differently; the app also
# says whether the range can be met). Written once here, for nginx (a map) and for the
# app (may_send): both must agree.
CONDITIONS = ("If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since", "If-Range")
_ASKED = ("Origin", *CONDITIONS)
_PLAIN_RANGE = "bytes=([0-9]+-[0-9]*|-0*[1-9][0-9]*)"  # not -0: nginx refuses it
_BLOB_NAME = re.compile(r"[0-9a-f]{64}")
# Every status error_page takes (not 499, nginx's own for a client gone): whatever the
# decision route answers but 200 or 204.
_ANY_ERROR = " ".join(str(s) for s in range(300, 600) if s != 499)
# The folders of a start: the private one, and the decisions' (named by Front._stamp).
_PRIVATE, _DECISIONS = "kvl-front-", "kvl-front-decisions-"
_STAMPED = re.compile(r"^kvl-front-(?:decisions-)?([0-9]+)-([0-9]+)-")


def may_send(method: str, headers: Mapping[str, str]) -> bool:
    """Whether nginx may send a package file itself for a request like this one."""
    if method not in ("GET", "HEAD") or any(h in headers for h in _ASKED):
        return False
    asked = headers.get("Range")
    return asked is None or re.fullmatch(_PLAIN_RANGE, asked) is not None


def blob_name(sha256: str) -> str | None:
    """``sha256`` when it names a blob (64 hex digits), else None: nothing else reaches
    nginx as a file name."""
    return sha256 if _BLOB_NAME.fullmatch(sha256) else None


RESTORE_ROUTE = "/v1/admin/restore"  # appliance/gateway/backups.py
BUNDLES_ROUTE = "/v1/admin/bundles"  # appliance/gateway/bundles.py
# How a request is passed to the app (`location /`, and the files' fallback).
_PROXIED = (
    "            proxy_http_version 1.1;\n"
    "            proxy_set_header Host $http_host;\n"
    "            proxy_set_header X-Forwarded-For $remote_addr;\n"
    "            proxy_set_header Upgrade $http_upgrade;\n"
    "            proxy_set_header Connection $connection_upgrade;\n"
    f'            proxy_set_header {TOKEN_HEADER} "";\n'
    "            proxy_buffering off;\n"
    "            proxy_request_buffering off;\n"
    "            proxy_next_upstream off;\n"
    # A completion may wait for a slot, a model, then generate for minutes.
    "            proxy_read_timeout 3600s;\n"
    "            proxy_send_timeout 3600s;\n"
)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _quoted(path: Path) -> str:
    """``path`` as an nginx string; one nginx would read otherwise is refused."""
    text = str(path.absolute())  # not resolved: a renewal may move a link (certbot's)
    if any(c in text for c in '"\\$') or not text.isprintable():
        raise ValueError(f"nginx cannot be given the path {text!r}: rename it")
    return f'"{text}"'


def _passes(stat: os.stat_result, uid: int, gid: int) -> bool:
    """Whether a user uid:gid (no other groups) may go through a folder of ``stat``."""
    if stat.st_uid == uid:
        return bool(stat.st_mode & 0o100)
    if stat.st_gid == gid:
        return bool(stat.st_mode & 0o010)
    return bool(stat.st_mode & 0o001)


def let_through(blobs: Path, within: Path) -> bool:
    """Let nobody:nogroup (root's nginx workers) through the folders down to ``blobs``,
    opening none above ``within`` (the data directory) and none it would see more by: a
    folder that keeps them out is given to the group nogroup, to go through only (0710:
    not even listed), and only if nothing else in it is open to others or to that group
    (then they reach only what they reach now). False, with nothing changed below the
    folder found, where that cannot be: nginx then sends no file."""
    nobody = pwd.getpwnam("nobody")
    chain = [blobs, *blobs.parents][::-1]  # from / down to the blobs
    for depth, folder in enumerate(chain):
        stat = folder.stat()
        if _passes(stat, nobody.pw_uid, nobody.pw_gid):
            continue
        if folder != within and within not in folder.parents:
            log.warning("%s keeps nginx's workers (nobody) out, above the data directory", folder)
            return False
        if folder != blobs:  # the blobs are the workers' to read (Front.share)
            below = chain[depth + 1].name
            for entry in os.scandir(folder):
                seen = entry.stat(follow_symlinks=False)
                if entry.name != below and (
                    seen.st_mode & 0o007 or (seen.st_gid == nobody.pw_gid and seen.st_mode & 0o070)
                ):
                    log.warning("%s is open to others: its folder stays closed", entry.path)
                    return False
        # The old group's rights first taken away, or nogroup would have them a moment.
        folder.chmod(stat.st_mode & 0o707)
        os.chown(folder, -1, nobody.pw_gid)
        folder.chmod((stat.st_mode & 0o707) | 0o010)
        log.info("%s: nginx's workers (nogroup) may go through it now", folder)
    return True


def nginx_binary() -> str | None:
    """Debian's nginx, where `apt-get install nginx` puts it (or on PATH)."""
    return shutil.which("nginx", path=f"{os.environ.get('PATH', '')}:/usr/sbin")


def _memory_folder(prefix: str) -> Path | None:
    """A new private folder on /dev/shm (memory), or None where there is none."""
    shm = Path("/dev/shm")  # noqa: S108 - a tmpfs by design; the folder is mkdtemp's (0700)
    if not shm.is_dir() or not os.access(shm, os.W_OK | os.X_OK):
        return None
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=shm))
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot: with the pid, it names one
    process ever, a pid used again another), or None when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text()
        # The command's name (field 2) is in parentheses and may hold both, and spaces.
        return int(fields.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _stamp() -> str:
    """What a folder of this start is named by: this process and when it started."""
    return f"{os.getpid()}-{_started(os.getpid()) or 0}-"


def remove_stale(parents: tuple[Path, ...] | None = None) -> list[Path]:
    """Remove the folders earlier starts left behind (killed, crashed: a decisions cache
    and a private folder each): ours by name (kvl-front-…, stamped with the process that
    made it) and by owner (this user; under root, nobody too, whose nginx workers were
    given them), of a process that is gone. A live one's, another appliance's or this
    process's own, stays. None are touched where processes cannot be told apart (no
    /proc). ``parents``: /dev/shm and the temporary folder."""
    if _started(os.getpid()) is None:
        return []
    owners = {os.geteuid()}
    if os.geteuid() == 0:
        owners.add(pwd.getpwnam("nobody").pw_uid)
    removed = []
    shm = Path("/dev/shm")  # noqa: S108 - where _memory_folder makes them
    for parent in parents or (shm, Path(tempfile.gettempdir())):
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            if (named := _STAMPED.match(entry.name)) is None:
                continue
            try:
                seen = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(seen.st_mode) or seen.st_uid not in owners:
                continue
            if _started(int(named.group(1))) == int(named.group(2)):
                continue  # its process lives
            # rmtree follows no link, so a folder nginx's workers wrote in is safe to go.
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    if removed:
        log.info("removed the TLS front's folders of earlier starts: %s", removed)
    return removed


def trust_forwarded(server: web.Server, front: Front | None = None) -> None:
    """Requests of ``server`` (the private socket's: nginx's only) are from the client
    nginx names in X-Forwarded-For, over HTTPS; they carry ``front`` (FRONT)."""
    make = server.request_factory

    def request_factory(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> BaseRequest:
        request = make(message, payload, protocol, writer, task)
        forwarded = request.clone(remote=message.headers.get("X-Forwarded-For", ""), scheme="https")
        if front is not None:
            forwarded[FRONT] = front
        return forwarded

    server.request_factory = request_factory


class Front:
    """nginx on the LAN API's port, the app behind it on ``upstream`` (a unix socket in
    ``directory``, which holds nginx's configuration and files too)."""

    def __init__(
        self,
        binary: str,
        *,
        host: str,
        port: int,
        certificate: tuple[Path, Path],
        max_streams: int,
        max_body_bytes: int,
        blobs: Path | None = None,
        data_dir: Path | None = None,
    ) -> None:
        """``blobs``: the package cache's blob folder, whose files nginx may send itself
        (None: every request goes to the app); under root, the folders from ``data_dir``
        down to it may be opened to nginx's workers (let_through)."""
        self._binary = binary
        self._host = host
        self._port = port
        self._certificate = certificate
        self._max_streams = max_streams
        self._max_body_bytes = max_body_bytes
        remove_stale()
        # Short (a unix socket's path has 108 bytes at most) and private.
        self.directory = Path(tempfile.mkdtemp(prefix=_PRIVATE + _stamp()))
        self.upstream = self.directory / "app.sock"
        # The decisions' cache: in memory (a tmpfs) where there is one, else in the
        # private folder. It holds no Authorization header (see check), but what a
        # client downloads, and when.
        self.decisions = _memory_folder(_DECISIONS + _stamp()) or self.directory / "decisions"
        # The secret of the decisions' checks: new at each start, held by this process and
        # by nginx's configuration (owner-only, in the private folder), never in the
        # cache's folder.
        self._check_key = secrets.token_urlsafe(32)
        self._process: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._seen = self._stat()
        self.blobs = None if blobs is None else blobs.absolute()
        self._data_dir = None if data_dir is None else data_dir.absolute()
        # What the decision route asks nginx for: nobody else can send it.
        self.token = secrets.token_urlsafe(24)
        # Root's workers run as nobody: blobs they send are shared with their group.
        self.group = grp.getgrnam("nogroup").gr_gid if os.geteuid() == 0 else None

    def check(self, authorization: str) -> str:
        """The check a decision carries (CHECK_HEADER): a hash of the Authorization header
        it was made for, keyed on this start's secret, as nginx's secure_link computes it
        (md5 of the secret then the header, base64url unpadded). nginx cannot compute an
        HMAC, nor hash a header into a cache key at all, but it can compare this: so the
        cache keeps this and not the header, and a request whose header does not match
        it goes to the app. md5 with the secret first is no HMAC, but forging a check
        takes a header with the padding of a length extension, and no header holds the
        NUL bytes in it."""
        raw = self._check_key.encode() + authorization.encode("utf-8", "surrogateescape")
        digest = hashlib.md5(raw).digest()  # noqa: S324 - secure_link's hash, keyed (see above)
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    # -- the configuration

    def config(self) -> str:
        d = self.directory
        host = f"[{self._host}]" if ":" in self._host else self._host
        temps = "".join(
            f"    {kind}_temp_path {d}/{kind};\n"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        pages, named = [], []
        for statuses, code, message in _ERRORS:
            body = json.dumps(error_body(code, message.format(limit=self._max_body_bytes)))
            if "'" in body or "$" in body or "\\" in body:  # nginx would read them itself
                raise ValueError(f"an error body nginx cannot quote: {body}")
            # A URI, not a named location: nginx cannot go to one of those from a
            # request line it could not read.
            uri = f"/.kvl-front/{statuses[0]}"
            codes = " ".join(map(str, statuses))
            pages.append(f"        error_page {codes} ={code.status} {uri};\n")
            named.append(
                f"        location = {uri} {{\n"
                "            internal;\n"
                "            client_max_body_size 0;  # or a 413 would be refused again\n"
                "            default_type application/json;\n"
                f"            return {code.status} '{body}';\n"
                "        }\n"
            )
        cert, key = self._certificate
        files_http, files_server = self._files_config()
        # Root starts nginx's workers as nobody (the socket is theirs then, see start).
        user = "user nobody nogroup;\n" if os.geteuid() == 0 else ""
        return (
            f"{user}daemon off;\n"
            # One worker: the LAN API's traffic is small next to inference.
            "worker_processes 1;\n"
            "worker_rlimit_nofile 4096;\n"
            f"worker_shutdown_timeout {SHUTDOWN_S:.0f}s;\n"
            f"pid {d}/nginx.pid;\n"
            "error_log stderr warn;\n"
            "events { worker_connections 2048; }\n"
            "http {\n"
            "    access_log off;\n"
            "    server_tokens off;\n"
            f"{temps}"
            f"{files_http}"
            "    map $http_upgrade $connection_upgrade { default upgrade; '' ''; }\n"
            f"    upstream appliance {{ server unix:{self.upstream}; keepalive 64; }}\n"
            "    server {\n"
            # nginx 1.22 (Debian 12) says `listen … http2`; 1.25 and later `http2 on;`.
            f"        listen {host}:{self._port} ssl http2;\n"
            f"        ssl_certificate {_quoted(cert)};\n"
            f"        ssl_certificate_key {_quoted(key)};\n"
            "        ssl_protocols TLSv1.2 TLSv1.3;\n"
            f"        http2_max_concurrent_streams {self._max_streams};\n"
            "        large_client_header_buffers 4 8k;\n"
            f"        client_max_body_size {self._max_body_bytes};\n"
            f"{''.join(pages)}"
            # A backup put back may be gigabytes (its package cache): the app bounds it by
            # the disk it has, streamed.
            f"        location = {RESTORE_ROUTE} {{\n"
            "            client_max_body_size 0;\n"
            "            proxy_pass http://appliance;\n"
            f"{_PROXIED}"
            "        }\n"
            # So may a site bundle's pieces (the app bounds an upload by its size).
            f"        location ^~ {BUNDLES_ROUTE}/ {{\n"
            "            client_max_body_size 0;\n"
            "            proxy_pass http://appliance;\n"
            f"{_PROXIED}"
            "        }\n"
            "        location / {\n"
            "            proxy_pass http://appliance;\n"
            f"{_PROXIED}"
            "        }\n"
            f"{files_server}"
            f"{''.join(named)}"
            "    }\n"
            "}\n"
        )

    def _files_config(self) -> tuple[str, str]:
        """The http-level and server-level configuration that lets nginx send package files
        once the app said so (see the module's docstring); empty without ``blobs``."""
        if self.blobs is None:
            return "", ""
        header = {  # the decision's headers, as nginx names them
            name: "$upstream_http_" + name.lower().replace("-", "_")
            for name in (BLOB_HEADER, TYPE_HEADER, CACHE_CONTROL_HEADER, CHECK_HEADER)
        }
        asked = "".join("$http_" + h.lower().replace("-", "_") for h in _ASKED)
        # A cached proxy drops these from what it passes on: the app decides on them.
        kept = "".join(
            f"            proxy_set_header {h} $http_{h.lower().replace('-', '_')};\n"
            for h in ("Range", *CONDITIONS)
        )
        http = (
            # Only nginx's user reads the cache; an entry lives DECISION_S, its file a
            # little longer.
            f"    proxy_cache_path {self.decisions} levels=1:2 keys_zone=kvl_decisions:1m\n"
            "                     max_size=64m inactive=10s use_temp_path=off;\n"
            # What the cache knows a key by: its prefix (public), never the whole key.
            "    map $http_authorization $kvl_key_prefix {\n"
            '        "~*^bearer +kvl_([a-z0-9]{8})_" $1;\n'
            '        default "";\n'
            "    }\n"
            f'    map "$request_method:{asked}:$http_range" $kvl_app_answers {{\n'
            f'        "~^(GET|HEAD)::({_PLAIN_RANGE})?$" 0;\n'
            "        default 1;\n"
            "    }\n"
            # The one file name nginx serves: a sha256 decided for this request's
            # Authorization header ($secure_link is 1: its check matches), else one that
            # is never there.
            '    map "$secure_link:$kvl_decision" $kvl_blob {\n'
            '        "~^1:([0-9a-f]{64})$" $1;\n'
            '        default "-";\n'
            "    }\n"
            f"    map {header[BLOB_HEADER]} $kvl_undecided {{ '' 1; default 0; }}\n"
        )
        server = (
            # A request nginx may not send a file for (418, below) goes to the app whole.
            "        error_page 418 = @kvl_app;\n"
            "        location ~ ^/v1/packages/[^/]+/files/. {\n"
            "            if ($kvl_app_answers) { return 418; }\n"
            f"            auth_request {DECIDE};\n"
            f"            auth_request_set $kvl_decision {header[BLOB_HEADER]};\n"
            f"            auth_request_set $kvl_type {header[TYPE_HEADER]};\n"
            f"            auth_request_set $kvl_cache_control {header[CACHE_CONTROL_HEADER]};\n"
            f"            auth_request_set $kvl_check {header[CHECK_HEADER]};\n"
            "            secure_link $kvl_check;\n"
            f'            secure_link_md5 "{self._check_key}$http_authorization";\n'
            f"            root {_quoted(self.blobs)};\n"
            # The app said 204 (its own answer), or the blob went since: the app answers.
            "            try_files /$kvl_blob @kvl_app;\n"
            "            types { }\n"
            '            default_type "";\n'
            "            etag off;\n"
            "            max_ranges 1;\n"
            "            sendfile on;\n"
            "            add_header Content-Type $kvl_type;\n"
            '            add_header ETag "\\"$kvl_blob\\"";\n'
            "            add_header Cache-Control $kvl_cache_control;\n"
            '            add_header Last-Modified "";  # the app sends none\n'
            "        }\n"
            f"        location = {DECIDE} {{\n"
            "            internal;\n"
            f"            proxy_pass http://appliance{DECIDE}$request_uri;\n"
            "            proxy_http_version 1.1;\n"
            "            proxy_set_header Host $http_host;\n"
            "            proxy_set_header X-Forwarded-For $remote_addr;\n"
            '            proxy_set_header Connection "";\n'
            f"            proxy_set_header {TOKEN_HEADER} {self.token};\n"
            f"            proxy_set_header {METHOD_HEADER} $request_method;\n"
            f"{kept}"
            "            proxy_pass_request_body off;\n"
            '            proxy_set_header Content-Length "";\n'
            "            proxy_next_upstream off;\n"
            "            proxy_cache kvl_decisions;\n"
            # The decision says whether the range can be met: a range is part of it. The
            # key's prefix keeps one key's decision from pushing out another's; the check
            # it carries, not the key, says whose it is.
            '            proxy_cache_key "$kvl_key_prefix\\n$http_range\\n$request_uri";\n'
            f"            proxy_cache_valid 200 {DECISION_S}s;\n"
            "            proxy_ignore_headers Cache-Control Expires Set-Cookie Vary\n"
            "                X-Accel-Expires X-Accel-Redirect X-Accel-Limit-Rate\n"
            "                X-Accel-Buffering X-Accel-Charset;\n"
            "            proxy_no_cache $kvl_undecided;\n"
            # auth_request makes any answer but a 2xx, 401 or 403 a 500 (a path no route
            # of the app takes is a 404): every one is taken as the app's 204, and the app
            # answers the request itself, in the error shape.
            "            proxy_intercept_errors on;\n"
            f"            error_page {_ANY_ERROR} = @kvl_undecided;\n"
            "        }\n"
            "        location @kvl_undecided {\n"
            "            return 204;\n"
            "        }\n"
            "        location @kvl_app {\n"
            # The request as the client sent it (not the URI try_files or a 418 left).
            "            proxy_pass http://appliance$request_uri;\n"
            f"{_PROXIED}"
            "        }\n"
        )
        return http, server

    def share(self, blob: int) -> None:
        """Let nginx's workers read the open ``blob`` (a file of ``blobs``): when root runs
        the appliance, they are nobody, and read it through their group; the cache writes
        blobs owner-only (a repaired one again), so this is checked at each decision (an
        fstat), and changed once."""
        if self.group is None:
            return
        stat = os.fstat(blob)
        if stat.st_gid != self.group:
            os.fchown(blob, -1, self.group)
        if stat.st_mode & 0o777 != 0o640:
            os.fchmod(blob, 0o640)

    # -- the process

    async def start(self) -> None:
        """Start nginx; return once it listens (RuntimeError with its words if it cannot)."""
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.directory, nobody.pw_uid, nobody.pw_gid)
            if self.decisions.parent != self.directory:
                os.chown(self.decisions, nobody.pw_uid, nobody.pw_gid)
            with contextlib.suppress(FileNotFoundError):
                os.chown(self.upstream, nobody.pw_uid, nobody.pw_gid)
        if self.blobs is not None and self.group is not None:
            try:
                reached = let_through(self.blobs, self._data_dir or self.blobs)
            except OSError as err:
                log.warning("could not open the way to %s: %s", self.blobs, err)
                reached = False
            if not reached:
                log.warning(
                    "nginx's workers (nobody) cannot reach %s: package files go through the app",
                    self.blobs,
                )
                self.blobs = None
        # Owner-only: it holds the secret of the decisions' checks.
        write_private(self.directory / "nginx.conf", self.config())
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                await self._spawn()
                break
            except RuntimeError as err:
                # A master killed while it starts (a signal from outside: it printed
                # nothing) is started again, as the supervisor restarts one that dies
                # later; one that cannot start at all still fails after the last try.
                if attempt == START_ATTEMPTS:
                    raise
                log.warning("nginx did not start (%s); trying again (%d)", err, attempt)
        self._tasks = [
            asyncio.create_task(self._supervise(), name="nginx supervisor"),
            asyncio.create_task(self._watch(), name="certificate watch"),
        ]

    async def _spawn(self) -> None:
        (self.directory / "nginx.pid").unlink(missing_ok=True)  # a killed master's
        libc = ctypes.CDLL(None, use_errno=True)

        def die_with_parent() -> None:  # nginx must not outlive the appliance
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

        process = await asyncio.create_subprocess_exec(
            self._binary,
            "-p",
            f"{self.directory}/",
            "-c",
            str(self.directory / "nginx.conf"),
            "-e",
            "stderr",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            # nginx's error log is the appliance's stderr (no pipe: its workers would hold
            # one open after a master that died, and its exit would go unseen).
            stderr=None,
            preexec_fn=die_with_parent,  # prctl only, no locks
            start_new_session=True,  # its own process group: the master's and its workers'
        )
        self._process = process
        try:
            await self._listening(process)
        except BaseException:
            _kill_group(process.pid)
            await process.wait()
            raise

    async def _listening(self, process: asyncio.subprocess.Process) -> None:
        """Once nginx has written its pid file (it has bound its port then) and accepts."""
        wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # noqa: S104
        host = wildcard.get(self._host, self._host)
        pid = self.directory / "nginx.pid"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"nginx exited ({process.returncode}); its words are above")
            try:
                if not pid.exists():
                    raise FileNotFoundError(pid)
                _, writer = await asyncio.open_connection(host, self._port)
            except OSError:
                if loop.time() > deadline:
                    raise RuntimeError("nginx did not listen within 30 s") from None
                await asyncio.sleep(0.02)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = 1.0
        while self._process is not None:
            started = loop.time()
            code = await self._process.wait()
            if self._stopping:
                return
            # Workers outlive a master that was killed, and keep the port: not these.
            _kill_group(self._process.pid)
            backoff = 1.0 if loop.time() - started > 60 else min(backoff * 2, 30.0)
            log.error("nginx exited (%d); starting it again in %.0f s", code, backoff)
            await asyncio.sleep(backoff)
            try:
                await self._spawn()
            except RuntimeError as err:
                log.error("nginx could not start again: %s", err)  # noqa: TRY400

    # -- the certificate

    def _stat(self) -> tuple[tuple[int, int, int], ...] | None:
        try:
            return tuple(
                (s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, self._certificate)
            )
        except OSError:
            return None

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(WATCH_S)
            seen = self._stat()
            if seen is None or seen == self._seen:
                continue
            # The key and the certificate are two files, written one after the other:
            # a reload between the two would fail, so wait until they pair.
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    *self._certificate
                )
            except (OSError, ValueError):  # ssl.SSLError is an OSError
                continue
            self._seen = seen
            if self._process is not None and self._process.returncode is None:
                log.info("TLS: the certificate changed; nginx reloads it")
                self._process.send_signal(signal.SIGHUP)

    # -- the end

    async def stop(self) -> None:
        """Stop nginx gracefully (open requests may finish, SHUTDOWN_S at most)."""
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGQUIT)
            try:
                async with asyncio.timeout(SHUTDOWN_S + 5):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        if process is not None:
            _kill_group(process.pid)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        shutil.rmtree(self.decisions, ignore_errors=True)


# Set on each request of the private socket (trust_forwarded): the front it came through.
FRONT = web.RequestKey("front", Front)
