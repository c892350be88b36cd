"""Uploads of model files an operator holds, in pieces, resumable (the console's Add model
page sends its file so; any client can), in the manner of the tus protocol's core:

- `POST /v1/admin/models/uploads` with the name, version, size and (best) sha256: the
  upload, `Upload-Offset: 0`, refused at once when it could not fit (`models.max_pull_bytes`,
  `models.keep_free_bytes`);
- `PATCH /v1/admin/models/uploads/{id}` with `Upload-Offset: N` and the next bytes as the
  body: appended where the upload stands (409 `upload_offset_mismatch` anywhere else, its
  message saying where it stands), never past its size; an upload cut off goes on from
  `GET …/{id}`'s `offset`, after a hub restart too (the bytes are its part file);
- the last piece makes it whole: its sha256 checked, the GGUF inspected, the model
  registered; a file that fails either is deleted and the upload `failed`, saying why;
- `DELETE …/{id}` cancels it.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from aiohttp import web

from hub.api.requests import UploadRequest
from hub.api.route_kinds import Auth, Route
from hub.appkeys import OPERATOR, SETTINGS, STORE
from hub.http import parse
from hub.models.errors import PullError
from hub.models.inspect import inspect
from hub.state.deployments import ModelArtifact
from hub.state.errors import ConflictError
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from pathlib import Path

    from hub.settings import HubSettings
    from hub.state.uploads import Upload

OFFSET = "Upload-Offset"
CHUNK = 1 << 20


def _part(settings: HubSettings, upload_id: str) -> Path:
    return settings.uploads_dir / f"{upload_id}.part"


def _offset(settings: HubSettings, upload: Upload) -> int:
    part = _part(settings, upload.id)
    return part.stat().st_size if upload.state == "open" and part.exists() else 0


def upload_view(upload: Upload, offset: int) -> dict[str, Any]:
    return {**asdict(upload), "offset": offset}


async def create_upload(request: web.Request) -> web.Response:
    req = await parse(request, UploadRequest)
    upload = await begin(request, req, request[OPERATOR])
    return web.json_response(
        upload_view(upload, 0),
        status=201,
        headers={OFFSET: "0", "Location": f"/v1/admin/models/uploads/{upload.id}"},
    )


async def begin(request: web.Request, req: UploadRequest, by: str) -> Upload:
    """A new upload, its part file made; ApiError when it could not fit or is registered
    already (the operator API's call, and the console's)."""
    settings = request.app[SETTINGS]
    bounds = settings.models
    if req.size_bytes > bounds.max_pull_bytes:
        raise ApiError(
            ErrorCode.invalid_value,
            f"{req.size_bytes} bytes is over models.max_pull_bytes ({bounds.max_pull_bytes})",
            param="size_bytes",
        )
    await asyncio.to_thread(settings.uploads_dir.mkdir, parents=True, exist_ok=True)
    free = (await asyncio.to_thread(shutil.disk_usage, settings.uploads_dir)).free
    if free < req.size_bytes + bounds.keep_free_bytes:
        raise ApiError(
            ErrorCode.invalid_value,
            f"the file needs {req.size_bytes >> 20} MiB and {bounds.keep_free_bytes >> 20} MiB "
            f"are kept free (models.keep_free_bytes); {free >> 20} MiB are free",
            param="size_bytes",
        )
    store = request.app[STORE]
    try:
        upload = await store.run(
            lambda: store.sync.uploads.create(
                req.name, req.version, size_bytes=req.size_bytes, sha256=req.sha256,
                memory_mib=req.memory_mib, created_by=by,
            )
        )  # fmt: skip
    except ConflictError as err:
        raise ApiError(ErrorCode.invalid_value, str(err), param="version") from err
    await asyncio.to_thread(_part(settings, upload.id).touch)
    return upload


async def get_upload(request: web.Request) -> web.Response:
    store = request.app[STORE]
    upload = await store.run(store.sync.uploads.get, request.match_info["id"])
    offset = await stands_at(request, upload)
    return web.json_response(upload_view(upload, offset), headers={OFFSET: str(offset)})


async def stands_at(request: web.Request, upload: Upload) -> int:
    """Where an upload stands: the bytes its part file holds (0 once it ended)."""
    return await asyncio.to_thread(_offset, request.app[SETTINGS], upload)


async def append(request: web.Request) -> web.Response:
    upload, offset = await append_piece(request)
    return web.json_response(upload_view(upload, offset), headers={OFFSET: str(offset)})


async def append_piece(request: web.Request) -> tuple[Upload, int]:
    """The request's body appended to the upload `{id}` at its `Upload-Offset`, and the
    upload completed when that made it whole; the upload and where it now stands."""
    store = request.app[STORE]
    settings = request.app[SETTINGS]
    upload = await store.run(store.sync.uploads.get, request.match_info["id"])
    if upload.state != "open":
        raise ApiError(ErrorCode.job_finished, f"upload {upload.id} has ended ({upload.state})")
    offset = await stands_at(request, upload)
    given = request.headers.get(OFFSET, "")
    if not given.isdigit() or int(given) != offset:
        raise ApiError(
            ErrorCode.upload_offset_mismatch,
            f"the upload stands at {offset} bytes; send the piece from there",
        )
    part = _part(settings, upload.id)
    with part.open("ab") as out:
        async for piece in request.content.iter_chunked(CHUNK):
            if offset + len(piece) > upload.size_bytes:
                raise ApiError(
                    ErrorCode.request_too_large,
                    f"the piece runs past the upload's {upload.size_bytes} bytes",
                )
            await asyncio.to_thread(out.write, piece)
            offset += len(piece)
    if offset == upload.size_bytes:
        upload = await _complete(request, upload, part)
    return upload, offset


async def _complete(request: web.Request, upload: Upload, part: Path) -> Upload:
    """The whole file: checked, inspected, registered; or the upload failed, saying why."""
    store = request.app[STORE]
    settings = request.app[SETTINGS]
    sha256 = await asyncio.to_thread(_sha256, part)
    why = None
    if upload.sha256 is not None and sha256 != upload.sha256:
        why = f"the file's sha256 is {sha256}, not {upload.sha256}: deleted"
    else:
        try:
            inspection = await asyncio.to_thread(inspect, part)
        except PullError as err:
            why = str(err)
    if why is not None:
        await asyncio.to_thread(part.unlink, missing_ok=True)
        await store.run(store.sync.uploads.end, upload.id, "failed", why)
        raise ApiError(ErrorCode.invalid_value, why, param="sha256" if "sha256" in why else None)
    await asyncio.to_thread(_keep, part, settings.artifacts_dir / sha256)
    model = ModelArtifact(
        upload.name, upload.version, sha256, upload.size_bytes, "gguf",
        upload.memory_mib or inspection.replica_mib(upload.size_bytes), "upload", None,
        inspection.as_json(),
    )  # fmt: skip
    try:
        return await store.run(store.sync.uploads.finish, upload.id, model)
    except ConflictError as err:
        raise ApiError(ErrorCode.job_finished, str(err)) from err


def _keep(part: Path, target: Path) -> None:
    """The checked file kept under its sha256 (once: another model may hold the same)."""
    if target.exists():
        part.unlink()
    else:
        part.replace(target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(CHUNK):
            digest.update(piece)
    return digest.hexdigest()


async def cancel_upload(request: web.Request) -> web.Response:
    store = request.app[STORE]
    try:
        upload = await store.run(store.sync.uploads.end, request.match_info["id"], "cancelled")
    except ConflictError as err:
        raise ApiError(ErrorCode.job_finished, str(err)) from err
    await asyncio.to_thread(_part(request.app[SETTINGS], upload.id).unlink, missing_ok=True)
    return web.json_response(upload_view(upload, 0))


ROUTES = (
    Route(
        "POST",
        "/v1/admin/models/uploads",
        create_upload,
        "Start an upload of a model file the operator holds (resumable; `Upload-Offset: 0`).",
        Auth.operator,
        UploadRequest,
        status=201,
    ),
    Route(
        "GET",
        "/v1/admin/models/uploads/{id}",
        get_upload,
        "An upload: its state, where it stands (`offset`), the model it registered or why not.",
        Auth.operator,
        errors=(ErrorCode.not_found,),
    ),
    Route(
        "PATCH",
        "/v1/admin/models/uploads/{id}",
        append,
        "The next piece of an upload at `Upload-Offset`; the last one registers the model.",
        Auth.operator,
        errors=(
            ErrorCode.not_found,
            ErrorCode.upload_offset_mismatch,
            ErrorCode.job_finished,
            ErrorCode.request_too_large,
        ),
    ),
    Route(
        "DELETE",
        "/v1/admin/models/uploads/{id}",
        cancel_upload,
        "Cancel an upload that has not ended (409 `job_finished` once it has).",
        Auth.operator,
        errors=(ErrorCode.not_found, ErrorCode.job_finished),
    ),
)
