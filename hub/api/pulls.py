"""`POST /v1/admin/models`: a model pulled into the hub as a durable job (hub/models/jobs.py
runs it), answered at once with the job; `GET /v1/admin/models/pulls[/{id}]` its progress;
`DELETE` cancels it. A reference that names nothing pullable is refused before anything is
queued."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from aiohttp import web

from hub.api.requests import PullRequest
from hub.api.route_kinds import Auth, Route
from hub.appkeys import OPERATOR, PULLS, STORE
from hub.http import parse
from hub.models.reference import BadReferenceError, parse_reference
from hub.state.errors import ConflictError
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from hub.state.pulls import Pull


def pull_view(pull: Pull) -> dict[str, Any]:
    return asdict(pull)


async def start_pull(request: web.Request) -> web.Response:
    req = await parse(request, PullRequest)
    try:
        parse_reference(req.reference)
    except BadReferenceError as err:
        raise ApiError(ErrorCode.invalid_value, str(err), param="reference") from err
    store = request.app[STORE]
    pull = await store.run(
        store.sync.pulls.create,
        req.reference,
        req.name,
        req.version,
        req.memory_mib,
        request[OPERATOR],
    )
    if PULLS in request.app:
        request.app[PULLS].wake.set()
    return web.json_response(
        pull_view(pull), status=202, headers={"Location": f"/v1/admin/models/pulls/{pull.id}"}
    )


async def list_pulls(request: web.Request) -> web.Response:
    store = request.app[STORE]
    pulls = await store.run(store.sync.pulls.recent)
    return web.json_response({"data": [pull_view(p) for p in pulls]})


async def get_pull(request: web.Request) -> web.Response:
    store = request.app[STORE]
    return web.json_response(
        pull_view(await store.run(store.sync.pulls.get, request.match_info["id"]))
    )


async def cancel_pull(request: web.Request) -> web.Response:
    store = request.app[STORE]
    try:
        pull = await store.run(store.sync.pulls.cancel, request.match_info["id"])
    except ConflictError as err:
        raise ApiError(ErrorCode.job_finished, str(err)) from err
    return web.json_response(pull_view(pull))


ROUTES = (
    Route(
        "POST",
        "/v1/admin/models",
        start_pull,
        "Pull a model into the hub (hf://… or https://): a job, answered at once (202).",
        Auth.operator,
        PullRequest,
        status=202,
    ),
    Route(
        "GET",
        "/v1/admin/models/pulls",
        list_pulls,
        "The latest model pulls and their progress.",
        Auth.operator,
    ),
    Route(
        "GET",
        "/v1/admin/models/pulls/{id}",
        get_pull,
        "A model pull: its state, bytes so far and total, the model it registered or its error.",
        Auth.operator,
        errors=(ErrorCode.not_found,),
    ),
    Route(
        "DELETE",
        "/v1/admin/models/pulls/{id}",
        cancel_pull,
        "Cancel a model pull that has not finished (409 `job_finished` once it has).",
        Auth.operator,
        errors=(ErrorCode.not_found, ErrorCode.job_finished),
    ),
)
