"""The hub's route table: every route of its node API and its operator API, each declared
once beside its handler, in the module of its feature (a `Route`, hub/api/route_kinds.py),
and joined here into the one list that the app registers (hub/app.py, through
`route_defs`), the OpenAPI document describes (hub/api/openapi.py) and tests/hub/
test_fuzz.py fuzzes; tests/hub/test_openapi.py checks that the hub registers nothing
else but the console's pages. Besides: the hub's own two routes, its liveness and that
document."""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web

from hub.api import (
    alerts,
    enrollment,
    node,
    objectives,
    operator,
    pulls,
    rollouts,
    settings,
    uploads,
)
from hub.api.openapi import build_openapi
from hub.api.route_kinds import Auth, Route
from hub.appkeys import LOOPS
from shared import __version__, protocol


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


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document of the table (made once: it depends on the code only)."""
    return build_openapi(ROUTES)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", health, "Liveness: the process is up.", Auth.none),
    Route("GET", "/openapi.json", openapi, "This document.", Auth.none),
    *enrollment.ROUTES,
    *node.ROUTES,
    *operator.ROUTES,
    *objectives.ROUTES,
    *alerts.ROUTES,
    *rollouts.ROUTES,
    *pulls.ROUTES,
    *settings.ROUTES,
    *uploads.ROUTES,
)
