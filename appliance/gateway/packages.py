"""`/v1/packages`: ask for a content package (a job, or the finished package with
`"wait": true`), list and search the package cache, fetch a package's manifest, its files
(ETag and Range, verified against their sha256 first) and its LMS exports; pin one.

The cache serves on the LAN whether or not the hub is reachable. A key sees the packages
its account asked for and the ones the hub seeded; an admin key sees them all."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from functools import partial
from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from appliance.gateway.appkeys import ADMISSION, METRICS, REQUEST_KEY, STORE, api_key
from appliance.gateway.front import (
    BLOB_HEADER,
    CACHE_CONTROL_HEADER,
    CHECK_HEADER,
    FRONT,
    METHOD_HEADER,
    TOKEN_HEADER,
    TYPE_HEADER,
    blob_name,
    may_send,
)
from appliance.gateway.jobs import JOBS
from appliance.gateway.parsing import read_json
from appliance.inference.authentication import authenticate
from appliance.inference.schemas import parse_body
from appliance.jobs.bodies import job_object
from appliance.packages.cache import CorruptBlobError, NotCachedError
from appliance.packages.exports import (
    ExportError,
    Library,
    export_h5p,
    export_moodle_xml,
    export_qti3,
    h5p_libraries,
)
from appliance.packages.model import PackageRequest
from appliance.packages.service import PackageService, package_summary, package_view
from appliance.state.jobs import NewItem
from shared.blobs import IMMUTABLE, REVALIDATE, satisfiable, send_blob
from shared.errors import ApiError, DomainError, ErrorCode
from shared.oci import BUNDLE_MEDIA_TYPE

if TYPE_CHECKING:
    from io import BufferedReader

    from appliance.packages.cache import CachedPackage, PackageCache
    from appliance.packages.model import FileEntry

log = logging.getLogger(__name__)

PACKAGES = web.AppKey("packages", PackageService)
PACKAGES_URL = "/v1/packages"
EXPORTS = {
    "h5p": ("application/zip", ".h5p"),
    "moodle-xml": ("application/xml", ".xml"),
    "qti3": ("application/zip", ".qti.zip"),
    "oci": (BUNDLE_MEDIA_TYPE, ".oci.tar"),  # for `kvl hub packages add`: pre-seeding
}


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pinned: bool = True
    version: str | None = None


def _service(request: web.Request) -> PackageService:
    return request.app[PACKAGES]


def _cache(request: web.Request) -> PackageCache:
    return _service(request).cache


async def _get(request: web.Request) -> CachedPackage:
    """The package the path names (the newest version the caller's account may see, unless
    `?version=`); another account's is not found (404), never forbidden."""
    cache = _cache(request)
    visible = await _service(request).visible(api_key(request))
    try:
        return await asyncio.to_thread(
            partial(cache.get, visible=visible),
            request.match_info["id"],
            request.query.get("version"),
        )
    except NotCachedError as err:
        raise ApiError(ErrorCode.package_not_found, str(err)) from err


async def create_package(request: web.Request) -> web.Response:
    body = await read_json(request)
    req = parse_body(PackageRequest, body)
    key = api_key(request)
    if req.wait:
        cached = await _service(request).create(req, key)
        return web.json_response(package_view(cached), headers=_etag(cached))
    item = NewItem(custom_id="package", url=PACKAGES_URL, body=req.model_dump(mode="json"))
    job = await request.app[JOBS].create(key, [item], models={}, metadata={}, webhook_url=None)
    return web.json_response(
        job_object(job), status=202, headers={"Location": f"/v1/jobs/{job.id}"}
    )


async def list_packages(request: web.Request) -> web.Response:
    try:
        limit = min(200, max(1, int(request.query.get("limit", "50"))))
        offset = max(0, int(request.query.get("offset", "0")))
    except ValueError as err:
        raise ApiError(
            ErrorCode.invalid_value, "limit and offset are integers", param="limit"
        ) from err
    # A key sees its account's packages and those the hub seeded; an admin key, all.
    visible = await _service(request).visible(api_key(request))
    found = await asyncio.to_thread(
        _cache(request).list,
        query=request.query.get("q"),
        limit=limit,
        offset=offset,
        visible=visible,
    )
    return web.json_response({"object": "list", "data": [package_summary(p) for p in found]})


async def get_package(request: web.Request) -> web.Response:
    cached = await _get(request)
    headers = _etag(cached)
    if request.headers.get("If-None-Match") == headers["ETag"]:
        return web.Response(status=304, headers=headers)
    return web.json_response(package_view(cached), headers=headers)


async def package_file(request: web.Request) -> web.StreamResponse:
    """One file of a package, checked against its sha256 before it is served."""
    entry, blob, asked = await _open_file(request)
    with blob:
        # A named version never changes; the newest may.
        return await send_blob(
            request,
            blob,
            sha256=entry.sha256,
            media_type=entry.media_type,
            cache_control=IMMUTABLE if asked else REVALIDATE,
        )


async def decide_file(request: web.Request) -> web.Response:
    """The TLS front's question (front.py): may nginx send this package file itself? 200
    with the blob's name and the headers to send, after every check `package_file` makes;
    204 where the app answers itself (a refusal, a condition, a range of its own). Only the
    front's nginx, with its token, is answered: to anyone else this is no route (404)."""
    front = request.get(FRONT)
    token = request.headers.get(TOKEN_HEADER, "").encode()
    if front is None or front.blobs is None or not hmac.compare_digest(token, front.token.encode()):
        raise web.HTTPNotFound
    if not may_send(request.headers.get(METHOD_HEADER, ""), request.headers):
        return web.Response(status=204)
    app = request.app
    try:
        # Only asked: a refusal is counted (and throttled) when the app makes it.
        request[REQUEST_KEY] = await authenticate(
            request.headers.get("Authorization", ""),
            request.remote or "unknown",
            store=app[STORE],
            admission=app[ADMISSION],
            metrics=app[METRICS],
            count=False,
        )
        entry, blob, asked = await _open_file(request)
    except DomainError:
        return web.Response(status=204)
    with blob:
        name = blob_name(entry.sha256)
        printable = entry.media_type.isascii() and entry.media_type.isprintable()
        size = os.fstat(blob.fileno()).st_size
        if name is None or not printable or not satisfiable(request, size):
            return web.Response(status=204)  # the app's own answer says what is wrong
        try:
            front.share(blob.fileno())
        except OSError as err:  # nginx could not read it: the app sends it
            log.warning("the front's workers cannot be let read %s: %s", name, err)
            return web.Response(status=204)
    return web.Response(
        status=200,
        headers={
            BLOB_HEADER: name,
            TYPE_HEADER: entry.media_type,
            CACHE_CONTROL_HEADER: IMMUTABLE if asked else REVALIDATE,
            # For this Authorization header only: nginx's cache keeps this, not the header.
            CHECK_HEADER: front.check(request.headers.get("Authorization", "")),
        },
    )


async def _open_file(request: web.Request) -> tuple[FileEntry, BufferedReader, str | None]:
    """The file the path names, its blob open and known good, and the `?version=` asked.
    The common case (a blob already known good) is answered on the loop; the rest waits on
    a thread."""
    cache = _cache(request)
    package_id, path = request.match_info["id"], request.match_info["path"]
    version = asked = request.query.get("version")
    if not api_key(request).admin:  # the version the caller's account may see, or a 404
        version = (await _get(request)).version
    try:
        opened = cache.try_open_blob(package_id, version, path)
        if opened is None:
            opened = await asyncio.to_thread(cache.open_blob, package_id, version, path)
    except NotCachedError as err:
        raise ApiError(ErrorCode.package_not_found, str(err)) from err
    except CorruptBlobError as err:
        raise ApiError(ErrorCode.package_corrupt, str(err), retry_after=1) from err
    entry, blob = opened
    return entry, blob, asked


async def package_export(request: web.Request) -> web.Response:
    form = request.match_info["format"]
    if form not in EXPORTS:
        raise ApiError(
            ErrorCode.invalid_value,
            f"exports are {', '.join(EXPORTS)}; not {form!r}",
            param="format",
        )
    libraries: dict[Library, Library] = {}
    if "libraries" in request.query:
        if form != "h5p":
            raise ApiError(
                ErrorCode.invalid_value, "`libraries` names H5P library versions", param="libraries"
            )
        try:
            libraries = h5p_libraries(request.query["libraries"][:1000])
        except ExportError as err:
            raise ApiError(ErrorCode.invalid_value, str(err), param="libraries") from err
    cached = await _get(request)
    media_type, suffix = EXPORTS[form]
    try:
        data = await asyncio.to_thread(_export, _cache(request), cached, form, libraries)
    except CorruptBlobError as err:
        raise ApiError(ErrorCode.package_corrupt, str(err), retry_after=1) from err
    except ExportError as err:
        raise ApiError(ErrorCode.package_validation_failed, f"{form}: {err}") from err
    name = f"{cached.id}-{cached.version}{suffix}"
    return web.Response(
        body=data,
        headers={
            "Content-Type": media_type,
            "Content-Disposition": f'attachment; filename="{name}"',
        },
    )


async def pin_package(request: web.Request) -> web.Response:
    body = await read_json(request)
    req = parse_body(PinRequest, body)
    cache = _cache(request)
    package_id = request.match_info["id"]
    try:
        version = req.version or (await asyncio.to_thread(cache.get, package_id)).version
        cached = await asyncio.to_thread(cache.pin, package_id, version, req.pinned)
    except NotCachedError as err:
        raise ApiError(ErrorCode.package_not_found, str(err)) from err
    return web.json_response(package_summary(cached))


def _export(
    cache: PackageCache, cached: CachedPackage, form: str, libraries: dict[Library, Library]
) -> bytes:
    if form == "oci":
        return cache.bundle(cached.id, cached.version)
    files = _read_files(cache, cached)
    if form == "moodle-xml":
        return export_moodle_xml(cached.manifest, files)
    if form == "h5p":
        return export_h5p(cached.manifest, files, libraries)
    return export_qti3(cached.manifest, files)


def _read_files(cache: PackageCache, cached: CachedPackage) -> dict[str, bytes]:
    """Every file of a package, each verified (CorruptBlobError otherwise)."""
    out: dict[str, bytes] = {}
    for entry in cached.manifest.files:
        _, blob = cache.open_file(cached.id, cached.version, entry.path)
        out[entry.path] = blob.read_bytes()
    return out


def _etag(cached: CachedPackage) -> dict[str, str]:
    return {"ETag": f'"{cached.digest.removeprefix("sha256:")}"'}
