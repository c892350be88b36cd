"""Site bundles through the admin API (appliance/bundles.py): a node without a hub takes its
models, release, packages and settings from a signed file an admin uploads in pieces.

- `POST /v1/admin/bundles` with the file's `size`: an upload, `Upload-Offset: 0`, refused
  at once when twice its size would not fit on the data disk;
- `PATCH /v1/admin/bundles/{id}` with `Upload-Offset: N` and the next bytes as the body:
  appended where the upload stands (409 `upload_offset_mismatch` anywhere else, its
  message saying where), never past its size; the last piece makes it whole, and the node
  checks and applies it in the background (`checking`);
- `GET /v1/admin/bundles`: every upload the node keeps, newest first, those it took from a
  USB stick too (`source`);
- `GET /v1/admin/bundles/{id}`: where it stands (`offset`), its state, what was applied or
  which part failed;
- `DELETE /v1/admin/bundles/{id}` cancels it (or forgets one that ended).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from appliance.bundles import Bundles, Upload
from appliance.gateway.front import BUNDLES_ROUTE
from appliance.gateway.parsing import read_json
from appliance.inference.schemas import parse_body
from shared.errors import ApiError, ErrorCode

BUNDLES = web.AppKey("bundles", Bundles)
OFFSET = "Upload-Offset"
_CHUNK = 1 << 20


class BundleUploadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=1, le=1 << 42, description="The bundle file's size in bytes.")


def _view(upload: Upload, offset: int) -> dict[str, Any]:
    return {"object": "bundle_upload", **asdict(upload), "offset": offset}


async def create_upload(request: web.Request) -> web.Response:
    req = parse_body(BundleUploadRequest, await read_json(request))
    bundles = request.app[BUNDLES]
    upload = await asyncio.to_thread(bundles.create, req.size)
    return web.json_response(
        _view(upload, 0),
        status=201,
        headers={OFFSET: "0", "Location": f"{BUNDLES_ROUTE}/{upload.id}"},
    )


async def list_uploads(request: web.Request) -> web.Response:
    bundles = request.app[BUNDLES]
    uploads = await asyncio.to_thread(bundles.uploads)
    views = [_view(u, await asyncio.to_thread(bundles.offset, u)) for u in uploads]
    return web.json_response({"object": "list", "data": views})


async def get_upload(request: web.Request) -> web.Response:
    bundles = request.app[BUNDLES]
    upload = await asyncio.to_thread(bundles.get, request.match_info["id"])
    offset = await asyncio.to_thread(bundles.offset, upload)
    return web.json_response(_view(upload, offset), headers={OFFSET: str(offset)})


async def append(request: web.Request) -> web.Response:
    given = request.headers.get(OFFSET, "")
    if not given.isascii() or not given.isdigit() or len(given) > 15:
        raise ApiError(
            ErrorCode.invalid_value, f"send the piece's `{OFFSET}` (a byte offset)", param=OFFSET
        )
    bundles = request.app[BUNDLES]
    upload = await bundles.append(
        request.match_info["id"], int(given), request.content.iter_chunked(_CHUNK)
    )
    offset = await asyncio.to_thread(bundles.offset, upload)
    return web.json_response(_view(upload, offset), headers={OFFSET: str(offset)})


async def cancel(request: web.Request) -> web.Response:
    await request.app[BUNDLES].cancel(request.match_info["id"])
    return web.Response(status=204)
