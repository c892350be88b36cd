"""The appliance's backup through its admin API: a site without a hub, whose image has no
shell, takes its backup with an admin key and keeps it where it likes
(`POST /v1/admin/backup`: the archive `kvl appliance backup` writes, appliance/backup.py,
taken while the appliance serves), and puts one back (`POST /v1/admin/restore`: the archive
checked whole while the appliance serves, then applied as it restarts, before it serves
again, since no appliance may serve from a data directory a restore writes into)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from appliance import backup as appliance_backup
from appliance.gateway.appkeys import SETTINGS
from shared.backup_archive import BackupError
from shared.errors import ApiError, ErrorCode

log = logging.getLogger(__name__)

# One backup or restore at a time: a second waits for the first (each copies the
# database whole).
_TAKING = web.AppKey("backup_lock", asyncio.Lock)
# How the appliance restarts to apply a restore: it stops as SIGTERM stops it, and its
# unit (`Restart=always`) starts it again; the tests put their own here.
RESTART = web.AppKey[Callable[[], None]]("restart")
RESTART_AFTER_S = 0.5  # the 202 on its way first
_CHUNK = 1 << 20
_SPARE_BYTES = 1 << 30  # an upload never fills the disk the appliance writes to


def setup(app: web.Application) -> None:
    app[_TAKING] = asyncio.Lock()
    app[RESTART] = _stop_for_restart


def _stop_for_restart() -> None:
    loop = asyncio.get_running_loop()
    loop.call_later(RESTART_AFTER_S, os.kill, os.getpid(), signal.SIGTERM)


async def take_backup(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    packages = _flag(request.query.get("packages", "true"))
    async with request.app[_TAKING]:
        with tempfile.TemporaryDirectory(prefix=".kvl-backup-", dir=settings.data_dir) as work:
            archive = Path(work) / "backup.tar"
            try:
                made = await asyncio.to_thread(
                    appliance_backup.backup, settings, archive, packages=packages
                )
            except BackupError as err:  # the node's own trouble (a file changed while read)
                log.warning("backup through the admin API failed: %s", err)
                raise ApiError(ErrorCode.internal_error, f"the backup failed: {err}") from err
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(made.manifest.created_at))
            response = web.StreamResponse(
                headers={
                    "Content-Type": "application/x-tar",
                    "Content-Length": str(archive.stat().st_size),
                    "Content-Disposition": f'attachment; filename="kvl-appliance-{stamp}.tar"',
                    # What the data directory holds that the archive does not, for the
                    # client to keep beside it.
                    "X-Kvl-Left-Out": ",".join(made.left_out),
                }
            )
            await response.prepare(request)
            with archive.open("rb") as f:
                while chunk := await asyncio.to_thread(f.read, _CHUNK):
                    await response.write(chunk)
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
            return response


async def restore_backup(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    async with request.app[_TAKING]:
        with tempfile.TemporaryDirectory(prefix=".kvl-restore-", dir=settings.data_dir) as work:
            upload = Path(work) / "upload.tar"
            await _receive(request, upload)
            try:
                manifest = await asyncio.to_thread(appliance_backup.verify, settings, upload)
            except BackupError as err:
                raise ApiError(ErrorCode.bad_request, f"the archive is refused: {err}") from err
            upload.rename(settings.data_dir / appliance_backup.PENDING)
    log.warning(
        "a restore of the backup made at %s (kvl %s) is staged: the appliance restarts to apply it",
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(manifest.created_at)),
        manifest.kvl_version,
    )
    request.app[RESTART]()
    return web.json_response(
        {
            "object": "restore",
            "status": "restarting",
            "created_at": manifest.created_at,
            "kvl_version": manifest.kvl_version,
            "members": len(manifest.members),
        },
        status=202,
    )


async def _receive(request: web.Request, path: Path) -> None:
    """The request's body into `path`, streamed; refused (413) past what the disk can give
    and keep a gigabyte spare."""
    room = shutil.disk_usage(path.parent).free - _SPARE_BYTES
    if (request.content_length or 0) > room:
        raise _too_large(room)
    received = 0
    with path.open("wb") as f:
        async for chunk in request.content.iter_chunked(_CHUNK):
            received += len(chunk)
            if received > room:
                raise _too_large(room)
            await asyncio.to_thread(f.write, chunk)
    if received == 0:
        raise ApiError(ErrorCode.bad_request, "send the backup archive as the request's body")


def _too_large(room: int) -> ApiError:
    return ApiError(
        ErrorCode.request_too_large,
        f"the archive is larger than the {max(0, room)} bytes the data directory can take "
        "and keep a gigabyte spare",
    )


def _flag(value: str) -> bool:
    if value in {"true", "1"}:
        return True
    if value in {"false", "0"}:
        return False
    raise ApiError(
        ErrorCode.invalid_value, f"`packages` is true or false, not {value!r}", param="packages"
    )
