"""The hub's half of burst offload: hand a request one node shed to another node, and
stream the answer back. The choice of node is pure (hub/planning/offload.py); this is the
I/O around it.

The hub calls the chosen node's LAN API (through the tunnel, at the address its
heartbeats come from) on `/v1/offloaded/…` with the client's own API key, which the
origin node handed over and the hub checked: the serving node authenticates it like any
key and takes account and class from it, so no node can make another run a request as
an account it names. Only nodes that say they take offloaded requests this way (protocol
2, `capacity.offload`) are chosen, and only over mutual TLS: the call goes to the node's
fleet listener (protocol 3), whose certificate must chain to the fleet's CA, name the
address called and carry a node's URI, and the hub presents its own. A node without one
(or that says `tls: false`) is never sent a client's key.
A node that refuses for load (429, 503) is skipped for the next candidate; when none is
left the origin gets 429 `overloaded` with `Retry-After`. The response names the node
that served it (`X-Kvl-Served-By`). The hub remembers how its offloads to each node went
(failures, latency to the answer's headers), and ranks candidates by that before what
they say of themselves (hub/planning/offload.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from opentelemetry.trace import SpanKind

from hub.planning.offload import NodeLoad, candidates
from shared import protocol
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from hub.certificates import HubTls
    from hub.state.nodes import Node
    from shared.tracing import Tracing

log = logging.getLogger(__name__)

MAX_TRIES = 2  # candidates tried before the origin is told no
RETRY_AFTER_S = 5.0
PASSED_HEADERS = ("Content-Type", "X-Kvl-Model", "X-Kvl-Request-Id", "Retry-After")
FAILURES_KEPT_S = 300.0  # an offload that failed counts against its node this long
LATENCY_WEIGHT = 0.3  # of the newest offload in the node's latency (a moving average)
NODES_MEASURED = 10_000  # nodes whose offloads are remembered (the oldest forgotten)


@dataclass
class Measured:
    """How the hub's offloads to one node went lately."""

    latency_s: float | None = None
    failed_at: deque[float] = field(default_factory=lambda: deque(maxlen=16))

    def failures(self, now: float) -> int:
        return sum(1 for at in self.failed_at if now - at < FAILURES_KEPT_S)


class Measurements:
    """The hub's own record of its offloads to each node, bounded: what ranks nodes
    before what their heartbeats claim."""

    def __init__(self) -> None:
        self._nodes: dict[str, Measured] = {}

    def of(self, node_id: str) -> Measured:
        return self._nodes.get(node_id) or Measured()

    def _entry(self, node_id: str) -> Measured:
        found = self._nodes.pop(node_id, None)
        if found is None:
            found = Measured()
            if len(self._nodes) >= NODES_MEASURED:
                del self._nodes[next(iter(self._nodes))]  # the least recently offloaded to
        self._nodes[node_id] = found
        return found

    def answered(self, node_id: str, seconds: float) -> None:
        entry = self._entry(node_id)
        entry.latency_s = (
            seconds
            if entry.latency_s is None
            else (1 - LATENCY_WEIGHT) * entry.latency_s + LATENCY_WEIGHT * seconds
        )

    def failed(self, node_id: str, at: float) -> None:
        self._entry(node_id).failed_at.append(at)


def load_of(node: Node, measured: Measured | None = None, now: float | None = None) -> NodeLoad:
    """A node's load as its last heartbeat said (validated: no negative queue, no more
    free memory than it has), so its claims rank it within its own capacity only, with
    what the hub measured of its offloads to it."""
    capacity = node.capacity
    measured = measured or Measured()
    return NodeLoad(
        id=node.id,
        name=node.name,
        models=tuple(capacity.models),
        queue_waiting=capacity.queue_waiting,
        cpu_percent=capacity.cpu_percent,
        memory_available_mib=capacity.memory_available_mib,
        last_seen=node.last_seen,
        revoked=node.revoked,
        reachable=node.fleet_url is not None and capacity.offload,
        failures=measured.failures(time.time() if now is None else now),
        latency_s=measured.latency_s,
    )


class Forwarder:
    """One client session for every forwarded request, over mutual TLS: the node's
    certificate must chain to the fleet's CA bundle and name the address called (its
    overlay address, which is its alone), and the hub presents its own certificate,
    which the node's fleet listener requires."""

    def __init__(self, hub_tls: HubTls, tracing: Tracing) -> None:
        self._tls = hub_tls
        self._tracing = tracing
        self.measured = Measurements()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
        )

    async def close(self) -> None:
        await self._session.close()

    async def forward(
        self,
        request: web.Request,
        route: str,
        body: bytes,
        nodes: list[Node],
        *,
        origin: Node,
        client_key: str,
        model: str,
        now: float,
        stale_after_s: float,
        serves: Callable[[Node], Awaitable[bool]],
    ) -> web.StreamResponse:
        """``serves(node)``: whether the node holds the client's account (a node
        dedicated to another tenant does not: it would only refuse the key). The hub's
        hop is one span (`hub.offload`), the child of the origin's offload span; the
        serving node's spans are its children."""
        with self._tracing.span(
            "hub.offload",
            {"kvl.model": model, "kvl.origin": origin.name, "kvl.route": route},
            kind=SpanKind.SERVER,
            parent=request.headers,
        ) as span:
            try:
                response, served_by = await self._forward(
                    request, route, body, nodes, origin=origin, client_key=client_key,
                    model=model, now=now, stale_after_s=stale_after_s, serves=serves,
                )  # fmt: skip
            except ApiError as err:
                span.set_attribute("error.type", err.code.value)
                raise
            span.set_attribute("kvl.served_by", served_by)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _forward(
        self,
        request: web.Request,
        route: str,
        body: bytes,
        nodes: list[Node],
        *,
        origin: Node,
        client_key: str,
        model: str,
        now: float,
        stale_after_s: float,
        serves: Callable[[Node], Awaitable[bool]],
    ) -> tuple[web.StreamResponse, str]:
        by_id = {n.id: n for n in nodes}
        loads = [load_of(n, self.measured.of(n.id), now) for n in nodes]
        ranked = candidates(
            loads,
            model=model,
            origin=origin.id,
            offloaded=request.headers.get(protocol.OFFLOADED_HEADER) is not None,
            now=now,
            stale_after_s=stale_after_s,
        )
        chosen: list[Node] = []
        for load in ranked:
            if len(chosen) == MAX_TRIES:
                break
            if await serves(by_id[load.id]):
                chosen.append(by_id[load.id])
        tried: list[str] = []
        for target in chosen:
            tried.append(target.name)
            answer = await self._try(request, route, body, target, origin, client_key=client_key)
            if answer is not None:
                return answer, target.name
        why = (
            f"no other node of the fleet has room for {model} (tried {', '.join(tried)})"
            if tried
            else f"no other node of the fleet serves {model} with room to spare"
        )
        raise ApiError(ErrorCode.overloaded, why, retry_after=RETRY_AFTER_S)

    async def _try(
        self,
        request: web.Request,
        route: str,
        body: bytes,
        target: Node,
        origin: Node,
        *,
        client_key: str,
    ) -> web.StreamResponse | None:
        assert target.fleet_url is not None  # noqa: S101 - candidates are reachable
        headers = {
            "Authorization": f"Bearer {client_key}",
            "Content-Type": "application/json",
            protocol.ORIGIN_HEADER: origin.name,
            protocol.OFFLOADED_HEADER: "1",
        }
        # One offloaded request is one trace: the hub's span (or, tracing off here, the
        # origin's W3C headers as they came) goes on to the target as its parent.
        self._tracing.inject(headers, request.headers)
        url = f"{target.fleet_url}/v1/offloaded/{route}"
        started = time.monotonic()
        try:
            upstream = await self._session.post(
                url, data=body, headers=headers, ssl=self._tls.client
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            # Unreachable, or its certificate failed the handshake (not a node's, not
            # for the address called): never sent the client's key, and tried last for
            # a while.
            self.measured.failed(target.id, time.time())
            log.warning("offload to %s failed: %s", target.name, err)
            return None
        try:
            if upstream.status in {429, 503}:
                log.info("offload: %s has no room either (%d)", target.name, upstream.status)
                return None
            if upstream.status >= 500:
                self.measured.failed(target.id, time.time())
            else:
                self.measured.answered(target.id, time.monotonic() - started)
            response = web.StreamResponse(status=upstream.status)
            for name in PASSED_HEADERS:
                if name in upstream.headers:
                    response.headers[name] = upstream.headers[name]
            response.headers[protocol.SERVED_BY_HEADER] = target.name
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            upstream.release()
