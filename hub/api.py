"""The hub's node API: enrollment, heartbeats, event sync. Thin handlers over the store.

Enrollment is the one call a node makes with an enrollment token, over HTTPS to the hub
(the node pins the hub's certificate fingerprint). Every later call carries the node token
and, with `server.require_overlay_source`, must come from the node's overlay address,
that is through its WireGuard tunnel.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hub.offload import Forwarder
from hub.planning.quota import Sizing
from hub.state.store import AsyncHubStore, Heartbeat, Node, TokenRefusedError
from shared import __version__, pki
from shared.blobs import IMMUTABLE, send_blob
from shared.errors import ApiError, ErrorCode, error_body

if TYPE_CHECKING:
    from hub.settings import HubSettings

STORE = web.AppKey("hub_store", AsyncHubStore)
SETTINGS = web.AppKey("hub_settings", object)  # HubSettings; object keeps the import lazy
IDENTITY = web.AppKey("hub_identity", dict[str, str])  # the hub's public WireGuard key …
NODE = web.RequestKey("node", Node)


class Heartbeats:
    """Heartbeats are soft state, written behind: a node's last one waits here and the
    flusher (hub/app.py) writes every waiting one in one transaction a second, so a fleet
    of thousands costs one commit a second, not one per heartbeat. A crash loses at most
    that second of `last_seen`, which the next heartbeat restores. The flusher also keeps
    `desired_serial` fresh, which heartbeat answers carry so a node pulls its desired
    state only when it changed."""

    def __init__(self) -> None:
        self._waiting: dict[str, Heartbeat] = {}
        self.desired_serial = 0
        # Called with each flushed group, once it is written (the console samples them).
        self.listeners: list[Callable[[list[Heartbeat]], Awaitable[None]]] = []

    def add(self, beat: Heartbeat) -> None:
        self._waiting[beat.node_id] = beat

    def take(self) -> list[Heartbeat]:
        taken, self._waiting = list(self._waiting.values()), {}
        return taken


BEATS = web.AppKey("hub_heartbeats", Heartbeats)


class Learning:
    """A restarted hub's learning mode: no new lease until every node that may still be
    spending one has reported, or one lease period has passed (its grants may lag what
    the nodes spent while it was down; their reports catch it up)."""

    def __init__(self, started_at: float, lease_s: float) -> None:
        self._until = started_at + lease_s
        self._heard: set[str] = set()
        self._done = False

    def heard(self, node_id: str) -> None:
        self._heard.add(node_id)

    def active(self, now: float, holders: set[str]) -> bool:
        if not self._done and (now >= self._until or holders <= self._heard):
            self._done = True
        return not self._done

    @property
    def retry_after_s(self) -> float:
        return max(1.0, self._until - time.time())


LEARNING = web.AppKey("hub_learning", Learning)
FORWARDER = web.AppKey("hub_forwarder", Forwarder)

WG_KEY = r"^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=$"  # 32 bytes, base64
MAX_EVENTS = 5000


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EnrollRequest(_Body):
    token: str = Field(min_length=1, max_length=200)
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    wg_public_key: str = Field(pattern=WG_KEY)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    versions: dict[str, str] = Field(default_factory=dict, max_length=32)
    # A signing request for the node's LAN API certificate (the key stays on the node).
    lan_csr: str | None = Field(None, max_length=20_000)


class HeartbeatRequest(_Body):
    versions: dict[str, str] = Field(default_factory=dict, max_length=32)
    capacity: dict[str, Any] = Field(default_factory=dict, max_length=64)


class Event(_Body):
    id: str = Field(min_length=1, max_length=100)
    kind: str = Field(min_length=1, max_length=50)
    body: dict[str, Any]


class LeaseRequest(_Body):
    # The accounts the node wants a new lease for (those it serves and that have a budget).
    accounts: list[str] = Field(default_factory=list, max_length=10_000)
    # Leases the node retired and will never spend again: their final spend.
    finals: dict[str, int] = Field(default_factory=dict, max_length=10_000)


class EventsRequest(_Body):
    events: list[Event] = Field(max_length=MAX_EVENTS)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return web.json_response(err.body(), status=err.status, headers=err.headers())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: ErrorCode.not_found, 405: ErrorCode.method_not_allowed}.get(
            exc.status, ErrorCode.bad_request
        )
        return web.json_response(error_body(code, exc.reason), status=code.status)


async def parse(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        raw = await request.read()
        return model.model_validate_json(raw or b"{}")  # no body: every default
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(
            ErrorCode.invalid_parameter, f"`{param}`: {first['msg']}", param=param
        ) from err


def _settings(request: web.Request) -> HubSettings:
    settings: HubSettings = request.app[SETTINGS]  # type: ignore[assignment]
    return settings


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive", "version": __version__})


async def enroll(request: web.Request) -> web.Response:
    req: EnrollRequest = await parse(request, EnrollRequest)
    settings = _settings(request)
    store = request.app[STORE]
    lan_certificate = None
    if req.lan_csr is not None:
        from hub.app import certificates  # noqa: PLC0415 - the app imports this module

        try:
            lan_certificate = pki.sign_request(
                certificates(settings)[0], req.lan_csr.encode()
            ).decode()
        except ValueError as err:
            raise ApiError(ErrorCode.invalid_parameter, str(err), param="lan_csr") from err
    try:
        enrolled = await store.run(
            store.sync.enroll,
            req.token,
            name=req.name,
            wg_public_key=req.wg_public_key,
            overlay_prefix=settings.overlay.prefix,
            labels=req.labels,
            versions=req.versions,
        )
    except TokenRefusedError as err:
        raise ApiError(ErrorCode.invalid_enrollment_token, str(err), param="token") from err
    node = enrolled.node
    identity = request.app[IDENTITY]
    endpoint = (
        settings.overlay.endpoint or f"{settings.server.names[0]}:{settings.overlay.listen_port}"
    )
    return web.json_response(
        {
            "node_id": node.id,
            "node_token": enrolled.node_token,
            "name": node.name,
            "site": node.site,
            "overlay_address": node.overlay_address,
            "overlay_prefix": settings.overlay.prefix,
            "lan_certificate": lan_certificate,
            "hub": {
                "wg_public_key": identity["wg_public_key"],
                "overlay_address": identity["overlay_address"],
                "endpoint": endpoint,
                "api_url": f"https://{identity['overlay_address']}:{settings.server.port}",
                "ca_pem": identity["ca_pem"],
            },
        },
        status=201,
    )


def bearer(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer …` header, or None."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@web.middleware
async def node_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Node routes (`/v1/node/…`): the node token, a node not revoked, from its address."""
    if not request.path.startswith("/v1/node/"):
        return await handler(request)
    token = bearer(request)
    store = request.app[STORE]
    node = await store.authenticate_node(token) if token else None
    if node is None:
        raise ApiError(
            ErrorCode.invalid_node_token, "send the node token as `Authorization: Bearer`"
        )
    if node.revoked:
        raise ApiError(ErrorCode.node_revoked, f"node {node.name} ({node.id}) was revoked")
    if _settings(request).server.require_overlay_source and request.remote != node.overlay_address:
        raise ApiError(
            ErrorCode.wrong_source_address,
            f"node {node.name} must call from its overlay address {node.overlay_address}, "
            f"through its tunnel; this call came from {request.remote}",
        )
    request[NODE] = node
    return await handler(request)


async def heartbeat(request: web.Request) -> web.Response:
    req: HeartbeatRequest = await parse(request, HeartbeatRequest)
    node = request[NODE]
    beats = request.app[BEATS]
    now = time.time()
    beats.add(Heartbeat(node.id, now, req.versions, req.capacity, address=request.remote))
    return web.json_response(
        {"node_id": node.id, "received_at": now, "desired_serial": beats.desired_serial}
    )


async def events(request: web.Request) -> web.Response:
    req: EventsRequest = await parse(request, EventsRequest)
    node = request[NODE]
    store = request.app[STORE]
    batch = [{"id": e.id, "kind": e.kind, "body": e.body} for e in req.events]
    ids, new = await store.ingest(node.id, batch)  # committed with others arriving meanwhile
    # Every id is acknowledged, duplicates too: the node may then move its checkpoint.
    return web.json_response({"acknowledged": ids, "new": new})


async def leases(request: web.Request) -> web.Response:
    """A node reports the final spend of the leases it retired and asks for new ones."""
    req: LeaseRequest = await parse(request, LeaseRequest)
    node = request[NODE]
    store = request.app[STORE]
    quota = _settings(request).quota
    learning = request.app[LEARNING]
    learning.heard(node.id)
    now = time.time()
    holders = await store.run(store.sync.lease_holders, now)
    still_learning = learning.active(now, holders)
    granted = await store.run(
        store.sync.renew_leases,
        node.id,
        req.accounts,
        req.finals,
        now=now,
        lease_s=quota.lease_s,
        sizing=Sizing(quota.share, quota.min_slice_tokens, quota.max_slice_tokens),
        grant_new=not still_learning,
    )
    return web.json_response(
        {
            "leases": [
                {
                    "account": lease.account,
                    "lease_id": lease.id,
                    "granted": lease.granted,
                    "expires_at": lease.expires_at,
                    "period_ends_at": lease.period_ends_at,
                }
                for lease in granted
            ],
            "learning": still_learning,
            "retry_after_s": learning.retry_after_s if still_learning else None,
        }
    )


OFFLOAD_ROUTES = {"chat/completions", "completions"}


async def offload(request: web.Request) -> web.StreamResponse:
    """A node hands over a request it had to shed (hub/offload.py)."""
    route = request.match_info["route"]
    if route not in OFFLOAD_ROUTES:
        raise ApiError(ErrorCode.not_found, f"/v1/{route} cannot be offloaded")
    body = await request.read()
    try:
        model = str(json.loads(body)["model"])
    except (ValueError, KeyError, TypeError) as err:
        raise ApiError(
            ErrorCode.invalid_parameter, "the offloaded body must name its `model`", param="model"
        ) from err
    store = request.app[STORE]
    nodes = await store.nodes()
    return await request.app[FORWARDER].forward(
        request,
        route,
        body,
        nodes,
        origin=request[NODE],
        model=model,
        now=time.time(),
        stale_after_s=_settings(request).fleet.stale_after_s,
    )


async def artifact(request: web.Request) -> web.StreamResponse:
    """A model file placed on the calling node, or a package archive seeded to it, by
    sha256 (its ETag); Range requests resume a cut download."""
    sha256 = request.match_info["sha256"].lower()
    store = request.app[STORE]
    node = request[NODE]
    placed = await store.run(store.sync.placed_models, node.id)
    seeded = await store.run(store.sync.seeded_packages, node)
    if sha256 not in {m.sha256 for m in placed} | {p["sha256"] for p in seeded}:
        raise ApiError(ErrorCode.not_found, f"no model or package {sha256} is placed on this node")
    try:
        blob = (_settings(request).artifacts_dir / sha256).open("rb")
    except FileNotFoundError as err:
        raise ApiError(ErrorCode.not_found, f"the hub has lost the file {sha256}") from err
    with blob:
        return await send_blob(
            request,
            blob,
            sha256=sha256,
            media_type="application/octet-stream",
            cache_control=IMMUTABLE,
        )


async def desired_state(request: web.Request) -> web.Response:
    """The caller's own desired state (the node token says whose); `?after=SERIAL` answers
    204 while nothing changed since."""
    node = request[NODE]
    store = request.app[STORE]
    try:
        after = int(request.query.get("after", "-1"))
    except ValueError as err:
        raise ApiError(
            ErrorCode.invalid_parameter, "`after` must be a serial", param="after"
        ) from err
    if after >= 0 and await store.run(store.sync.desired_serial) <= after:
        return web.Response(status=204)
    return web.json_response(await store.run(store.sync.desired_state, node))


def routes() -> list[web.RouteDef]:
    return [
        web.get("/healthz", health),
        web.post("/v1/enroll", enroll),
        web.post("/v1/node/heartbeat", heartbeat),
        web.post("/v1/node/events", events),
        web.get("/v1/node/state", desired_state),
        web.post("/v1/node/leases", leases),
        web.post("/v1/node/offload/{route:.+}", offload),
        web.get("/v1/node/artifacts/{sha256:[0-9a-fA-F]{64}}", artifact),
    ]


def dumps(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True)
