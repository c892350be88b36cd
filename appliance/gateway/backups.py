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
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from appliance import backup as appliance_backup
from appliance.gateway.appkeys import SETTINGS
from appliance.gateway.parsing import read_json
from appliance.inference.schemas import parse_body
from shared import sealing
from shared.backup_archive import BackupError
from shared.backup_schedule import Scheduled
from shared.errors import ApiError, ErrorCode

log = logging.getLogger(__name__)

# One backup or restore at a time, the schedule's too: a second waits for the first (each
# copies the database whole).
TAKING = web.AppKey("backup_lock", asyncio.Lock)
SCHEDULED = web.AppKey("scheduled_backups", Scheduled)
# How the appliance restarts to apply a restore: it stops as SIGTERM stops it, and its
# unit (`Restart=always`) starts it again; the tests put their own here.
RESTART = web.AppKey[Callable[[], None]]("restart")
RESTART_AFTER_S = 0.5  # the 202 on its way first
_CHUNK = 1 << 20
_SPARE_BYTES = 1 << 30  # an upload never fills the disk the appliance writes to


# What opens a sealed backup sent to be restored: headers, so the body stays the archive.
IDENTITY_HEADER = "Kvl-Backup-Identity"  # an X25519 identity (AGE-SECRET-KEY-1…); may repeat
PASSPHRASE_HEADER = "Kvl-Backup-Passphrase"  # noqa: S105 - a header's name; its value UTF-8


class BackupRequest(BaseModel):
    """How to take the backup (the body is optional: no body, the archive as it is)."""

    model_config = ConfigDict(extra="forbid")

    packages: bool = Field(default=True, description="The package cache in it (`?packages=` too).")
    recipients: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Seal it with age to these X25519 recipients (`age1…`): a `.tar.age` "
        "that `age -d -i key.txt` opens.",
    )
    passphrase: str | None = Field(
        None,
        min_length=1,
        max_length=sealing.MAX_PASSPHRASE_BYTES,
        description="Seal it with this passphrase instead: a `.age.tar` holding the "
        "sealed one-time key (`identity.age`) and the backup sealed to it.",
    )


def setup(app: web.Application) -> None:
    app[TAKING] = asyncio.Lock()
    app[RESTART] = _stop_for_restart
    settings = app[SETTINGS]
    app[SCHEDULED] = Scheduled(
        settings.backups,
        settings.data_dir,
        appliance_backup.KIND,
        lambda out: appliance_backup.backup(settings, out, packages=settings.backups.packages),
        lock=app[TAKING],
    )
    app.cleanup_ctx.append(_schedule)


async def _schedule(app: web.Application) -> AsyncIterator[None]:
    """The scheduled backups (`backups.schedule`), while the appliance runs."""
    scheduled = app[SCHEDULED]
    if not scheduled.scheduled:
        yield
        return
    task = asyncio.create_task(scheduled.run(), name="kvl-scheduled-backups")
    log.info(
        "backups on the schedule %r (%s) into %s, %d kept",
        scheduled.settings.schedule,
        scheduled.settings.timezone,
        scheduled.shelf.folder,
        scheduled.settings.keep,
    )
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def list_backups(request: web.Request) -> web.Response:
    """The scheduled backups kept on this node, newest first, and how the schedule goes."""
    scheduled = request.app[SCHEDULED]
    kept = await asyncio.to_thread(scheduled.shelf.kept)
    report = await asyncio.to_thread(scheduled.report)
    return web.json_response(
        {
            "object": "list",
            "schedule": report.model_dump(mode="json") if report is not None else None,
            "data": [
                {
                    "object": "backup",
                    "id": k.path.name,
                    "created_at": k.created_at,
                    "bytes": k.size,
                    "sealed": sealing.sealed_as(k.path) != "plain",
                }
                for k in reversed(kept)
            ],
        }
    )


async def download_backup(request: web.Request) -> web.StreamResponse:
    """One kept backup, by its name (`GET /v1/admin/backups`' `id`), streamed."""
    scheduled = request.app[SCHEDULED]
    name = request.match_info["name"]
    kept = {k.path.name: k for k in await asyncio.to_thread(scheduled.shelf.kept)}
    found = kept.get(name)  # only a name the folder lists: never a path of the caller's
    if found is None:
        raise ApiError(ErrorCode.not_found, f"no kept backup named {name[:200]!r}")
    media = "application/octet-stream" if name.endswith(sealing.RECIPIENTS_SUFFIX) else None
    response = web.StreamResponse(
        headers={
            "Content-Type": media or "application/x-tar",
            "Content-Length": str(found.size),
            "Content-Disposition": f'attachment; filename="{name}"',
        }
    )
    await response.prepare(request)
    with found.path.open("rb") as f:
        while chunk := await asyncio.to_thread(f.read, _CHUNK):
            await response.write(chunk)
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response


def _stop_for_restart() -> None:
    loop = asyncio.get_running_loop()
    loop.call_later(RESTART_AFTER_S, os.kill, os.getpid(), signal.SIGTERM)


async def take_backup(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    asked = await _backup_request(request)
    seal = _sealing(asked)
    async with request.app[TAKING]:
        with tempfile.TemporaryDirectory(prefix=".kvl-backup-", dir=settings.data_dir) as work:
            archive = Path(work) / "backup.tar"
            try:
                made = await asyncio.to_thread(
                    appliance_backup.backup, settings, archive, packages=asked.packages
                )
                if seal is not None:
                    sealed = archive.with_name(f"backup{seal.suffix}")
                    await asyncio.to_thread(sealing.seal, archive, sealed, seal)
                    archive.unlink()
                    archive = sealed
            except BackupError as err:  # the node's own trouble (a file changed while read)
                log.warning("backup through the admin API failed: %s", err)
                raise ApiError(ErrorCode.internal_error, f"the backup failed: {err}") from err
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(made.manifest.created_at))
            name = f"kvl-appliance-{stamp}{seal.suffix if seal else '.tar'}"
            # An age file is no tar until opened; the passphrase's is one.
            age_file = seal is not None and seal.passphrase is None
            media = "application/octet-stream" if age_file else "application/x-tar"
            response = web.StreamResponse(
                headers={
                    "Content-Type": media,
                    "Content-Length": str(archive.stat().st_size),
                    "Content-Disposition": f'attachment; filename="{name}"',
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
    async with request.app[TAKING]:
        with tempfile.TemporaryDirectory(prefix=".kvl-restore-", dir=settings.data_dir) as work:
            upload = Path(work) / "upload.tar"
            await _receive(request, upload)
            upload = await _opened(request, upload)
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


async def _backup_request(request: web.Request) -> BackupRequest:
    packages = _flag(request.query.get("packages", "true"))
    # No body: the archive as it is (`curl -X POST`); a body said to be JSON is read as one,
    # empty or not.
    if not request.body_exists and request.content_type != "application/json":
        return BackupRequest(packages=packages)
    raw = await read_json(request)
    raw.setdefault("packages", packages)
    return parse_body(BackupRequest, raw)


def _sealing(asked: BackupRequest) -> sealing.Sealing | None:
    if not asked.recipients and asked.passphrase is None:
        return None
    try:
        return sealing.Sealing(tuple(asked.recipients), asked.passphrase)
    except sealing.SealError as err:
        param = (
            "passphrase" if asked.passphrase is not None and not asked.recipients else "recipients"
        )
        raise ApiError(ErrorCode.invalid_value, str(err), param=param) from err


async def _opened(request: web.Request, upload: Path) -> Path:
    """The archive received, opened when it came sealed (with the identity or passphrase
    its headers give); the sealed file removed once opened."""
    identities = request.headers.getall(IDENTITY_HEADER, [])
    passphrase = request.headers.get(PASSPHRASE_HEADER)
    return await asyncio.to_thread(_open, upload, identities, passphrase)


def _open(upload: Path, identities: list[str], passphrase: str | None) -> Path:
    if sealing.sealed_as(upload) == "plain":
        if identities or passphrase is not None:
            raise ApiError(
                ErrorCode.bad_request, "the archive is not sealed: send it without a key"
            )
        return upload
    room = shutil.disk_usage(upload.parent).free - _SPARE_BYTES
    if upload.stat().st_size > room:
        raise _too_large(room)
    opened = upload.with_name("opened.tar")
    try:
        sealing.unseal(upload, opened, identity=identities, passphrase=passphrase)
    except sealing.SealError as err:
        raise ApiError(ErrorCode.bad_request, f"the archive is refused: {err}") from err
    upload.unlink()
    return opened


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
