"""The hub's operator API (`/v1/admin/…`): what `kvl hub …` does, over HTTPS, for the
console and for tools. Every call carries an operator token (`kvl hub operators
create`); handlers are thin: parse (hub/api/requests.py), call the store, answer a view
(hub/views.py). What the store finds missing is a 404, said once, in the middleware,
which guards the other operator modules' routes too (alerts, objectives, rollouts, logs,
`/metrics`).
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from hub.api.logs import LOGS_ROUTE
from hub.api.metrics import METRICS_ROUTE
from hub.api.requests import (
    DeploymentRequest,
    DrainRequest,
    KeyRequest,
    NodeTenancyRequest,
    SeedRequest,
    TenancyRequest,
    TokenRequest,
    storable,
)
from hub.api.route_kinds import Auth, Param, Route
from hub.appkeys import LOOPS, OPERATOR, RUNNING, SETTINGS, STORE
from hub.http import Handler, bearer, parse
from hub.loops import report
from hub.packages import MAX_BUNDLE, keep_bundle
from hub.state.errors import NotFoundError
from hub.views import deployment_view, node_view, package_view, quota_view, token_view
from shared.errors import ApiError, ErrorCode
from shared.oci import LayoutError


@web.middleware
async def operator_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Operator routes (`/v1/admin/…`, and `/metrics`): an operator token, text the store
    can hold; and the store's NotFoundError, from any handler, a 404 naming the field that
    named it."""
    if not request.path.startswith("/v1/admin/") and request.path != "/metrics":
        return await handler(request)
    token = bearer(request)
    store = request.app[STORE]
    name = await store.run(store.sync.operators.authenticate, token) if token else None
    if name is None:
        raise ApiError(
            ErrorCode.invalid_operator_token,
            "send an operator token as `Authorization: Bearer`; make one with "
            "`kvl hub operators create --name NAME`",
        )
    request[OPERATOR] = name
    # The same for the path's values and the query's (a node name, `?q=`).
    if not all(storable(t) for t in (request.path, *request.query.keys(), *request.query.values())):
        raise ApiError(
            ErrorCode.invalid_value,
            "a NUL character or a lone surrogate in the path or the query",
        )
    try:
        return await handler(request)
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err), param=err.param) from err


async def list_nodes(request: web.Request) -> web.Response:
    nodes = await request.app[STORE].nodes()
    now = time.time()
    settings = request.app[SETTINGS]
    return web.json_response({"data": [node_view(n, settings, now) for n in nodes]})


async def drain_node(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, DrainRequest)
    node = await store.run(
        lambda: store.sync.nodes.set_draining(request.match_info["node"], draining=req.draining)
    )
    return web.json_response(node_view(node, request.app[SETTINGS], time.time()))


async def set_node_tenancy(request: web.Request) -> web.Response:
    """Set a node's tenancy (dedicated to a tenant, private, or shared); the node as it
    now is."""
    store = request.app[STORE]
    req = await parse(request, NodeTenancyRequest)
    node = await store.run(store.sync.nodes.get, request.match_info["node"])
    await store.run(
        lambda: store.sync.accounts.set_node_tenancy(node, tenant=req.tenant, private=req.private)
    )
    changed = await store.run(store.sync.nodes.get, node.id)
    return web.json_response(node_view(changed, request.app[SETTINGS], time.time()))


async def revoke_node(request: web.Request) -> web.Response:
    node = await request.app[STORE].revoke_node(request.match_info["node"])
    return web.json_response(node_view(node, request.app[SETTINGS], time.time()))


async def list_accounts(request: web.Request) -> web.Response:
    store = request.app[STORE]
    rows = await store.run(store.sync.accounts.all)
    return web.json_response({"data": [dict(r) for r in rows]})


async def set_tenancy(request: web.Request) -> web.Response:
    """Bind an account to a tenant and sites, or to none; the account as it now is."""
    store = request.app[STORE]
    name = request.match_info["name"]
    req = await parse(request, TenancyRequest)
    await store.run(store.sync.accounts.set_tenancy, name, req.tenancy())
    rows = await store.run(store.sync.accounts.all)
    return web.json_response(next(dict(r) for r in rows if r["name"] == name))


async def account_quota(request: web.Request) -> web.Response:
    store = request.app[STORE]
    name = request.match_info["name"]
    quota = await store.run(store.sync.leases.quota, name, time.time())
    if quota is None:
        raise ApiError(ErrorCode.not_found, f"account {name!r} has no budget")
    return web.json_response(quota_view(quota, await store.node_names()))


async def list_deployments(request: web.Request) -> web.Response:
    store = request.app[STORE]
    rows = await store.run(store.sync.deployments.all)
    placed = await store.run(store.sync.deployments.placements)
    names = await store.node_names()
    return web.json_response({"data": [deployment_view(d, placed, names) for d in rows]})


async def create_deployment(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, DeploymentRequest)
    record = req.record()
    await store.run(store.sync.deployments.add, record)
    return web.json_response(deployment_view(record, [], {}), status=201)


async def delete_deployment(request: web.Request) -> web.Response:
    store = request.app[STORE]
    await store.run(store.sync.deployments.remove, request.match_info["id"])
    return web.json_response({"id": request.match_info["id"], "deleted": True})


async def list_models(request: web.Request) -> web.Response:
    store = request.app[STORE]
    models = await store.run(store.sync.deployments.models)
    data = [
        {"ref": m.ref, "sha256": m.sha256, "size_bytes": m.size_bytes, "memory_mib": m.memory_mib}
        for m in models
    ]
    return web.json_response({"data": data})


async def list_tokens(request: web.Request) -> web.Response:
    store = request.app[STORE]
    now = time.time()
    return web.json_response(
        {"data": [token_view(t, now) for t in await store.run(store.sync.tokens.all)]}
    )


async def create_token(request: web.Request) -> web.Response:
    """A new enrollment token; its secret is in this answer only."""
    store = request.app[STORE]
    req = await parse(request, TokenRequest)
    new = await store.run(
        lambda: store.sync.tokens.create(
            req.site,
            uses=req.uses,
            expires_in_s=req.expires_in_s,
            tenant=req.tenant,
            private=req.private,
        )
    )
    found = next(t for t in await store.run(store.sync.tokens.all) if t.prefix == new.prefix)
    return web.json_response({"token": new.plaintext, **token_view(found, time.time())}, status=201)


async def revoke_token(request: web.Request) -> web.Response:
    store = request.app[STORE]
    token = await store.run(store.sync.tokens.revoke, request.match_info["prefix"])
    return web.json_response(token_view(token, time.time()))


async def create_key(request: web.Request) -> web.Response:
    """A new fleet API key; its secret is in this answer only (nodes get its hash)."""
    store = request.app[STORE]
    req = await parse(request, KeyRequest)
    new = await store.run(lambda: store.sync.accounts.create_key(req.account, admin=req.admin))
    return web.json_response(
        {"key": new.plaintext, "prefix": new.prefix, "account": req.account, "admin": req.admin},
        status=201,
    )


async def revoke_key(request: web.Request) -> web.Response:
    store = request.app[STORE]
    prefix = request.match_info["prefix"]
    await store.run(store.sync.accounts.revoke_key, prefix)
    return web.json_response({"prefix": prefix, "revoked": True})


async def list_packages(request: web.Request) -> web.Response:
    store = request.app[STORE]
    found = await store.run(store.sync.packages.find, request.query.get("q"))
    names = await store.node_names()
    return web.json_response({"data": [package_view(p, names) for p in found]})


async def add_package(request: web.Request) -> web.Response:
    """The body is a package archive (`GET /v1/packages/{id}/exports/oci` on an appliance);
    `?seed=all` or `?seed=SITE` seeds it at once."""
    store = request.app[STORE]
    data = bytearray()
    async for chunk in request.content.iter_chunked(1 << 20):
        data += chunk
        if len(data) > MAX_BUNDLE:
            raise ApiError(
                ErrorCode.request_too_large, f"a package archive is at most {MAX_BUNDLE} bytes"
            )
    artifacts_dir = request.app[SETTINGS].artifacts_dir
    try:
        summary, sha256 = await asyncio.to_thread(keep_bundle, artifacts_dir, bytes(data))
    except LayoutError as err:
        raise ApiError(ErrorCode.invalid_value, f"not a package archive: {err}") from err
    await store.run(store.sync.packages.add_bundle, summary, sha256, len(data))
    if seed := request.query.get("seed"):
        site = None if seed == "all" else seed
        await store.run(store.sync.packages.seed, summary["id"], summary["version"], site)
    return await _package(request, summary["id"], summary["version"], status=201)


async def seed_package(request: web.Request) -> web.Response:
    store = request.app[STORE]
    req = await parse(request, SeedRequest)
    package_id = request.match_info["id"]
    await store.run(store.sync.packages.seed, package_id, req.version, req.site)
    return await _package(request, package_id, req.version)


async def unseed_package(request: web.Request) -> web.Response:
    store = request.app[STORE]
    package_id, version = request.match_info["id"], request.query.get("version")
    await store.run(store.sync.packages.unseed, package_id, version)
    return await _package(request, package_id, version)


async def _package(
    request: web.Request, package_id: str, version: str | None, status: int = 200
) -> web.Response:
    store = request.app[STORE]
    found = [p for p in await store.run(store.sync.packages.find, package_id) if p.id == package_id]
    match = next((p for p in found if version in {None, p.version}), None)
    if match is None:
        raise ApiError(ErrorCode.not_found, f"no package {package_id}")
    return web.json_response(package_view(match, await store.node_names()), status=status)


async def list_loops(request: web.Request) -> web.Response:
    """The hub's background loops: which run, and each one's failed rounds."""
    return web.json_response(report(request.app[RUNNING], request.app[LOOPS]))


_NOT_FOUND = (ErrorCode.not_found,)
ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/admin/nodes",
        list_nodes,
        "Every node: site, status, versions, capacity.",
        Auth.operator,
    ),
    Route(
        "POST",
        "/v1/admin/nodes/{node}/drain",
        drain_node,
        "Drain a node (by id or name), or end its drain.",
        Auth.operator,
        DrainRequest,
        errors=_NOT_FOUND,
    ),
    Route(
        "POST",
        "/v1/admin/nodes/{node}/tenancy",
        set_node_tenancy,
        "Set a node's tenancy (by id or name): dedicated to a tenant, private, or shared.",
        Auth.operator,
        NodeTenancyRequest,
        errors=_NOT_FOUND,
    ),
    Route(
        "POST",
        "/v1/admin/nodes/{node}/revoke",
        revoke_node,
        "Revoke a node.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    LOGS_ROUTE,
    Route(
        "GET",
        "/v1/admin/accounts",
        list_accounts,
        "Accounts: class, quotas, budget.",
        Auth.operator,
    ),
    Route(
        "GET",
        "/v1/admin/accounts/{name}/quota",
        account_quota,
        "An account's budget this period: consumed, leased per node, remaining.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "PUT",
        "/v1/admin/accounts/{name}/tenancy",
        set_tenancy,
        "Bind an account to a tenant and sites, or to none (a shared account).",
        Auth.operator,
        TenancyRequest,
        errors=_NOT_FOUND,
    ),
    Route(
        "GET", "/v1/admin/models", list_models, "The model files the hub can place.", Auth.operator
    ),
    Route(
        "GET",
        "/v1/admin/deployments",
        list_deployments,
        "Deployments and where their replicas run.",
        Auth.operator,
    ),
    Route(
        "POST",
        "/v1/admin/deployments",
        create_deployment,
        "Deploy a model.",
        Auth.operator,
        DeploymentRequest,
        status=201,
        errors=_NOT_FOUND,
    ),
    Route(
        "DELETE",
        "/v1/admin/deployments/{id}",
        delete_deployment,
        "Undeploy.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "GET",
        "/v1/admin/tokens",
        list_tokens,
        "Enrollment tokens, without their secrets.",
        Auth.operator,
    ),
    Route(
        "POST",
        "/v1/admin/tokens",
        create_token,
        "Make an enrollment token; its secret is in this answer only.",
        Auth.operator,
        TokenRequest,
        status=201,
    ),
    Route(
        "POST",
        "/v1/admin/tokens/{prefix}/revoke",
        revoke_token,
        "Revoke an enrollment token.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "POST",
        "/v1/admin/keys",
        create_key,
        "Make a fleet API key; its secret is in this answer only.",
        Auth.operator,
        KeyRequest,
        status=201,
        errors=_NOT_FOUND,
    ),
    Route(
        "POST",
        "/v1/admin/keys/{prefix}/revoke",
        revoke_key,
        "Revoke a fleet API key.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "GET",
        "/v1/admin/packages",
        list_packages,
        "Packages across the fleet.",
        Auth.operator,
        params=(Param("q", "query", "words to look for", {"type": "string"}),),
    ),
    Route(
        "POST",
        "/v1/admin/packages",
        add_package,
        "Keep a package archive (the body), seeding it at once with `seed`.",
        Auth.operator,
        status=201,
        body_type="application/octet-stream",
        errors=(ErrorCode.request_too_large,),
        params=(Param("seed", "query", "`all`, or a site", {"type": "string"}),),
    ),
    Route(
        "POST",
        "/v1/admin/packages/{id}/seed",
        seed_package,
        "Seed a held package (the newest version, every node, unless named).",
        Auth.operator,
        SeedRequest,
        errors=_NOT_FOUND,
    ),
    Route(
        "DELETE",
        "/v1/admin/packages/{id}/seed",
        unseed_package,
        "Stop seeding a package.",
        Auth.operator,
        errors=_NOT_FOUND,
        params=(Param("version", "query", "one version only", {"type": "string"}),),
    ),
    METRICS_ROUTE,
    Route(
        "GET",
        "/v1/admin/loops",
        list_loops,
        "The hub's background loops: those running, any stopped, each one's failed "
        "rounds (count, last error, when).",
        Auth.operator,
    ),
)
