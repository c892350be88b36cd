"""The hub's OpenAPI 3.1 document (`GET /openapi.json`): its node API (`/v1/enroll`,
`/v1/node/…`) and its operator API (`/v1/admin/…`), made from one route table and the
pydantic models the handlers parse and answer with: the protocol's messages
(shared.protocol) for the node API, the operator request models (hub/api/requests.py).

The table is checked against the routes the hub registers (tests/hub/test_openapi.py),
and the document drives the hub's fuzzing (tests/hub/test_fuzz.py): a route the table
lacks is neither documented nor fuzzed.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web
from pydantic.json_schema import models_json_schema

from hub.api.requests import (
    DeploymentRequest,
    DrainRequest,
    KeyRequest,
    SeedRequest,
    TenancyRequest,
    TokenRequest,
)
from shared import __version__, protocol
from shared.errors import ERROR_SCHEMA, ErrorCode

if TYPE_CHECKING:
    from pydantic import BaseModel
    from pydantic.json_schema import JsonSchemaMode

    # Each model's schema, by model and way (parsed or answered): a `$ref` to its component.
    Refs = dict[tuple[type[BaseModel], JsonSchemaMode], dict[str, Any]]


class Auth(StrEnum):
    none = "none"
    enrollment = "enrollment"  # an enrollment token, in the body
    node = "node"  # the node token, `Authorization: Bearer kvln_…`
    operator = "operator"  # an operator token, `Authorization: Bearer kvlo_…`


@dataclass(frozen=True)
class Param:
    name: str
    where: Literal["query", "header"]
    description: str
    schema: dict[str, Any]
    required: bool = False


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # as documented: an OpenAPI path template
    summary: str
    auth: Auth
    request: type[BaseModel] | None = None  # the JSON body the handler parses
    answer: type[BaseModel] | None = None  # the JSON it answers (None: a plain object)
    status: int = 200  # of a success
    errors: tuple[ErrorCode, ...] = ()  # beyond those of its auth and its body
    params: tuple[Param, ...] = ()
    # Where the body is not JSON: its media type (a package archive).
    body_type: str | None = None
    # Where the answer is not JSON: its media types.
    answer_types: tuple[str, ...] = ("application/json",)
    other_statuses: tuple[tuple[int, str], ...] = ()  # successes besides `status`
    # The router's template where it differs from the documented path (aiohttp's
    # `resource.canonical`: a value that holds a slash, one route for several paths).
    router_path: str | None = None
    # Path parameters whose values are constrained (by the router's regex).
    path_schemas: tuple[tuple[str, dict[str, Any]], ...] = ()

    @property
    def registered(self) -> str:
        return self.router_path or self.path


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
_OFFLOADED = {
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
            ErrorCode.missing_parameter,
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
                ErrorCode.invalid_parameter,
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
        "A model file placed on, or a package archive seeded to, the calling node, by "
        "sha256 (its ETag); Range requests resume a cut download.",
        Auth.node,
        answer_types=("application/octet-stream",),
        errors=(ErrorCode.not_found,),
        other_statuses=((206, "The range asked for"),),
        path_schemas=(("sha256", _SHA256),),
    ),
)

_NOT_FOUND = (ErrorCode.not_found,)
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
        "/v1/admin/nodes/{node}/revoke",
        "Revoke a node.",
        Auth.operator,
        errors=_NOT_FOUND,
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
        "/v1/admin/loops",
        "The hub's background loops: those running, any stopped, each one's failed "
        "rounds (count, last error, when).",
        Auth.operator,
    ),
)

ROUTES: tuple[Route, ...] = NODE_ROUTES + ADMIN_ROUTES

_PROTOCOL = Param(
    protocol.PROTOCOL_HEADER,
    "header",
    f"the node's protocol version (this hub serves {protocol.OLDEST_NODE_PROTOCOL} to "
    f"{protocol.PROTOCOL_VERSION})",
    {"type": "string", "pattern": "^[0-9]{1,6}$"},
)
_AUTH_ERRORS = {
    Auth.none: (),
    Auth.enrollment: (ErrorCode.protocol_unsupported,),
    Auth.node: (
        ErrorCode.protocol_unsupported,
        ErrorCode.invalid_node_token,
        ErrorCode.node_revoked,
        ErrorCode.wrong_source_address,
        ErrorCode.client_certificate_required,
        ErrorCode.certificate_mismatch,
    ),
    Auth.operator: (ErrorCode.invalid_operator_token,),
}
_BODY_ERRORS = (ErrorCode.invalid_json, ErrorCode.invalid_parameter, ErrorCode.request_too_large)
_SECURITY = {Auth.node: "nodeToken", Auth.operator: "operatorToken"}
_PATH_PARAM = re.compile(r"\{([^}]+)\}")


def _schemas() -> tuple[Refs, dict[str, Any]]:
    """Every model's schema, in one set of components (a model used both ways, parsed and
    answered, gets one per way only where the two differ)."""
    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = []
    for route in ROUTES:
        if route.request is not None:
            wanted.append((route.request, "validation"))
        if route.answer is not None:
            wanted.append((route.answer, "serialization"))
    made, defs = models_json_schema(wanted, ref_template="#/components/schemas/{model}")
    refs: Refs = {(model, mode): made[(model, mode)] for model, mode in wanted}
    return refs, defs.get("$defs", {})


def _operation(route: Route, refs: Refs) -> Any:
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": f"{route.method.lower()}_{re.sub(r'[^a-z0-9]+', '_', route.path)}".strip(
            "_"
        ),
        "tags": ["node" if route in NODE_ROUTES else "operator"],
    }
    if route.auth in _SECURITY:
        op["security"] = [{_SECURITY[route.auth]: []}]
    values = dict(route.path_schemas)
    params: list[dict[str, Any]] = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": values.get(name, {"type": "string", "minLength": 1}),
        }
        for name in _PATH_PARAM.findall(route.path)
    ]
    extra = (_PROTOCOL,) if route.auth in {Auth.node, Auth.enrollment} else ()
    params.extend(
        {
            "name": param.name,
            "in": param.where,
            "required": param.required,
            "description": param.description,
            "schema": param.schema,
        }
        for param in (*route.params, *extra)
    )
    if params:
        op["parameters"] = params
    if route.request is not None:
        schema = refs[(route.request, "validation")]
        # No body is every default (hub.http's parse): required only where a field is.
        required = bool(route.request.model_json_schema().get("required"))
        op["requestBody"] = {
            "required": required,
            "content": {"application/json": {"schema": schema}},
        }
    elif route.body_type is not None:
        op["requestBody"] = {
            "required": True,
            "content": {route.body_type: {"schema": {"type": "string", "format": "binary"}}},
        }
    elif route.router_path is not None and "offload" in route.path:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _OFFLOADED}},
        }
    answer = (
        refs[(route.answer, "serialization")] if route.answer is not None else {"type": "object"}
    )
    content = {
        kind: {"schema": answer if kind == "application/json" else {"type": "string"}}
        for kind in route.answer_types
    }
    responses: dict[str, Any] = {str(route.status): {"description": "Success", "content": content}}
    for status, description in route.other_statuses:
        responses[str(status)] = {"description": description}
        if status == 206:
            responses[str(status)]["content"] = content
    codes: dict[int, list[str]] = {}
    body: tuple[ErrorCode, ...] = _BODY_ERRORS if route.request is not None else ()
    if route.params and not body:
        body = (ErrorCode.invalid_parameter,)
    every = (*_AUTH_ERRORS[route.auth], *body, *route.errors, ErrorCode.internal_error)
    for code in dict.fromkeys(every):  # each once, in order
        codes.setdefault(code.status, []).append(code.value)
    for status, names in sorted(codes.items()):
        responses[str(status)] = {
            "description": "Error: " + ", ".join(names),
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    op["responses"] = responses
    return op


@functools.cache
def build_openapi() -> dict[str, Any]:
    """The document (made once: it depends on the code only)."""
    refs, components = _schemas()
    if "Error" in components:
        raise ValueError("a model named Error would hide the error shape's schema")
    paths: dict[str, Any] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, refs)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Kovenlab Edge hub",
            "version": __version__,
            "description": "The node API (appliances, through their tunnel) and the operator "
            "API (the console, `kvl`, tools). Errors are one shape: "
            '`{"error": {"message", "type", "param", "code"}}`.',
        },
        "paths": paths,
        "components": {
            "schemas": {**components, "Error": ERROR_SCHEMA},
            "securitySchemes": {
                "nodeToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the node token enrollment answered (`kvln_…`)",
                },
                "operatorToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an operator token (`kvl hub operators create`, `kvlo_…`)",
                },
            },
        },
    }


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(build_openapi())


def openapi_route() -> web.RouteDef:
    return web.get("/openapi.json", openapi)
