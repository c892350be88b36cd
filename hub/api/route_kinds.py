"""What a route of the hub is: its declaration (`Route`: method, path, handler, what it
parses and answers, its auth, parameters and errors), made once, beside its handler, in the
module of its feature; and `route_defs`, the one place those declarations become aiohttp
routes. hub/api/route_table.py joins the features' routes into the one table that the
app registers, the OpenAPI document (hub/api/openapi.py) describes and the fuzzing
(tests/hub/test_fuzz.py) sends requests to."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pydantic import BaseModel

    from hub.http import Handler
    from shared.errors import ErrorCode

# A variable of an aiohttp route pattern, `{name}` or `{name:regex}` (a regex may hold one
# level of braces, `{64}`, as aiohttp's own parser allows).
_VARIABLE = re.compile(r"\{([_a-zA-Z][_a-zA-Z0-9]*)(?::((?:[^{}]|\{[^{}]*\})+))?\}")


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
    handler: Handler
    summary: str
    auth: Auth
    request: type[BaseModel] | None = None  # the JSON body the handler parses
    answer: type[BaseModel] | None = None  # the JSON it answers (None: a plain object)
    status: int = 200  # of a success
    errors: tuple[ErrorCode, ...] = ()  # beyond those of its auth and its body
    params: tuple[Param, ...] = ()
    # Where the body is not JSON: its media type (a package archive).
    body_type: str | None = None
    # Where the body is JSON that no model parses (a request a node shed): its schema.
    body_schema: dict[str, Any] | None = None
    # Where the answer is not JSON: its media types.
    answer_types: tuple[str, ...] = ("application/json",)
    other_statuses: tuple[tuple[int, str], ...] = ()  # successes besides `status`
    # The router's pattern where it differs from the documented path: a path variable
    # constrained by a regex (documented as the variable's pattern), or a value that holds
    # a slash (one registration for several documented paths, sharing the handler).
    router_path: str | None = None

    @property
    def pattern(self) -> str:
        """What the router is given."""
        return self.router_path or self.path

    @property
    def registered(self) -> str:
        """The router's template without its regexes (aiohttp's `resource.canonical`)."""
        return _VARIABLE.sub(lambda found: "{" + found[1] + "}", self.pattern)

    @property
    def path_schemas(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        """The documented path's variables that the router constrains, with their schema."""
        documented = set(_VARIABLE.findall(self.path))
        return tuple(
            (name, {"type": "string", "pattern": f"^{regex}$"})
            for name, regex in _VARIABLE.findall(self.pattern)
            if regex and (name, "") in documented
        )


def route_defs(routes: Iterable[Route]) -> list[web.RouteDef]:
    """The aiohttp routes of `routes`, in their order: one per method and router pattern
    (several documented paths may share one, and then their handler). The one place the
    hub's API is registered: a GET answers HEAD too, as `web.get` does."""
    made: dict[tuple[str, str], web.RouteDef] = {}
    for route in routes:
        key = (route.method, route.pattern)
        registered = made.setdefault(key, web.route(route.method, route.pattern, route.handler))
        if registered.handler is not route.handler:
            raise ValueError(f"{route.method} {route.pattern} is declared with two handlers")
    return list(made.values())
