"""The hub's operator API (`/v1/admin/…`): what `kvl hub …` does, over HTTPS, for the
console and for tools. Every call carries an operator token (`kvl hub operators
create`); handlers are thin: parse, call the store, answer a view (hub/views.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, Self

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from hub.loops import report
from hub.packages import MAX_BUNDLE, keep_bundle
from hub.state.store import DeploymentRecord, NotFoundError
from hub.views import deployment_view, node_view, package_view, quota_view, token_view
from shared import protocol
from shared.errors import ApiError, ErrorCode
from shared.oci import LayoutError

if TYPE_CHECKING:
    from hub.settings import HubSettings

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPERATOR = web.RequestKey("operator", str)

# Any text an operator sends the store: neither NUL nor a lone surrogate, which
# PostgreSQL's text cannot hold (SQLite's can), so that the driver's refusal (a 500) is a
# 400 here, on either store; the protocol's rule for what nodes send.
Text = Annotated[str, StringConstraints(max_length=200), protocol.Clean]


def _storable(text: str) -> bool:
    try:
        text.encode("utf-8")  # a lone surrogate is not UTF-8
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


@web.middleware
async def operator_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith("/v1/admin/"):
        return await handler(request)
    from hub.api import STORE, bearer  # noqa: PLC0415 - hub.api imports this module's routes

    token = bearer(request)
    store = request.app[STORE]
    name = await store.run(store.sync.authenticate_operator, token) if token else None
    if name is None:
        raise ApiError(
            ErrorCode.invalid_operator_token,
            "send an operator token as `Authorization: Bearer`; make one with "
            "`kvl hub operators create --name NAME`",
        )
    request[OPERATOR] = name
    # The same for the path's values and the query's (a node name, `?q=`).
    if not all(
        _storable(t) for t in (request.path, *request.query.keys(), *request.query.values())
    ):
        raise ApiError(
            ErrorCode.invalid_parameter,
            "a NUL character or a lone surrogate in the path or the query",
        )
    return await handler(request)


class DeploymentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text = Field(pattern=r"^[^@\s]+@[^@\s]+$", description="name@version")
    replicas: int = Field(1, ge=0, le=10_000)
    service_class: str = Field("S1", pattern=r"^S[0-4]$")
    sites: list[Text] = Field(default_factory=list, max_length=100)
    regions: list[Text] = Field(default_factory=list, max_length=100)
    labels: dict[Text, Text] = Field(default_factory=dict, max_length=32)
    gpu: bool = False
    gpu_memory_mib: int = Field(0, ge=0)
    tenant: Text | None = None

    def record(self) -> DeploymentRecord:
        """The deployment to store, with a new id."""
        return DeploymentRecord(
            id=uuid.uuid4().hex[:12],
            model=self.model,
            replicas=self.replicas,
            service_class=self.service_class,
            isolation="I1",
            constraints=self.model_dump(include={"sites", "regions", "labels", "gpu",
                                                 "gpu_memory_mib", "tenant"}),
        )  # fmt: skip

    @model_validator(mode="after")
    def _dedicated(self) -> Self:
        if self.service_class == "S3" and not self.tenant:
            raise ValueError("an S3 (dedicated) deployment names its tenant")
        return self


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    draining: bool = True


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    from hub.api import parse  # noqa: PLC0415 - hub.api imports this module's routes

    return await parse(request, model)


def _ctx(request: web.Request) -> tuple[Any, HubSettings]:
    from hub.api import SETTINGS, STORE  # noqa: PLC0415

    settings: HubSettings = request.app[SETTINGS]  # type: ignore[assignment]
    return request.app[STORE], settings


async def list_nodes(request: web.Request) -> web.Response:
    store, settings = _ctx(request)
    nodes = await store.run(store.sync.nodes)
    now = time.time()
    return web.json_response({"data": [node_view(n, settings, now) for n in nodes]})


async def drain_node(request: web.Request) -> web.Response:
    store, settings = _ctx(request)
    req: DrainRequest = await _parse(request, DrainRequest)
    try:
        node = await store.run(
            lambda: store.sync.set_draining(request.match_info["node"], draining=req.draining)
        )
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err)) from err
    return web.json_response(node_view(node, settings, time.time()))


async def revoke_node(request: web.Request) -> web.Response:
    store, settings = _ctx(request)
    try:
        node = await store.revoke_node(request.match_info["node"])
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err)) from err
    return web.json_response(node_view(node, settings, time.time()))


async def list_accounts(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    rows = await store.run(store.sync.accounts)
    return web.json_response({"data": [dict(r) for r in rows]})


async def account_quota(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    name = request.match_info["name"]
    quota = await store.run(store.sync.quota, name, time.time())
    if quota is None:
        raise ApiError(ErrorCode.not_found, f"account {name!r} has no budget")
    nodes = await store.run(store.sync.nodes)
    return web.json_response(quota_view(quota, {n.id: n.name for n in nodes}))


async def list_deployments(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    rows = await store.run(store.sync.deployments)
    placed = await store.run(store.sync.placements)
    names = {n.id: n.name for n in await store.run(store.sync.nodes)}
    return web.json_response({"data": [deployment_view(d, placed, names) for d in rows]})


async def create_deployment(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    req: DeploymentRequest = await _parse(request, DeploymentRequest)
    record = req.record()
    try:
        await store.run(store.sync.deploy, record)
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err), param="model") from err
    return web.json_response(deployment_view(record, [], {}), status=201)


async def delete_deployment(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    try:
        await store.run(store.sync.undeploy, request.match_info["id"])
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err)) from err
    return web.json_response({"id": request.match_info["id"], "deleted": True})


async def list_models(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    models = await store.run(store.sync.models)
    data = [
        {"ref": m.ref, "sha256": m.sha256, "size_bytes": m.size_bytes, "memory_mib": m.memory_mib}
        for m in models
    ]
    return web.json_response({"data": data})


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    site: Text = Field(min_length=1)
    uses: int = Field(1, ge=1, le=100_000)
    expires_in_s: float = Field(86_400, gt=0, le=366 * 86_400)


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    account: Text = Field(min_length=1)
    admin: bool = False


async def list_tokens(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    now = time.time()
    return web.json_response(
        {"data": [token_view(t, now) for t in await store.run(store.sync.tokens)]}
    )


async def create_token(request: web.Request) -> web.Response:
    """A new enrollment token; its secret is in this answer only."""
    store, _ = _ctx(request)
    req: TokenRequest = await _parse(request, TokenRequest)
    new = await store.run(
        lambda: store.sync.create_token(req.site, uses=req.uses, expires_in_s=req.expires_in_s)
    )
    found = next(t for t in await store.run(store.sync.tokens) if t.prefix == new.prefix)
    return web.json_response({"token": new.plaintext, **token_view(found, time.time())}, status=201)


async def revoke_token(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    try:
        token = await store.run(store.sync.revoke_token, request.match_info["prefix"])
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err)) from err
    return web.json_response(token_view(token, time.time()))


async def create_key(request: web.Request) -> web.Response:
    """A new fleet API key; its secret is in this answer only (nodes get its hash)."""
    store, _ = _ctx(request)
    req: KeyRequest = await _parse(request, KeyRequest)
    try:
        new = await store.run(lambda: store.sync.create_key(req.account, admin=req.admin))
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err), param="account") from err
    return web.json_response(
        {"key": new.plaintext, "prefix": new.prefix, "account": req.account, "admin": req.admin},
        status=201,
    )


async def revoke_key(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    prefix = request.match_info["prefix"]
    try:
        await store.run(store.sync.revoke_key, prefix)
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err)) from err
    return web.json_response({"prefix": prefix, "revoked": True})


class SeedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Text | None = Field(None, max_length=100, description="the newest held if unset")
    site: Text | None = Field(None, description="every node if unset")


async def list_packages(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    found = await store.run(store.sync.packages, request.query.get("q"))
    names = {n.id: n.name for n in await store.run(store.sync.nodes)}
    return web.json_response({"data": [package_view(p, names) for p in found]})


async def add_package(request: web.Request) -> web.Response:
    """The body is a package archive (`GET /v1/packages/{id}/exports/oci` on an appliance);
    `?seed=all` or `?seed=SITE` seeds it at once."""
    store, settings = _ctx(request)
    data = bytearray()
    async for chunk in request.content.iter_chunked(1 << 20):
        data += chunk
        if len(data) > MAX_BUNDLE:
            raise ApiError(
                ErrorCode.request_too_large, f"a package archive is at most {MAX_BUNDLE} bytes"
            )
    try:
        summary, sha256 = await asyncio.to_thread(keep_bundle, settings.artifacts_dir, bytes(data))
    except LayoutError as err:
        raise ApiError(ErrorCode.invalid_parameter, f"not a package archive: {err}") from err
    await store.run(store.sync.add_package_bundle, summary, sha256, len(data))
    if seed := request.query.get("seed"):
        site = None if seed == "all" else seed
        await store.run(store.sync.seed_package, summary["id"], summary["version"], site)
    return await _package(request, summary["id"], summary["version"], status=201)


async def seed_package(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    req: SeedRequest = await _parse(request, SeedRequest)
    package_id = request.match_info["id"]
    try:
        await store.run(store.sync.seed_package, package_id, req.version, req.site)
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err)) from err
    return await _package(request, package_id, req.version)


async def unseed_package(request: web.Request) -> web.Response:
    store, _ = _ctx(request)
    package_id, version = request.match_info["id"], request.query.get("version")
    try:
        await store.run(store.sync.unseed_package, package_id, version)
    except NotFoundError as err:
        raise ApiError(ErrorCode.not_found, str(err)) from err
    return await _package(request, package_id, version)


async def _package(
    request: web.Request, package_id: str, version: str | None, status: int = 200
) -> web.Response:
    store, _ = _ctx(request)
    found = [p for p in await store.run(store.sync.packages, package_id) if p.id == package_id]
    match = next((p for p in found if version in {None, p.version}), None)
    if match is None:
        raise ApiError(ErrorCode.not_found, f"no package {package_id}")
    names = {n.id: n.name for n in await store.run(store.sync.nodes)}
    return web.json_response(package_view(match, names), status=status)


async def list_loops(request: web.Request) -> web.Response:
    """The hub's background loops: which run, and each one's failed rounds."""
    return web.json_response(report(request.app))


def admin_routes() -> list[web.RouteDef]:
    return [
        web.get("/v1/admin/nodes", list_nodes),
        web.post("/v1/admin/nodes/{node}/drain", drain_node),
        web.post("/v1/admin/nodes/{node}/revoke", revoke_node),
        web.get("/v1/admin/accounts", list_accounts),
        web.get("/v1/admin/accounts/{name}/quota", account_quota),
        web.get("/v1/admin/models", list_models),
        web.get("/v1/admin/deployments", list_deployments),
        web.post("/v1/admin/deployments", create_deployment),
        web.delete("/v1/admin/deployments/{id}", delete_deployment),
        web.get("/v1/admin/tokens", list_tokens),
        web.post("/v1/admin/tokens", create_token),
        web.post("/v1/admin/tokens/{prefix}/revoke", revoke_token),
        web.post("/v1/admin/keys", create_key),
        web.post("/v1/admin/keys/{prefix}/revoke", revoke_key),
        web.get("/v1/admin/packages", list_packages),
        web.post("/v1/admin/packages", add_package),
        web.post("/v1/admin/packages/{id}/seed", seed_package),
        web.delete("/v1/admin/packages/{id}/seed", unseed_package),
        web.get("/v1/admin/loops", list_loops),
    ]
