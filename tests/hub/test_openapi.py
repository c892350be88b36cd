"""The hub's OpenAPI document (hub/api/openapi.py): its route table is every route the hub
registers but the console's pages, each declared once, the document it serves is valid
OpenAPI 3.1, and the README lists every route."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import schemathesis
from aiohttp import web

from hub.api.route_kinds import Auth, Route, route_defs
from hub.api.route_table import ROUTES, openapi_document
from hub.app import create_app
from tests.docs import DOCS
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer


def registered(tmp_path: Path) -> set[tuple[str, str]]:
    """(method, template) of every route a hub registers, but the console's HTML pages
    and static files (and the HEAD that aiohttp adds beside each GET)."""
    app = create_app(settings_for(tmp_path, {}))
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
        and route.method != "HEAD"
        and not route.resource.canonical.startswith("/console")
    }


def test_the_table_is_every_route_the_hub_registers(tmp_path: Path) -> None:
    table = {(route.method, route.registered) for route in ROUTES}
    assert table == registered(tmp_path)
    documented = [(route.method, route.path) for route in ROUTES]
    assert len(documented) == len(set(documented)), "a route is in the table twice"


async def _handler(request: web.Request) -> web.Response:
    return web.Response()


async def _other(request: web.Request) -> web.Response:
    return web.Response()


def test_documented_paths_that_share_a_router_pattern_are_registered_once() -> None:
    """One aiohttp route for the offload paths, with the router's regexes; a second
    handler for the same pattern is a mistake the registration refuses."""
    shared = [
        Route("POST", f"/x/{name}", _handler, "x", Auth.none, router_path="/x/{route:.+}")
        for name in ("a", "b/c")
    ]
    artifact = Route("GET", "/y/{sha}", _handler, "y", Auth.none, router_path="/y/{sha:[0-9]{4}}")
    made = route_defs([*shared, artifact])
    assert [(d.method, d.path) for d in made] == [
        ("POST", "/x/{route:.+}"),
        ("GET", artifact.router_path),
    ]
    assert artifact.registered == "/y/{sha}"
    assert artifact.path_schemas == (("sha", {"type": "string", "pattern": "^[0-9]{4}$"}),)
    assert shared[0].path_schemas == ()  # the variable is not in the documented path
    clash = Route("POST", "/x/d", _other, "x", Auth.none, router_path="/x/{route:.+}")
    with pytest.raises(ValueError, match="two handlers"):
        route_defs([*shared, clash])


async def test_the_served_document_is_valid_openapi_3_1(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    server = await aiohttp_server(create_app(settings_for(tmp_path, {})))
    async with aiohttp.ClientSession() as client:
        served = await client.get(server.make_url("/openapi.json"))
        assert served.status == 200
        doc: dict[str, Any] = await served.json()
    assert doc == openapi_document()
    assert doc["openapi"] == "3.1.0"
    # schemathesis checks it against the OpenAPI 3.1 meta-schema, and resolves every $ref.
    schema = schemathesis.openapi.from_dict(doc, config=schemathesis.Config())
    schema.validate()
    for route in ROUTES:  # each route an operation schemathesis can generate cases for
        assert schema[route.path][route.method].path == route.path
    try:  # the validator of the OpenAPI project too, where it is installed
        validator = importlib.import_module("openapi_spec_validator")
    except ImportError:
        pass
    else:
        validator.validate(doc)


def test_the_validation_catches_a_broken_document() -> None:
    """The check above would see a document that breaks the meta-schema."""
    broken = {**openapi_document(), "paths": {"/x": {"get": {"responses": {"200": {}}}}}}
    with pytest.raises(Exception, match="description"):
        schemathesis.openapi.from_dict(broken, config=schemathesis.Config()).validate()


def test_request_and_answer_models_are_in_the_document() -> None:
    doc = openapi_document()
    enroll = doc["paths"]["/v1/enroll"]["post"]
    assert enroll["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EnrollRequest"
    }
    assert enroll["responses"]["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EnrollAnswer"
    }
    heartbeat = doc["paths"]["/v1/node/heartbeat"]["post"]
    assert heartbeat["security"] == [{"nodeToken": []}]
    assert "Kvl-Protocol" in {p["name"] for p in heartbeat["parameters"]}
    deploy = doc["paths"]["/v1/admin/deployments"]["post"]
    assert deploy["security"] == [{"operatorToken": []}]
    assert deploy["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/DeploymentRequest"
    }
    assert "401" in deploy["responses"]
    assert set(doc["components"]["schemas"]["Capacity"]["properties"]) >= {"cpu_percent"}


def test_the_readme_lists_every_route() -> None:
    for route in ROUTES:
        # As far as the first parameter: the README writes `{chat/completions,completions}`.
        assert f"`{route.method} {route.registered.split('{')[0]}" in DOCS, route.path
