"""The hub's route table: every route of its node API and its operator API, with what
each parses and answers (pydantic models), its auth and its errors. The OpenAPI document
(hub/api/openapi.py) is made from it, tests/hub/test_openapi.py checks it against the
routes the hub registers, and tests/hub/test_fuzz.py fuzzes every route in it."""

from __future__ import annotations

from hub.api.requests import (
    DeploymentRequest,
    DrainRequest,
    KeyRequest,
    NodeTenancyRequest,
    SeedRequest,
    SilenceRequest,
    TenancyRequest,
    TokenRequest,
)
from hub.api.rollout_routes import ROLLOUT_ROUTES
from hub.api.route_kinds import Auth, Param, Route
from shared import protocol
from shared.errors import ErrorCode

__all__ = ["NODE_ROUTES", "OFFLOADED", "ROUTES", "Auth", "Param", "Route"]

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
_SHA256 = {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"}
OFFLOADED = {
    "type": "object",
    "required": ["model"],
    "properties": {"model": {"type": "string"}},
    "description": "the request the node shed, as its client sent it (OpenAI's shape)",
}

NODE_ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", "Liveness: the process is up.", Auth.none),
    Route("GET", "/openapi.json", "This document.", Auth.none),
    Route(
        "GET",
        "/v1/trust",
        "The fleet's CA bundle (certificates only) and its digest: what a node trusts the hub by.",
        Auth.none,
        answer=protocol.TrustAnswer,
    ),
    Route(
        "POST",
        "/v1/enroll",
        "Enroll a node with an enrollment token: one use of the token spent, the node "
        "registered with the next free overlay address and its certificate signed for the "
        "names the hub decides; its node token is in this answer only.",
        Auth.enrollment,
        protocol.EnrollRequest,
        protocol.EnrollAnswer,
        status=201,
        errors=(
            ErrorCode.invalid_enrollment_token,
            ErrorCode.already_enrolled,
            ErrorCode.missing_required_parameter,
            ErrorCode.certificate_name_refused,
            ErrorCode.certificate_name_taken,
        ),
    ),
    Route(
        "POST",
        "/v1/node/certificate",
        "The node's certificate issued again for a new key (before a third of its lifetime "
        "is left, when its addresses changed, or when the hub says it is due).",
        Auth.node,
        protocol.CertificateRequest,
        protocol.CertificateAnswer,
        errors=(ErrorCode.certificate_name_refused, ErrorCode.certificate_name_taken),
    ),
    Route(
        "POST",
        "/v1/node/heartbeat",
        "A node's versions and capacity (written behind, once a second); the answer "
        "carries the desired-state serial.",
        Auth.node,
        protocol.HeartbeatRequest,
        protocol.HeartbeatAnswer,
    ),
    Route(
        "POST",
        "/v1/node/events",
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
        "The calling node's desired state and its serial; 204 while unchanged after `after`.",
        Auth.node,
        answer=protocol.DesiredState,
        params=(_AFTER,),
        other_statuses=((204, "Unchanged since `after`"),),
    ),
    Route(
        "POST",
        "/v1/node/leases",
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
            f"Burst offload of a `/v1/{route}` request the node shed: served by the node "
            "with the most headroom, streamed back.",
            Auth.node,
            answer_types=("application/json", "text/event-stream"),
            errors=(
                ErrorCode.missing_api_key,
                ErrorCode.invalid_api_key,
                ErrorCode.invalid_json,
                ErrorCode.invalid_value,
                ErrorCode.overloaded,
            ),
            params=(_CLIENT_KEY,),
            router_path="/v1/node/offload/{route}",
        )
        for route in ("chat/completions", "completions")
    ),
    Route(
        "GET",
        "/v1/node/artifacts/{sha256}",
        "A model file placed on, a package archive seeded to, or the image release bundle "
        "given to the calling node, by sha256 (its ETag); Range requests resume a cut "
        "download.",
        Auth.node,
        answer_types=("application/octet-stream",),
        errors=(ErrorCode.not_found,),
        other_statuses=((206, "The range asked for"),),
        path_schemas=(("sha256", _SHA256),),
    ),
)

_NOT_FOUND = (ErrorCode.not_found,)
_LOG_PARAMS = (
    Param(
        "after",
        "query",
        "the last seq the reader has: records after it",
        {"type": "integer", "minimum": 0},
    ),
    Param(
        "limit",
        "query",
        "records at most (each answer of a follow too)",
        {"type": "integer", "minimum": 1, "maximum": protocol.MAX_LOG_RECORDS},
    ),
    Param(
        "level",
        "query",
        "the least severe level shown",
        {"type": "string", "enum": [n.lower() for n in protocol.LOG_LEVELS]},
    ),
    Param(
        "tail",
        "query",
        "1: the last `limit` records rather than the first after `after`",
        {"type": "string", "enum": ["0", "1"]},
    ),
    Param(
        "follow", "query", "1: stream records as they come", {"type": "string", "enum": ["0", "1"]}
    ),
)
ADMIN_ROUTES: tuple[Route, ...] = (
    Route("GET", "/v1/admin/nodes", "Every node: site, status, versions, capacity.", Auth.operator),
    Route(
        "POST",
        "/v1/admin/nodes/{node}/drain",
        "Drain a node (by id or name), or end its drain.",
        Auth.operator,
        DrainRequest,
        errors=_NOT_FOUND,
    ),
    Route(
        "POST",
        "/v1/admin/nodes/{node}/tenancy",
        "Set a node's tenancy (by id or name): dedicated to a tenant, private, or shared.",
        Auth.operator,
        NodeTenancyRequest,
        errors=_NOT_FOUND,
    ),
    Route(
        "POST",
        "/v1/admin/nodes/{node}/revoke",
        "Revoke a node.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "GET",
        "/v1/admin/nodes/{node}/logs",
        "A node's recent log records (its bounded ring), read through the tunnel on its "
        "fleet listener; `follow=1` streams them on (NDJSON, or server-sent events for "
        "`Accept: text/event-stream`) until the client goes.",
        Auth.operator,
        answer=protocol.LogsAnswer,
        answer_types=("application/json", "application/x-ndjson", "text/event-stream"),
        errors=(*_NOT_FOUND, ErrorCode.node_offline, ErrorCode.node_unreachable),
        params=_LOG_PARAMS,
    ),
    Route("GET", "/v1/admin/accounts", "Accounts: class, quotas, budget.", Auth.operator),
    Route(
        "GET",
        "/v1/admin/accounts/{name}/quota",
        "An account's budget this period: consumed, leased per node, remaining.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "PUT",
        "/v1/admin/accounts/{name}/tenancy",
        "Bind an account to a tenant and sites, or to none (a shared account).",
        Auth.operator,
        TenancyRequest,
        errors=_NOT_FOUND,
    ),
    Route("GET", "/v1/admin/models", "The model files the hub can place.", Auth.operator),
    Route(
        "GET",
        "/v1/admin/deployments",
        "Deployments and where their replicas run.",
        Auth.operator,
    ),
    Route(
        "POST",
        "/v1/admin/deployments",
        "Deploy a model.",
        Auth.operator,
        DeploymentRequest,
        status=201,
        errors=_NOT_FOUND,
    ),
    Route(
        "DELETE",
        "/v1/admin/deployments/{id}",
        "Undeploy.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route("GET", "/v1/admin/tokens", "Enrollment tokens, without their secrets.", Auth.operator),
    Route(
        "POST",
        "/v1/admin/tokens",
        "Make an enrollment token; its secret is in this answer only.",
        Auth.operator,
        TokenRequest,
        status=201,
    ),
    Route(
        "POST",
        "/v1/admin/tokens/{prefix}/revoke",
        "Revoke an enrollment token.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "POST",
        "/v1/admin/keys",
        "Make a fleet API key; its secret is in this answer only.",
        Auth.operator,
        KeyRequest,
        status=201,
        errors=_NOT_FOUND,
    ),
    Route(
        "POST",
        "/v1/admin/keys/{prefix}/revoke",
        "Revoke a fleet API key.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "GET",
        "/v1/admin/packages",
        "Packages across the fleet.",
        Auth.operator,
        params=(Param("q", "query", "words to look for", {"type": "string"}),),
    ),
    Route(
        "POST",
        "/v1/admin/packages",
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
        "Seed a held package (the newest version, every node, unless named).",
        Auth.operator,
        SeedRequest,
        errors=_NOT_FOUND,
    ),
    Route(
        "DELETE",
        "/v1/admin/packages/{id}/seed",
        "Stop seeding a package.",
        Auth.operator,
        errors=_NOT_FOUND,
        params=(Param("version", "query", "one version only", {"type": "string"}),),
    ),
    Route(
        "GET",
        "/metrics",
        "The hub's Prometheus metrics (OpenMetrics, or the text format when only that is "
        "accepted); without a token on the `metrics.listen` listener only.",
        Auth.operator,
        answer_types=("application/openmetrics-text", "text/plain"),
    ),
    Route(
        "GET",
        "/v1/admin/loops",
        "The hub's background loops: those running, any stopped, each one's failed "
        "rounds (count, last error, when).",
        Auth.operator,
    ),
)

ALERT_ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/admin/alerts",
        "The alerts the hub recorded, newest first: rule, labels, state, when it fired "
        "and resolved, value, summary, whether a silence held it back.",
        Auth.operator,
        params=(
            Param(
                "state",
                "query",
                "only those `firing`, or `resolved`",
                {"type": "string", "enum": ["firing", "resolved"]},
            ),
        ),
    ),
    Route("GET", "/v1/admin/silences", "Silences, newest first.", Auth.operator),
    Route(
        "POST",
        "/v1/admin/silences",
        "Silence the alerts whose rule and labels match: recorded, not delivered.",
        Auth.operator,
        SilenceRequest,
        status=201,
    ),
    Route(
        "DELETE",
        "/v1/admin/silences/{id}",
        "End a silence.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
)

_WINDOW = {"type": "string", "pattern": "^[0-9]{1,7}[smhdw]$"}
_OBJECTIVE_FILTERS = (
    Param("window", "query", "how far back from now: 5m, 1h, 1d, 30d, … (at most 35d)", _WINDOW),
    Param("class", "query", "one service class", {"enum": ["S0", "S1", "S2", "S3", "S4"]}),
    Param("account", "query", "one account (`(other)`: those the hub does not know)",
          {"type": "string"}),
    Param("site", "query", "one site", {"type": "string"}),
    Param("node", "query", "one node, by id or name", {"type": "string"}),
)  # fmt: skip
OBJECTIVE_ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/admin/objectives",
        "The fleet's objectives over a window (1h unless named), per class and `by` "
        "group: met, missed, attainment, target, error budget left over the budget "
        "period, burn rate; and requests by outcome.",
        Auth.operator,
        errors=(ErrorCode.invalid_value,),
        params=(
            *_OBJECTIVE_FILTERS,
            Param(
                "by",
                "query",
                "the groups: class (the default), account, site or node",
                {"enum": ["class", "account", "site", "node"]},
            ),
        ),
    ),
    Route(
        "GET",
        "/v1/admin/objectives/series",
        "The objectives over a window as points in time, per class: requests, attainment "
        "and burn rate of each objective, TTFT median and 95th percentile.",
        Auth.operator,
        errors=(ErrorCode.invalid_value,),
        params=(
            *_OBJECTIVE_FILTERS,
            Param(
                "step",
                "query",
                "time between points (rounded to the buckets' 5 min or 1 h)",
                _WINDOW,
            ),
        ),
    ),
)

ROUTES: tuple[Route, ...] = (
    NODE_ROUTES + ADMIN_ROUTES + OBJECTIVE_ROUTES + ALERT_ROUTES + ROLLOUT_ROUTES
)
