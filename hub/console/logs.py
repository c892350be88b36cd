"""The node page's recent log records: the last ones the node holds, read through the
tunnel as the operator API reads them (hub/nodelogs.py), with a short deadline so that a
node that does not answer costs the page a few seconds at most and says why."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hub.appkeys import NODE_LOGS
from hub.nodelogs import LogQuery, reachable_url
from shared import protocol
from shared.errors import ApiError

if TYPE_CHECKING:
    from aiohttp import web

    from hub.settings import HubSettings
    from hub.state.nodes import Node

SHOWN = 100  # records on the page
PAGE_CALL_S = 4.0  # the page's wait for the node


@dataclass(frozen=True)
class RecentLogs:
    level: str  # the least severe level shown, lower case
    records: list[protocol.LogRecord] = field(default_factory=list)
    problem: str | None = None  # why there are none to show


def level_of(request: web.Request) -> str:
    """`?logs=LEVEL` (a level's name, any case); anything else: info."""
    wanted = request.query.get("logs", "info").upper()
    return wanted.lower() if wanted in protocol.LOG_LEVELS else "info"


async def recent_logs(
    request: web.Request, node: Node, settings: HubSettings, level: str
) -> RecentLogs:
    query = LogQuery(limit=SHOWN, level=level.upper(), tail=True)
    try:
        url = reachable_url(node, settings, time.time())
        answer = await request.app[NODE_LOGS].read(node, url, query, call_s=PAGE_CALL_S)
    except ApiError as err:
        return RecentLogs(level, problem=err.message)
    return RecentLogs(level, records=answer.records)
