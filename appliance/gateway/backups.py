"""The appliance's backup through its admin API (`POST /v1/admin/backup`): a site without a
hub, whose image has no shell, takes its backup with an admin key and keeps it where it
likes. The archive is the one `kvl appliance backup` writes (appliance/backup.py), taken
while the appliance serves, and `kvl appliance restore` puts back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from pathlib import Path

from aiohttp import web

from appliance import backup as appliance_backup
from appliance.gateway.appkeys import SETTINGS
from shared.backup_archive import BackupError
from shared.errors import ApiError, ErrorCode

log = logging.getLogger(__name__)

# One backup at a time: a second waits for the first (each copies the database whole).
_TAKING = web.AppKey("backup_lock", asyncio.Lock)
_CHUNK = 1 << 20


def setup(app: web.Application) -> None:
    app[_TAKING] = asyncio.Lock()


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


def _flag(value: str) -> bool:
    if value in {"true", "1"}:
        return True
    if value in {"false", "0"}:
        return False
    raise ApiError(
        ErrorCode.invalid_value, f"`packages` is true or false, not {value!r}", param="packages"
    )
