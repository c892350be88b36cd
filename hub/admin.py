"""The hub's operator API (`/v1/admin/…`): what `kvl hub …` does, over HTTPS, for the
console and for tools. Every call carries an operator token (`kvl hub operators
create`); handlers are thin: parse, call the store, answer a view (hub/views.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Self

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from hub.state.store import DeploymentRecord, NotFoundError
from hub.views import deployment_view, node_view, quota_view
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from hub.settings import HubSettings

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPERATOR = web.RequestKey("operator", str)


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
    return await handler(request)


class DeploymentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(pattern=r"^[^@\s]+@[^@\s]+$", description="name@version")
    replicas: int = Field(1, ge=0, le=10_000)
    service_class: str = Field("S1", pattern=r"^S[0-4]$")
    sites: list[str] = Field(default_factory=list, max_length=100)
    regions: list[str] = Field(default_factory=list, max_length=100)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    gpu: bool = False
    gpu_memory_mib: int = Field(0, ge=0)
    tenant: str | None = None

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
        node = await store.run(store.sync.revoke_node, request.match_info["node"])
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
    record = DeploymentRecord(
        id=uuid.uuid4().hex[:12],
        model=req.model,
        replicas=req.replicas,
        service_class=req.service_class,
        isolation="I1",
        constraints=req.model_dump(include={"sites", "regions", "labels", "gpu",
                                            "gpu_memory_mib", "tenant"}),
    )  # fmt: skip
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
    ]
