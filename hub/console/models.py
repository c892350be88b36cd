"""The console's Add model page (`/console/models`): the models the hub holds, a pull by
reference (the hub's pull job, as `POST /v1/admin/models` starts it), and an upload of a
file from the browser in pieces (hub/api/uploads.py's calls, resumable); the pulls' and
uploads' progress live (server-sent events from `/console/models/stream`).

The browser's upload calls are the page's own (`/console/models/uploads…`): the login's
session, from this console's origin, with the session's CSRF token in `X-CSRF-Token`;
their answers are the operator API's (JSON, the one error shape)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import ValidationError

from hub.api.requests import PullRequest, UploadRequest
from hub.api.uploads import append_piece, begin, stands_at, upload_view
from hub.appkeys import PULLS
from hub.console.auth import same_token
from hub.console.sse import stream
from hub.console.web import (
    FORM,
    SESSION,
    current_session,
    from_here,
    hub_store,
    page,
    render,
    see_other,
)
from hub.models.reference import BadReferenceError, parse_reference
from shared.errors import ApiError, ErrorCode, error_body

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from hub.state.store import AsyncHubStore

CSRF_HEADER = "X-CSRF-Token"
SHOWN = 20  # pulls and uploads on the page, newest first


async def progress(store: AsyncHubStore) -> dict[str, Any]:
    """The latest pulls and uploads, as the page and its stream show them."""
    pulls = await store.run(store.sync.pulls.recent)
    uploads = await store.run(store.sync.uploads.recent, SHOWN)
    return {
        "pulls": [
            {"id": p.id, "reference": p.reference, "state": p.state, "done": p.done_bytes,
             "total": p.total_bytes, "model": p.model, "error": p.error}
            for p in pulls[:SHOWN]
        ],
        "uploads": [
            {"id": u.id, "name": f"{u.name}@{u.version}", "state": u.state,
             "total": u.size_bytes, "model": u.model, "error": u.error}
            for u in uploads
        ],
    }  # fmt: skip


async def _page(
    request: web.Request, *, status: int = 200, error: str | None = None
) -> web.Response:
    store = hub_store(request)
    models = await store.run(store.sync.deployments.models)
    return render(request, "models.html", status=status, error=error, models=models,
                  **await progress(store))  # fmt: skip


@page
async def models_page(request: web.Request) -> web.StreamResponse:
    return await _page(request)


@page
async def start_pull(request: web.Request) -> web.StreamResponse:
    form = request[FORM]
    given = {k: v for k, v in form.items() if k in {"reference", "name", "version"} and v}
    try:
        req = PullRequest.model_validate(given)
        parse_reference(req.reference)
    except (ValidationError, BadReferenceError) as err:
        why = err.errors()[0]["msg"] if isinstance(err, ValidationError) else str(err)
        return await _page(request, status=400, error=f"Not pulled: {why}")
    store = hub_store(request)
    await store.run(
        store.sync.pulls.create, req.reference, req.name, req.version, req.memory_mib,
        request[SESSION].user,
    )  # fmt: skip
    if PULLS in request.app:
        request.app[PULLS].wake.set()
    return see_other("/console/models", "pull-started")


async def models_stream(request: web.Request) -> web.StreamResponse:
    """`GET /console/models/stream`: `models` events with the pulls' and uploads' progress
    whenever it changes, and `logout` when the login ended."""
    store = hub_store(request)

    async def views() -> object:
        return await progress(store)

    return await stream(request, "models", views)


def _browser_call(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A call the page's script makes: a login, this origin, the session's CSRF token in
    the header; refusals and the API's errors in the one error shape."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        session = await current_session(request)
        if (
            session is None
            or not from_here(request)
            or not same_token(request.headers.get(CSRF_HEADER), session.csrf)
        ):
            body = error_body(
                ErrorCode.permission_denied, "log in to the console, and call from its pages"
            )
            return web.json_response(body, status=403)
        request[SESSION] = session
        try:
            return await handler(request)
        except ApiError as err:
            return web.json_response(err.body(), status=err.status)

    return wrapper


@_browser_call
async def create_upload(request: web.Request) -> web.StreamResponse:
    try:
        req = UploadRequest.model_validate(await request.json())
    except (ValueError, ValidationError) as err:
        why = err.errors()[0]["msg"] if isinstance(err, ValidationError) else "not JSON"
        raise ApiError(ErrorCode.invalid_value, f"not an upload: {why}") from err
    upload = await begin(request, req, request[SESSION].user)
    return web.json_response(upload_view(upload, 0), status=201)


@_browser_call
async def get_upload(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    upload = await store.run(store.sync.uploads.get, request.match_info["id"])
    return web.json_response(upload_view(upload, await stands_at(request, upload)))


@_browser_call
async def append(request: web.Request) -> web.StreamResponse:
    upload, offset = await append_piece(request)
    return web.json_response(upload_view(upload, offset))


def model_routes() -> list[web.RouteDef]:
    return [
        web.get("/console/models", models_page),
        web.get("/console/models/stream", models_stream),
        web.post("/console/models/pull", start_pull),
        web.post("/console/models/uploads", create_upload),
        web.get("/console/models/uploads/{id}", get_upload),
        web.patch("/console/models/uploads/{id}", append),
    ]
