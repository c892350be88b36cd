"""The hub's node API after enrollment (hub/api/enrollment.py): its middleware, and
heartbeats, event sync, leases, offload, artifacts and the desired state. Thin handlers
over the store.

Every message is one of shared/protocol.py's, validated before anything is done with it:
a node can break only itself. What a node says of its own load is taken; what it says of
anything else (another account's usage, another node's lease, another account's request
to offload) is refused.
"""

from __future__ import annotations

import time
from collections import Counter

from aiohttp import web

from hub.api.route_kinds import Auth, Param, Route
from hub.appkeys import (
    BANDWIDTH,
    BEATS,
    FORWARDER,
    LEARNING,
    METRICS,
    NODE,
    NODE_PROTOCOL,
    SETTINGS,
    STORE,
    TLS,
)
from hub.certificates import issuer_name
from hub.http import Handler, answer, bearer, parse, protocol_header, protocol_version
from hub.planning.quota import Sizing
from hub.state.accounts import ForeignAccountError
from hub.state.leases import ForeignLeaseError
from hub.state.nodes import Heartbeat, Node
from shared import jsonlimits, peer_tickets, protocol
from shared.blobs import IMMUTABLE, send_blob
from shared.errors import ApiError, ErrorCode


def with_protocol(versions: dict[str, str], version: int) -> dict[str, str]:
    """What a node says it runs, with the protocol version its call spoke (its
    `Kvl-Protocol`, which the hub checked, over anything the node put under that name):
    during a rollout, which nodes are still to upgrade."""
    return {**versions, "protocol": str(version)}


@web.middleware
async def node_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Node routes (`/v1/node/…`): the node token, a node not revoked, from its address,
    speaking a protocol version this hub serves, with its own client certificate (mutual
    TLS) once the hub has issued it one."""
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
    settings = request.app[SETTINGS]
    if settings.server.require_overlay_source and request.remote != node.overlay_address:
        raise ApiError(
            ErrorCode.wrong_source_address,
            f"node {node.name} must call from its overlay address {node.overlay_address}, "
            f"through its tunnel; this call came from {request.remote}",
        )
    request[NODE_PROTOCOL] = protocol_version(request)
    peer, _ = _peer(request)
    if peer is None:
        # A node without a certificate yet (enrolled before protocol 3) is served on its
        # token, and may ask for its first; once it has one, it must present it.
        first = request.path == "/v1/node/certificate"
        if (settings.server.require_node_certificates and not first) or (
            await store.node_has_certificate(node.id)
        ):
            raise ApiError(
                ErrorCode.client_certificate_required,
                f"node {node.name} must present its certificate (mutual TLS)",
            )
    elif peer != node.id:
        raise ApiError(
            ErrorCode.certificate_mismatch,
            f"the client certificate is not node {node.name}'s ({node.id})",
        )
    request[NODE] = node
    return await handler(request)


def _peer(request: web.Request) -> tuple[str | None, str | None]:
    """(the node id the connection's certificate names, "" for a certificate of the fleet
    that is not a node's, None for none; the issuing CA's name)."""
    transport = request.transport
    if transport is None:
        return None, None
    hub_tls = request.app[TLS]
    known = hub_tls.peers.get(transport)
    if known is None:
        peercert = transport.get_extra_info("peercert")
        peercert = peercert if isinstance(peercert, dict) else None
        known = (hub_tls.node_of(peercert), issuer_name(peercert))
        hub_tls.peers[transport] = known
    return known


async def heartbeat(request: web.Request) -> web.Response:
    req = await parse(request, protocol.HeartbeatRequest)
    node = request[NODE]
    beats = request.app[BEATS]
    now = time.time()
    beats.add(
        Heartbeat(
            node.id,
            now,
            with_protocol(req.versions, request[NODE_PROTOCOL]),
            req.capacity,
            address=request.remote,
            objectives=req.objectives,
        )
    )
    hub_tls = request.app[TLS]
    _, issuer = _peer(request)
    return answer(
        protocol.HeartbeatAnswer(
            node_id=node.id,
            received_at=now,
            desired_serial=max(0, beats.desired_serial),
            trust_digest=hub_tls.digest,
            # Signed by a CA that signs no more (a rotation switched), or none at all.
            renew_certificate=issuer != hub_tls.signing_name,
        ),
        version=request[NODE_PROTOCOL],
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
            leases={(u.lease_id, u.account) for u in usage if u.lease_id is not None},
        )
    except ForeignAccountError as err:
        raise ApiError(ErrorCode.foreign_account, str(err), param="events") from err
    except ForeignLeaseError as err:
        raise ApiError(ErrorCode.foreign_lease, str(err), param="events") from err
    ids, new, fresh = await store.ingest(node.id, req.events)  # committed with others meanwhile
    request.app[METRICS].ledger(Counter(e.kind for e in req.events), fresh)
    # Every id is acknowledged, duplicates too: the node may then move its checkpoint.
    return answer(protocol.EventsAnswer(acknowledged=ids, new=new), version=request[NODE_PROTOCOL])


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
    quota = request.app[SETTINGS].quota
    learning = request.app[LEARNING]
    learning.heard(node.id)
    now = time.time()
    holders = await store.run(store.sync.leases.holders, now)
    still_learning = learning.active(now, holders)
    try:
        granted = await store.run(
            store.sync.leases.renew,
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
    return answer(
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
        ),
        version=request[NODE_PROTOCOL],
    )


# The appliance routes a node may hand over (each documented as a path of its own).
OFFLOAD_ROUTES = ("chat/completions", "completions")


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
    account = await store.read(store.reader.accounts.key_account, client_key)
    if account is None:
        raise ApiError(ErrorCode.invalid_api_key, "the client's API key is not a valid fleet key")

    async def serves(node: Node) -> bool:
        return account in await store.node_accounts(node)

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
            ErrorCode.invalid_value, "the offloaded body must name its `model`", param="model"
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
        stale_after_s=request.app[SETTINGS].fleet.stale_after_s,
        serves=serves,
    )


async def artifact(request: web.Request) -> web.StreamResponse:
    """A model file placed on the calling node, a package archive seeded to it, or the
    image release bundle a rollout gave it, by sha256 (its ETag); Range requests resume a
    cut download."""
    sha256 = request.match_info["sha256"].lower()
    store = request.app[STORE]
    node = request[NODE]
    placed = await store.run(store.sync.deployments.placed_models, node.id)
    seeded = await store.run(store.sync.packages.seeded_to, node)
    release = await store.run(store.sync.rollouts.release_target, node)
    given = {p.model.sha256 for p in placed} | {p.sha256 for p in seeded}
    if release is not None:
        given.add(release.sha256)
    if sha256 not in given:
        raise ApiError(
            ErrorCode.not_found, f"no model, package or release {sha256} is given to this node"
        )
    try:
        blob = (request.app[SETTINGS].artifacts_dir / sha256).open("rb")
    except FileNotFoundError as err:
        raise ApiError(ErrorCode.not_found, f"the hub has lost the file {sha256}") from err
    # The site's bandwidth, shared by its nodes' downloads (`kvl hub releases bandwidth`).
    rate = await store.run(store.sync.rollouts.bandwidth_of, node.site)
    pace = None if rate is None else request.app[BANDWIDTH].pacer(node.site, rate)
    with blob:
        response = await send_blob(
            request,
            blob,
            sha256=sha256,
            media_type="application/octet-stream",
            cache_control=IMMUTABLE,
            pace=pace,
        )
    if request.method == "GET" and response.content_length:
        request.app[METRICS].artifact_bytes.labels(node.site).inc(response.content_length)
    return response


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
        raise ApiError(ErrorCode.invalid_value, "`after` must be a serial", param="after")
    if after >= 0 and await store.run(store.sync.serials.desired) <= after:
        return web.Response(status=204, headers=protocol_header())
    state = await store.run(store.sync.desired.of, node)
    if any(m.peers for m in state.models):
        # The hub's word that this node may fetch those files from its site's peers,
        # signed by the CA that signs now (every node trusts it).
        signing = request.app[TLS].phase.signing
        expires = int(time.time()) + peer_tickets.TTL_S
        models = [
            m.model_copy(
                update={
                    "ticket": peer_tickets.issue(
                        signing.key_pem,
                        peer_tickets.Claims(m.sha256, node.site, node.id, expires),
                    )
                }
            )
            if m.peers
            else m
            for m in state.models
        ]
        state = state.model_copy(update={"models": models})
    return answer(state, version=request[NODE_PROTOCOL])


_AFTER = Param(
    "after",
    "query",
    "the serial the node holds: 204 while the state is still at it",
    {"type": "integer"},
)
_CLIENT_KEY = Param(
    protocol.CLIENT_KEY_HEADER,
    "header",
    "the API key of the client whose request this is: the serving node takes account and "
    "class from it",
    {"type": "string", "minLength": 1, "maxLength": 200},
    required=True,
)
_OFFLOADED = {
    "type": "object",
    "required": ["model"],
    "properties": {"model": {"type": "string"}},
    "description": "the request the node shed, as its client sent it (OpenAI's shape)",
}

ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/node/heartbeat",
        heartbeat,
        "A node's versions and capacity (written behind, once a second); the answer "
        "carries the desired-state serial.",
        Auth.node,
        protocol.HeartbeatRequest,
        protocol.HeartbeatAnswer,
    ),
    Route(
        "POST",
        "/v1/node/events",
        events,
        "A batch of outbox events into the ledger, unique on the id: every id "
        "acknowledged, a resend stored once.",
        Auth.node,
        protocol.EventsRequest,
        protocol.EventsAnswer,
        errors=(ErrorCode.foreign_account,),
    ),
    Route(
        "GET",
        "/v1/node/state",
        desired_state,
        "The calling node's desired state and its serial; 204 while unchanged after `after`.",
        Auth.node,
        answer=protocol.DesiredState,
        params=(_AFTER,),
        other_statuses=((204, "Unchanged since `after`"),),
    ),
    Route(
        "POST",
        "/v1/node/leases",
        leases,
        "Final spends of retired quota leases, and new leases for the accounts named.",
        Auth.node,
        protocol.LeaseRequest,
        protocol.LeaseAnswer,
        errors=(ErrorCode.foreign_account, ErrorCode.foreign_lease),
    ),
    *(
        Route(
            "POST",
            f"/v1/node/offload/{route}",
            offload,
            f"Burst offload of a `/v1/{route}` request the node shed: served by the node "
            "with the most headroom, streamed back.",
            Auth.node,
            body_schema=_OFFLOADED,
            answer_types=("application/json", "text/event-stream"),
            errors=(
                ErrorCode.missing_api_key,
                ErrorCode.invalid_api_key,
                ErrorCode.invalid_json,
                ErrorCode.invalid_value,
                ErrorCode.overloaded,
            ),
            params=(_CLIENT_KEY,),
            router_path="/v1/node/offload/{route:.+}",  # one handler for both
        )
        for route in OFFLOAD_ROUTES
    ),
    Route(
        "GET",
        "/v1/node/artifacts/{sha256}",
        artifact,
        "A model file placed on, a package archive seeded to, or the image release bundle "
        "given to the calling node, by sha256 (its ETag); Range requests resume a cut "
        "download.",
        Auth.node,
        answer_types=("application/octet-stream",),
        errors=(ErrorCode.not_found,),
        other_statuses=((206, "The range asked for"),),
        router_path="/v1/node/artifacts/{sha256:[0-9a-fA-F]{64}}",
    ),
)
