"""Request bodies → pydantic models, with every failure as one clear error shape."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from shared import jsonlimits
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from aiohttp import web

M = TypeVar("M", bound=BaseModel)

_EMPTY: tuple[object, ...] = (None, False, [], {})


# A body that does not arrive (a stalled client, or a compressed body whose decoder waits
# for more) must not hold a connection and a handler forever.
BODY_TIMEOUT_S = 30.0


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object, or the error shape."""
    try:
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except TimeoutError:
        raise ApiError(
            ErrorCode.bad_request, f"the body did not arrive within {BODY_TIMEOUT_S:g} s"
        ) from None
    return decode_json(raw)


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        body = jsonlimits.loads(raw)
    except jsonlimits.JsonLimitError as err:
        raise ApiError(ErrorCode.invalid_json, f"the body is JSON this API refuses: {err}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(ErrorCode.invalid_json, f"the body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise ApiError(ErrorCode.invalid_json, "the body must be a JSON object")
    try:
        # JSON's \ud800 escapes decode to lone surrogates, which are not Unicode text and
        # cannot reach the tokenizer; refuse them here, once, for every field.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(
            ErrorCode.invalid_json, "the body holds a lone UTF-16 surrogate, which is not text"
        ) from err
    return body


def parse_body(
    model: type[M], body: dict[str, Any], unsupported: frozenset[str] = frozenset()
) -> M:
    for name in sorted(unsupported & body.keys()):
        if body[name] not in _EMPTY:
            raise ApiError(
                ErrorCode.unsupported_parameter,
                f"`{name}` is not supported by this appliance; remove it",
                param=name,
            )
    try:
        return model.model_validate({k: v for k, v in body.items() if k not in unsupported})
    except ValidationError as err:
        raise _translate(err) from err


def param_path(loc: tuple[int | str, ...]) -> str:
    """OpenAI writes parameter paths as `messages[0].content`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _translate(err: ValidationError) -> ApiError:
    errors = err.errors(include_url=False)
    # A union reports one error per member; the deepest location is the useful one, and
    # there a broken constraint (an empty list) says more than "not a string" from another member.
    cleaned = [(_clean_loc(e["loc"]), e) for e in errors]
    loc, first = max(cleaned, key=lambda pair: (len(pair[0]), pair[1]["type"] not in _WRONG_TYPE))
    param = param_path(loc) or None
    kind = first["type"]
    if kind == "extra_forbidden":
        return ApiError(
            ErrorCode.unknown_parameter, f"unrecognized request argument `{param}`", param=param
        )
    if kind == "missing":
        return ApiError(ErrorCode.missing_parameter, f"`{param}` is required", param=param)
    if param == "n":
        return ApiError(ErrorCode.unsupported_parameter, "only `n: 1` is supported", param=param)
    return ApiError(ErrorCode.invalid_parameter, f"`{param}`: {first['msg']}", param=param)


# Error types that say only "the value is not of this union member's type".
_WRONG_TYPE = frozenset(
    {"string_type", "int_type", "int_parsing", "list_type", "none_required", "model_type"}
)

# Fields holding a union discriminated by `type`: pydantic puts the tag after them in `loc`.
_DISCRIMINATED = frozenset({"response_format"})
_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """A location without the union-member tags that pydantic inserts."""
    out: list[int | str] = []
    skip_next = False
    for part in loc:
        if skip_next:
            skip_next = False
            continue
        if isinstance(part, str) and (
            part in _MEMBER_TAGS or "[" in part or part.startswith(("function-", "constrained-"))
        ):
            continue
        out.append(part)
        skip_next = part in _DISCRIMINATED
    return tuple(out)
