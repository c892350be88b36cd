"""Routes only the fleet's hub calls, on the fleet listener (mutual TLS, the hub's
certificate: the middleware checks it, no API key): the node's recent log records."""

from __future__ import annotations

from aiohttp import web

from appliance.gateway.appkeys import LOGS
from appliance.observability import logs
from shared import protocol
from shared.errors import ApiError, ErrorCode
from shared.supervise import client_gone, unless_gone

FLEET_PREFIX = "/v1/fleet/"


def _number(request: web.Request, name: str, default: float, low: float, high: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw) if len(raw) <= 20 else None
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ApiError(
            ErrorCode.invalid_value,
            f"`{name}` must be a number from {low:g} to {high:g}",
            param=name,
        )
    return value


async def node_logs(request: web.Request) -> web.Response:
    """`?after=SEQ&limit=N&level=NAME&wait=S`: the records after SEQ, at NAME or above;
    with `wait`, answered as soon as there is one (a long poll), or empty after S;
    `tail=1`: the last N of them, at once."""
    after = int(_number(request, "after", 0, 0, 2**53))
    limit = int(_number(request, "limit", 100, 1, logs.MAX_LIMIT))
    wait = _number(request, "wait", 0, 0, logs.MAX_WAIT_S)
    level_name = request.query.get("level", "DEBUG")
    level = logs.level_number(level_name) if len(level_name) <= 20 else None
    if level is None:
        raise ApiError(
            ErrorCode.invalid_value,
            f"`level` is one of {', '.join(n.lower() for n in logs.LEVELS)}",
            param="level",
        )
    tail = request.query.get("tail", "0")
    if tail not in {"0", "1"}:
        raise ApiError(ErrorCode.invalid_value, "`tail` is 1 or 0", param="tail")
    ring = request.app[LOGS]
    if tail == "1":
        found = ring.read(after, limit, level, tail=True)
    elif wait > 0:
        waited, read = await unless_gone(
            lambda: client_gone(request), ring.wait(after, wait, limit, level)
        )
        if not waited or read is None:
            return web.Response(status=499)  # no one reads it: the hub went
        found = read
    else:
        found = ring.read(after, limit, level)
    answer = protocol.LogsAnswer(
        records=[k.record() for k in found.records],
        next_after=found.next_after,
        oldest=found.oldest,
        missed=found.missed,
    )
    return web.json_response(text=answer.model_dump_json())
