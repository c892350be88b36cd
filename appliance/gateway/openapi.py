"""A route of the LAN API as its table describes it, and the OpenAPI 3.1 document built from
a route table (`appliance.gateway.routes`) and its request models."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from shared import __version__
from shared.errors import ERROR_SCHEMA, ErrorCode

if TYPE_CHECKING:
    from pydantic import BaseModel

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    auth: bool
    body: type[BaseModel] | None = None
    errors: tuple[ErrorCode, ...] = ()
    streams: bool = False
    status: int = 200  # of a success
    # "hub": the fleet's hub calls it (handing over a request another node shed)
    caller: str = "client"
    # The router's pattern where it differs from the documented path (a slash in a value).
    router_path: str | None = None


def build_openapi(routes: Iterable[Route]) -> dict[str, Any]:
    components: dict[str, Any] = {"Error": ERROR_SCHEMA}
    paths: dict[str, Any] = {}
    for route in routes:
        op: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.handler.__name__,
            "responses": {str(route.status): {"description": "Success"}},
        }
        if route.auth:
            op["security"] = [{"bearer": []}]
        if route.body is not None:
            schema = route.body.model_json_schema(
                ref_template="#/components/schemas/{model}", by_alias=True
            )
            for name, definition in [
                *schema.pop("$defs", {}).items(),
                (route.body.__name__, schema),
            ]:
                # Two models of one name would share a component: the document would then
                # describe one body with the other's schema.
                if components.setdefault(name, definition) != definition:
                    raise ValueError(f"two request models are named {name}: rename one")
            op["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{route.body.__name__}"}
                    }
                },
            }
        if route.streams:
            op["responses"][str(route.status)]["description"] = (
                "The completion; with `stream: true`, server-sent events in OpenAI's chunk format"
            )
        statuses: dict[int, list[str]] = {}
        for code in route.errors:
            statuses.setdefault(code.status, []).append(code.value)
        if ErrorCode.internal_error not in route.errors:
            statuses.setdefault(500, []).append(ErrorCode.internal_error.value)
        for status, codes in sorted(statuses.items()):
            op["responses"][str(status)] = {
                "description": "Error: " + ", ".join(codes),
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Kovenlab Edge appliance", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
