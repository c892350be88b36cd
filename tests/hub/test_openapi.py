"""The hub's OpenAPI document (hub/api/openapi.py): its route table is every route the hub
registers but the console's pages, the document it serves is valid OpenAPI 3.1, and the
README lists every route."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import schemathesis

from hub.api.openapi import build_openapi
from hub.api.route_table import ROUTES
from hub.app import create_app
from tests.hubs import settings_for
from tests.test_docs import README

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


async def test_the_served_document_is_valid_openapi_3_1(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    server = await aiohttp_server(create_app(settings_for(tmp_path, {})))
    async with aiohttp.ClientSession() as client:
        served = await client.get(server.make_url("/openapi.json"))
        assert served.status == 200
        doc: dict[str, Any] = await served.json()
    assert doc == build_openapi()
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
    broken = {**build_openapi(), "paths": {"/x": {"get": {"responses": {"200": {}}}}}}
    with pytest.raises(Exception, match="description"):
        schemathesis.openapi.from_dict(broken, config=schemathesis.Config()).validate()


def test_request_and_answer_models_are_in_the_document() -> None:
    doc = build_openapi()
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
        assert f"`{route.method} {route.registered.split('{')[0]}" in README, route.path
