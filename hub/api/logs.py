"""`GET /v1/admin/nodes/{node}/logs`: a node's recent log records, read through the tunnel
on the node's fleet listener (hub/nodelogs.py). With `follow=1` the answer is a stream
(NDJSON, one record a line; server-sent events for `Accept: text/event-stream`) that goes
on, one long poll of the node after another, until the client goes."""

from __future__ import annotations

import json
import time

from aiohttp import web

from hub.api.route_kinds import Auth, Param, Route
from hub.appkeys import NODE_LOGS, SETTINGS, STORE
from hub.nodelogs import LogQuery, reachable_url
from shared import protocol
from shared.errors import ApiError, ErrorCode
from shared.supervise import client_gone, unless_gone

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"


def _int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    value = int(raw) if raw.isdigit() and len(raw) <= 16 else None
    if value is None or not low <= value <= high:
        raise ApiError(
            ErrorCode.invalid_value, f"`{name}` must be a whole number from {low} to {high}",
            param=name,
        )  # fmt: skip
    return value


def log_query(request: web.Request) -> tuple[LogQuery, bool]:
    """`after`, `limit`, `level`, `tail` and `follow` of the query, checked."""
    after = _int(request, "after", 0, 0, 2**53)
    limit = _int(request, "limit", 100, 1, protocol.MAX_LOG_RECORDS)
    level = request.query.get("level", "debug").upper()
    if level not in protocol.LOG_LEVELS:
        raise ApiError(
            ErrorCode.invalid_value,
            f"`level` is one of {', '.join(n.lower() for n in protocol.LOG_LEVELS)}",
            param="level",
        )
    flags = {}
    for name in ("tail", "follow"):
        flag = request.query.get(name, "0").lower()
        if flag not in {"0", "1", "true", "false"}:
            raise ApiError(ErrorCode.invalid_value, f"`{name}` is 1 or 0", param=name)
        flags[name] = flag in {"1", "true"}
    query = LogQuery(after=after, limit=limit, level=level, tail=flags["tail"])
    return query, flags["follow"]


async def node_logs(request: web.Request) -> web.StreamResponse:
    query, follow = log_query(request)
    store = request.app[STORE]
    node = await store.run(store.sync.nodes.get, request.match_info["node"])
    url = reachable_url(node, request.app[SETTINGS], time.time())
    reader = request.app[NODE_LOGS]
    answer = await reader.read(node, url, query)  # a failure here: the error shape
    if not follow:
        return web.json_response(text=answer.model_dump_json())
    sse = SSE in request.headers.get("Accept", "")
    response = web.StreamResponse(
        headers={"Content-Type": SSE if sse else NDJSON, "Cache-Control": "no-store"}
    )
    await response.prepare(request)
    try:
        while True:
            for record in answer.records:
                line = record.model_dump_json()
                await response.write(
                    f"id: {record.seq}\ndata: {line}\n\n".encode() if sse else f"{line}\n".encode()
                )
            if client_gone(request):
                return response
            query = query.following(answer)
            try:
                # The node's long poll ends with the follower: the hub cancels its call,
                # and the node sees its client go.
                polled, answered = await unless_gone(
                    lambda: client_gone(request), reader.read(node, url, query)
                )
                if not polled or answered is None:
                    return response
                answer = answered
            except ApiError as err:  # the node went: said, as the stream's last line
                body = json.dumps(err.body())
                await response.write(
                    f"event: error\ndata: {body}\n\n".encode() if sse else f"{body}\n".encode()
                )
                break
        await response.write_eof()
    except ConnectionError:  # the client went while a record was written
        pass
    return response


_PARAMS = (
    Param(
        "after",
        "query",
        "the last seq the reader has: records after it",
        {"type": "integer", "minimum": 0},
    ),
    Param(
        "limit",
        "query",
        "records at most (each answer of a follow too)",
        {"type": "integer", "minimum": 1, "maximum": protocol.MAX_LOG_RECORDS},
    ),
    Param(
        "level",
        "query",
        "the least severe level shown",
        {"type": "string", "enum": [n.lower() for n in protocol.LOG_LEVELS]},
    ),
    Param(
        "tail",
        "query",
        "1: the last `limit` records rather than the first after `after`",
        {"type": "string", "enum": ["0", "1"]},
    ),
    Param(
        "follow", "query", "1: stream records as they come", {"type": "string", "enum": ["0", "1"]}
    ),
)
LOGS_ROUTE = Route(
    "GET",
    "/v1/admin/nodes/{node}/logs",
    node_logs,
    "A node's recent log records (its bounded ring), read through the tunnel on its "
    "fleet listener; `follow=1` streams them on (NDJSON, or server-sent events for "
    "`Accept: text/event-stream`) until the client goes.",
    Auth.operator,
    answer=protocol.LogsAnswer,
    answer_types=("application/json", NDJSON, SSE),
    errors=(ErrorCode.not_found, ErrorCode.node_offline, ErrorCode.node_unreachable),
    params=_PARAMS,
)
