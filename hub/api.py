"""The hub's node API: enrollment, heartbeats, event sync. Thin handlers over the store.

Enrollment is the one call a node makes with an enrollment token, over HTTPS to the hub
(the node pins the hub's certificate fingerprint). Every later call carries the node token
and, with `server.require_overlay_source`, must come from the node's overlay address,
that is through its WireGuard tunnel.

Every message is one of shared/protocol.py's, validated before anything is done with it:
a node can break only itself. What a node says of its own load is taken; what it says of
anything else (another account's usage, another node's lease, another account's request
to offload) is refused.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from hub.loops import LOOPS
from hub.offload import Forwarder
from hub.planning.quota import Sizing
from hub.state.store import (
    AlreadyEnrolledError,
    AsyncHubStore,
    ForeignAccountError,
    ForeignLeaseError,
    Heartbeat,
    HubStore,
    Node,
    TokenRefusedError,
)
from shared import __version__, jsonlimits, pki, protocol
from shared.blobs import IMMUTABLE, send_blob
from shared.errors import ApiError, ErrorCode, error_body

if TYPE_CHECKING:
    from hub.settings import HubSettings

STORE = web.AppKey("hub_store", AsyncHubStore)
SETTINGS = web.AppKey("hub_settings", object)  # HubSettings; object keeps the import lazy
IDENTITY = web.AppKey("hub_identity", dict[str, str])  # the hub's public WireGuard key …
NODE = web.RequestKey("node", Node)
REQUEST_ID = web.RequestKey("request_id", str)
M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)


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

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


_HTTP_CODES = {
    404: ErrorCode.not_found,
    405: ErrorCode.method_not_allowed,
    413: ErrorCode.request_too_large,
}


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in the one error shape, with the request's id (`X-Kvl-Request-Id`,
    also in the log): ours, aiohttp's, and any other exception, which is a bug, logged
    with its traceback and answered 500 `internal_error`, never a plain-text page."""
    request_id = secrets.token_hex(8)
    request[REQUEST_ID] = request_id
    try:
        response = await handler(request)
    except ApiError as err:
        response = web.json_response(err.body(), status=err.status, headers=err.headers())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, ErrorCode.bad_request)
        response = web.json_response(error_body(code, exc.reason), status=code.status)
    except Exception:
        log.exception(
            "unhandled error in %s %s (request %s)", request.method, request.path, request_id
        )
        code = ErrorCode.internal_error
        response = web.json_response(
            error_body(code, f"internal error; request id {request_id}"), status=code.status
        )
    if not response.prepared:
        response.headers["X-Kvl-Request-Id"] = request_id
    return response


async def parse(request: web.Request, model: type[M]) -> M:
    """The body as `model`, or 400 in the error shape naming the first bad field (nesting
    past the JSON reader's depth is refused there too)."""
    raw = await request.read()
    try:
        return model.model_validate_json(raw or b"{}")  # no body: every default
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "json_invalid":
            raise ApiError(ErrorCode.invalid_json, f"the body is not JSON: {first['msg']}") from err
        raise ApiError(
            ErrorCode.invalid_parameter, f"`{param}`: {first['msg']}", param=param
        ) from err


def protocol_version(request: web.Request) -> int:
    """The caller's protocol version (`Kvl-Protocol`), or 400 `protocol_unsupported`
    saying which side to upgrade."""
    header = request.headers.get(protocol.PROTOCOL_HEADER)
    version = protocol.node_protocol(header)
    if protocol.supported(version):
        assert version is not None  # noqa: S101 - supported() checked it
        return version
    window = f"{protocol.OLDEST_NODE_PROTOCOL}..{protocol.PROTOCOL_VERSION}"
    if version is not None and version > protocol.PROTOCOL_VERSION:
        fix = "upgrade the hub (a fleet is upgraded hub first)"
    else:
        fix = "upgrade the node"
    said = "no Kvl-Protocol header" if header is None else f"Kvl-Protocol {header[:20]!r}"
    raise ApiError(
        ErrorCode.protocol_unsupported,
        f"this hub serves node protocol versions {window}; the call has {said}: {fix}",
        param=protocol.PROTOCOL_HEADER,
    )


def _settings(request: web.Request) -> HubSettings:
    settings: HubSettings = request.app[SETTINGS]  # type: ignore[assignment]
    return settings


async def health(request: web.Request) -> web.Response:
    """Liveness, with how often each background loop has failed (counts only: the errors
    themselves are behind the operator's `/v1/admin/loops`)."""
    failures = request.app[LOOPS].report() if LOOPS in request.app else {}
    return web.json_response(
        {
            "status": "alive",
            "version": __version__,
            "protocol": protocol.PROTOCOL_VERSION,
            "loop_failures": {name: f["failures"] for name, f in failures.items()},
        }
    )


async def enroll(request: web.Request) -> web.Response:
    protocol_version(request)
    req = await parse(request, protocol.EnrollRequest)
    settings = _settings(request)
    store = request.app[STORE]
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
    except AlreadyEnrolledError as err:
        raise ApiError(ErrorCode.already_enrolled, str(err), param="wg_public_key") from err
    # Signed only once the token and the node are checked.
    lan_certificate = None
    if req.lan_csr is not None:
        from hub.app import certificates  # noqa: PLC0415 - the app imports this module

        try:
            lan_certificate = pki.sign_request(
                certificates(settings)[0], req.lan_csr.encode()
            ).decode()
        except ValueError as err:
            raise ApiError(ErrorCode.invalid_parameter, str(err), param="lan_csr") from err
    node = enrolled.node
    identity = request.app[IDENTITY]
    endpoint = (
        settings.overlay.endpoint or f"{settings.server.names[0]}:{settings.overlay.listen_port}"
    )
    answer = protocol.EnrollAnswer(
        node_id=node.id,
        node_token=enrolled.node_token,
        name=node.name,
        site=node.site,
        overlay_address=node.overlay_address,
        overlay_prefix=settings.overlay.prefix,
        lan_certificate=lan_certificate,
        hub=protocol.HubPeer(
            wg_public_key=identity["wg_public_key"],
            overlay_address=identity["overlay_address"],
            endpoint=endpoint,
            api_url=f"https://{identity['overlay_address']}:{settings.server.port}",
            ca_pem=identity["ca_pem"],
        ),
    )
    return _answer(answer, status=201)


def _answer(message: protocol.Message, status: int = 200) -> web.Response:
    return web.Response(
        body=message.model_dump_json(),
        status=status,
        content_type="application/json",
        headers={protocol.PROTOCOL_HEADER: str(protocol.PROTOCOL_VERSION)},
    )


def bearer(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer …` header, or None."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@web.middleware
async def node_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Node routes (`/v1/node/…`): the node token, a node not revoked, from its address,
    speaking a protocol version this hub serves."""
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
    protocol_version(request)
    request[NODE] = node
    return await handler(request)


async def heartbeat(request: web.Request) -> web.Response:
    req = await parse(request, protocol.HeartbeatRequest)
    node = request[NODE]
    beats = request.app[BEATS]
    now = time.time()
    beats.add(Heartbeat(node.id, now, req.versions, req.capacity, address=request.remote))
    return _answer(
        protocol.HeartbeatAnswer(
            node_id=node.id, received_at=now, desired_serial=max(0, beats.desired_serial)
        )
    )


async def events(request: web.Request) -> web.Response:
    req = await parse(request, protocol.EventsRequest)
    node = request[NODE]
    store = request.app[STORE]
    usage = [e.body for e in req.events if isinstance(e, protocol.UsageEvent)]
    try:
        await store.check_reports(
            node,
            accounts={u.account for u in usage},
            leases={u.lease_id for u in usage if u.lease_id is not None},
        )
    except ForeignAccountError as err:
        raise ApiError(ErrorCode.foreign_account, str(err), param="events") from err
    except ForeignLeaseError as err:
        raise ApiError(ErrorCode.foreign_lease, str(err), param="events") from err
    ids, new = await store.ingest(node.id, req.events)  # committed with others meanwhile
    # Every id is acknowledged, duplicates too: the node may then move its checkpoint.
    return _answer(protocol.EventsAnswer(acknowledged=ids, new=new))


async def leases(request: web.Request) -> web.Response:
    """A node reports the final spend of the leases it retired and asks for new ones:
    for accounts it serves, each once, and finals of its own leases only."""
    req = await parse(request, protocol.LeaseRequest)
    node = request[NODE]
    store = request.app[STORE]
    try:
        await store.check_reports(node, accounts=req.accounts, leases=())
    except ForeignAccountError as err:
        raise ApiError(ErrorCode.foreign_account, str(err), param="accounts") from err
    quota = _settings(request).quota
    learning = request.app[LEARNING]
    learning.heard(node.id)
    now = time.time()
    holders = await store.run(store.sync.lease_holders, now)
    still_learning = learning.active(now, holders)
    try:
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
    except ForeignLeaseError as err:
        raise ApiError(ErrorCode.foreign_lease, str(err), param="finals") from err
    return _answer(
        protocol.LeaseAnswer(
            leases=[
                protocol.LeaseGrant(
                    account=lease.account,
                    lease_id=lease.id,
                    granted=lease.granted,
                    expires_at=lease.expires_at,
                    period_ends_at=lease.period_ends_at,
                )
                for lease in granted
            ],
            learning=still_learning,
            retry_after_s=learning.retry_after_s if still_learning else None,
        )
    )


OFFLOAD_ROUTES = {"chat/completions", "completions"}


async def offload(request: web.Request) -> web.StreamResponse:
    """A node hands over a request it had to shed (hub/offload.py), with its client's own
    API key: the hub checks the key before it bothers another node, and the node that
    serves the request takes account and class from that key, never from the origin."""
    route = request.match_info["route"]
    if route not in OFFLOAD_ROUTES:
        raise ApiError(ErrorCode.not_found, f"/v1/{route} cannot be offloaded")
    client_key = request.headers.get(protocol.CLIENT_KEY_HEADER, "").strip()
    if not client_key:
        raise ApiError(
            ErrorCode.missing_api_key,
            f"an offloaded request carries its client's API key in {protocol.CLIENT_KEY_HEADER}",
        )
    store = request.app[STORE]
    if await store.read(HubStore.key_account, client_key) is None:
        raise ApiError(ErrorCode.invalid_api_key, "the client's API key is not a valid fleet key")
    body = await request.read()
    try:
        payload = jsonlimits.loads(body)
        model = payload["model"]
    except (ValueError, KeyError, TypeError) as err:
        model = None
        cause: Exception | None = err
    else:
        cause = None
    if not isinstance(model, str) or not model or len(model) > 200:
        raise ApiError(
            ErrorCode.invalid_parameter, "the offloaded body must name its `model`", param="model"
        ) from cause
    nodes = await store.nodes()
    return await request.app[FORWARDER].forward(
        request,
        route,
        body,
        nodes,
        origin=request[NODE],
        client_key=client_key,
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
    if sha256 not in {m.sha256 for m in placed} | {p.sha256 for p in seeded}:
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
    raw = request.query.get("after", "-1")
    try:
        after = int(raw) if len(raw) <= 20 else None
    except ValueError:
        after = None
    if after is None:
        raise ApiError(ErrorCode.invalid_parameter, "`after` must be a serial", param="after")
    if after >= 0 and await store.run(store.sync.desired_serial) <= after:
        return web.Response(
            status=204, headers={protocol.PROTOCOL_HEADER: str(protocol.PROTOCOL_VERSION)}
        )
    return _answer(await store.run(store.sync.desired_state, node))


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
