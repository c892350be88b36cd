"""An HTTP request's body → a JSON object, with every failure as the one error shape (the
request models and `parse_body` are `appliance.inference.schemas`)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING, Any

from shared import jsonlimits
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from aiohttp import web

# A body that does not arrive (a stalled client, or a compressed body whose decoder waits
# for more) must not hold a connection and a handler forever.
BODY_TIMEOUT_S = 30.0
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object, or the error shape."""
    if request.content.is_eof():  # all of it came with the headers: nothing to wait for
        return decode_json(await request.read())
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(
            ErrorCode.bad_request, f"the body did not arrive within {BODY_TIMEOUT_S:g} s"
        ) from None
    return decode_json(raw)


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        # JSON between systems is UTF-8 (RFC 8259, 8.1), decoded strictly here: Python's
        # JSON decoder would let a surrogate's three UTF-8-like bytes through, or take the
        # body for UTF-16 or UTF-32.
        body = jsonlimits.loads(raw.decode("utf-8-sig"))
    except jsonlimits.JsonLimitError as err:
        raise ApiError(ErrorCode.invalid_json, f"the body is JSON this API refuses: {err}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(ErrorCode.invalid_json, f"the body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise ApiError(ErrorCode.invalid_json, "the body must be a JSON object")
    # JSON's \ud800 escapes decode to lone surrogates, which are not Unicode text and
    # cannot reach the tokenizer; refuse them here, once, for every field. Only an escape
    # can make one (strict UTF-8 holds none): a body without one is not encoded again to
    # look.
    if _SURROGATE_ESCAPE.search(raw) is None:
        return body
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(
            ErrorCode.invalid_json, "the body holds a lone UTF-16 surrogate, which is not text"
        ) from err
    return body
