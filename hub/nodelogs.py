"""A node's recent log records, read by the hub on the node's fleet listener, through the
tunnel: what the operator API (`GET /v1/admin/nodes/{node}/logs`), `kvl hub nodes logs`
and the console's node page show. No shell on the node, no journal access: the node
keeps a bounded ring of its records (appliance/observability/logs.py) and answers the
hub alone (mutual TLS, the hub's certificate), as for an offloaded request
(hub/offload.py).

Each call is bounded (1,000 records, about 1 MiB, read at most `MAX_ANSWER_BYTES`) and
timed out; following is a series of long polls (`wait`, up to 30 s each).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import aiohttp
from pydantic import ValidationError

from hub.certificates import Authority
from hub.planning.health import NodeStatus, status_of
from shared import jsonlimits, protocol, tls
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    import ssl
    from collections.abc import Callable

    from hub.settings import HubSettings
    from hub.state.nodes import Node

log = logging.getLogger(__name__)

MAX_WAIT_S = 30.0  # a long poll's longest wait, as the node allows
FOLLOW_WAIT_S = 25.0  # each long poll of a follow: under the node's 30 s, a gone client seen
CALL_S = 15.0  # a call's time beyond its wait: connect, answer, read
MAX_ANSWER_BYTES = 8 << 20  # a node's answer read at most (its JSON of about 1 MiB of text)


@dataclass(frozen=True)
class LogQuery:
    after: int = 0
    limit: int = 100
    level: str = "DEBUG"
    wait_s: float = 0.0
    tail: bool = False  # the last `limit` records rather than the first after `after`

    def following(self, answer: protocol.LogsAnswer) -> LogQuery:
        """The next call of a follow, after ``answer``: a long poll for what comes next."""
        return replace(self, after=answer.next_after, wait_s=FOLLOW_WAIT_S, tail=False)


def reachable_url(node: Node, settings: HubSettings, now: float) -> str:
    """Where to read the node's logs; 409 `node_offline` for a node the hub cannot ask."""
    status = status_of(node, settings.fleet, now)
    if status in {NodeStatus.revoked, NodeStatus.offline}:
        raise ApiError(
            ErrorCode.node_offline, f"node {node.name} is {status.value}: its logs cannot be read"
        )
    url = node.fleet_url
    if url is None:
        raise ApiError(
            ErrorCode.node_offline,
            f"node {node.name} has no fleet listener (no certificate yet, or an older "
            "appliance): its logs cannot be read through the tunnel",
        )
    return url


def hub_client_context(settings: HubSettings) -> ssl.SSLContext:
    """The hub's client context from its files as they are, for a command on the hub's
    machine: nothing issued (a command run with other names in its settings than the
    hub's must not issue the hub's certificate again)."""
    certificate = settings.pki_dir / "server.crt", settings.pki_dir / "server.key"
    if not all(path.is_file() for path in certificate):
        raise ApiError(
            ErrorCode.node_unreachable,
            f"the hub has no certificate in {settings.pki_dir} yet: `kvl hub serve` makes it",
        )
    authority = Authority(settings)
    return tls.client_context(
        authority.phase().bundle, certificate, identity=authority.node_identity()
    )


class NodeLogs:
    """One client session for every read, with the hub's client certificate (``client``
    gives the current context: it follows a CA rotation)."""

    def __init__(self, client: Callable[[], ssl.SSLContext]) -> None:
        self._client = client
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def read(
        self, node: Node, url: str, query: LogQuery, *, call_s: float = CALL_S
    ) -> protocol.LogsAnswer:
        """One call (a long poll with ``query.wait_s``); 503 `node_unreachable` when the
        node does not answer, or not as it should, within ``call_s`` beyond its wait."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        params = {
            "after": str(query.after),
            "limit": str(query.limit),
            "level": query.level,
            "wait": f"{min(query.wait_s, MAX_WAIT_S):g}",
            "tail": "1" if query.tail else "0",
        }
        timeout = aiohttp.ClientTimeout(total=min(query.wait_s, MAX_WAIT_S) + call_s)
        try:
            async with self._session.get(
                f"{url}/v1/fleet/logs", params=params, ssl=self._client(), timeout=timeout
            ) as upstream:
                raw = bytearray()
                async for chunk in upstream.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > MAX_ANSWER_BYTES:
                        raise _unreachable(node, f"an answer over {MAX_ANSWER_BYTES} bytes")
                if upstream.status != 200:
                    raise _unreachable(node, f"it answered {upstream.status}: {_error(bytes(raw))}")
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            raise _unreachable(node, str(err) or type(err).__name__) from err
        try:
            return protocol.LogsAnswer.model_validate_json(raw)
        except ValidationError as err:
            raise _unreachable(node, "its answer is not a log answer") from err


def _unreachable(node: Node, why: str) -> ApiError:
    log.info("logs of %s: %s", node.name, why)
    return ApiError(ErrorCode.node_unreachable, f"node {node.name}'s logs: {why}")


def _error(raw: bytes) -> str:
    """The message of a node's error shape, or the start of what it sent."""
    text = raw[:300].decode(errors="replace")
    try:
        return str(jsonlimits.loads(raw)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text
