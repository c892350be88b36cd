"""The node settings the hub sets (hub/state/configuration.py), over the operator API:
every value by scope, one node's with where each came from, and a value set or unset at
once (a staged change is a rollout: `POST /v1/admin/rollouts` of kind `settings`)."""

from __future__ import annotations

from aiohttp import web

from hub.api.requests import SettingRequest
from hub.api.route_kinds import Auth, Route
from hub.appkeys import OPERATOR, STORE
from hub.http import parse
from hub.state.configuration import scope_of
from hub.state.errors import InvalidError
from hub.views import configuration_view
from shared.errors import ApiError, ErrorCode


async def list_settings(request: web.Request) -> web.Response:
    store = request.app[STORE]
    rows = await store.run(store.sync.configuration.all)
    return web.json_response(
        {"data": [{"scope": s.scope, "key": s.key, "value": s.value} for s in rows]}
    )


async def node_settings(request: web.Request) -> web.Response:
    store = request.app[STORE]

    def view() -> dict[str, object]:
        node = store.sync.nodes.get(request.match_info["node"])
        return configuration_view(node, store.sync.configuration)

    return web.json_response(await store.run(view))


async def put_setting(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, SettingRequest)

    def write() -> tuple[str, int]:
        node_id = store.sync.nodes.get(req.node).id if req.node is not None else None
        scope = scope_of(req.site, node_id)
        by = request[OPERATOR]
        return scope, store.sync.configuration.set(scope, req.key, req.value, by=by)

    try:
        scope, serial = await store.run(write)
    except InvalidError as err:
        raise ApiError(ErrorCode.invalid_value, str(err), param=err.param) from err
    return web.json_response({"scope": scope, "key": req.key, "value": req.value,
                              "desired_serial": serial})  # fmt: skip


ROUTES = (
    Route(
        "GET",
        "/v1/admin/settings",
        list_settings,
        "The node settings the hub sets, by scope (fleet, site:NAME, node:ID).",
        Auth.operator,
    ),
    Route(
        "PUT",
        "/v1/admin/settings",
        put_setting,
        "Set (or with a null value unset) one node setting, fleet-wide or for a site or node.",
        Auth.operator,
        SettingRequest,
        errors=(ErrorCode.not_found,),
    ),
    Route(
        "GET",
        "/v1/admin/nodes/{node}/settings",
        node_settings,
        "What the hub sets of one node's settings, whence each value, and if it applied them.",
        Auth.operator,
        errors=(ErrorCode.not_found,),
    ),
)
