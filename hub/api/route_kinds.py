"""What the route table (hub/api/route_table.py) is made of: a route, its parameters and
its auth. A module of its own, so that a feature's routes can be described beside it
(hub/api/rollout_routes.py) and joined into the one table."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pydantic import BaseModel

    from shared.errors import ErrorCode


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
