"""The hub's OpenAPI 3.1 document (`GET /openapi.json`): its node API (`/v1/enroll`,
`/v1/node/…`) and its operator API (`/v1/admin/…`), made from the route table
(hub/api/route_table.py, each route declared once beside its handler) and the pydantic
models the handlers parse and answer with: the protocol's messages (shared.protocol) for
the node API, the operator request models (hub/api/requests.py).

The app registers the same table, and the document drives the hub's fuzzing
(tests/hub/test_fuzz.py): a route is registered, documented and fuzzed, or none of these.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pydantic.json_schema import models_json_schema

from hub.api.route_kinds import Auth, Param
from shared import __version__, protocol
from shared.errors import ERROR_SCHEMA, ErrorCode

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pydantic import BaseModel
    from pydantic.json_schema import JsonSchemaMode

    from hub.api.route_kinds import Route

    # Each model's schema, by model and way (parsed or answered): a `$ref` to its component.
    Refs = dict[tuple[type[BaseModel], JsonSchemaMode], dict[str, Any]]


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
_BODY_ERRORS = (ErrorCode.invalid_json, ErrorCode.invalid_value, ErrorCode.request_too_large)
_SECURITY = {Auth.node: "nodeToken", Auth.operator: "operatorToken"}
_PATH_PARAM = re.compile(r"\{([^}]+)\}")


def _schemas(routes: Sequence[Route]) -> tuple[Refs, dict[str, Any]]:
    """Every model's schema, in one set of components (a model used both ways, parsed and
    answered, gets one per way only where the two differ)."""
    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = []
    for route in routes:
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
        "tags": ["operator" if route.auth is Auth.operator else "node"],
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
    elif route.body_schema is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": route.body_schema}},
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
        body = (ErrorCode.invalid_value,)
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


def build_openapi(routes: Sequence[Route]) -> dict[str, Any]:
    """The document of `routes` (the hub serves route_table.py's `openapi_document`)."""
    refs, components = _schemas(routes)
    if "Error" in components:
        raise ValueError("a model named Error would hide the error shape's schema")
    paths: dict[str, Any] = {}
    for route in routes:
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
