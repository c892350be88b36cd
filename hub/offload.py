"""The hub's half of burst offload: hand a request one node shed to another node, and
stream the answer back. The choice of node is pure (hub/planning/offload.py); this is the
I/O around it.

The hub calls the chosen node's LAN API (through the tunnel, at the address its
heartbeats come from) on `/v1/offloaded/…` with the client's own API key, which the
origin node handed over and the hub checked: the serving node authenticates it like any
key and takes account and class from it, so no node can make another run a request as
an account it names. Only nodes that say they take offloaded requests this way (protocol
2, `capacity.offload`) are chosen. The call goes to the node's fleet listener, over
mutual TLS (protocol 3): each side proves who it is with its certificate.
A node that refuses for load (429, 503) is skipped for the next candidate; when none is
left the origin gets 429 `overloaded` with `Retry-After`. The response names the node
that served it (`X-Kvl-Served-By`).
"""

from __future__ import annotations

import logging
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
    from hub.state.store import Node
    from shared.tracing import Tracing

log = logging.getLogger(__name__)

MAX_TRIES = 2  # candidates tried before the origin is told no
RETRY_AFTER_S = 5.0
PASSED_HEADERS = ("Content-Type", "X-Kvl-Model", "X-Kvl-Request-Id", "Retry-After")


def load_of(node: Node) -> NodeLoad:
    """A node's load as its last heartbeat said (validated: no negative queue, no more
    free memory than it has), so its claims rank it within its own capacity only."""
    capacity = node.capacity
    return NodeLoad(
        id=node.id,
        name=node.name,
        models=tuple(capacity.models),
        queue_waiting=capacity.queue_waiting,
        cpu_percent=capacity.cpu_percent,
        memory_available_mib=capacity.memory_available_mib,
        last_seen=node.last_seen,
        revoked=node.revoked,
        reachable=node.api_url is not None and capacity.offload,
    )


class Forwarder:
    """One client session for every forwarded request, over mutual TLS: the node's
    certificate must chain to the fleet's CA bundle and name the address called (its
    overlay address, which is its alone), and the hub presents its own certificate,
    which the node's fleet listener requires."""

    def __init__(self, hub_tls: HubTls, tracing: Tracing) -> None:
        self._tls = hub_tls
        self._tracing = tracing
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
        loads = [load_of(n) for n in nodes]
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
        assert target.api_url is not None  # noqa: S101 - candidates are reachable
        headers = {
            "Authorization": f"Bearer {client_key}",
            "Content-Type": "application/json",
            protocol.ORIGIN_HEADER: origin.name,
            protocol.OFFLOADED_HEADER: "1",
        }
        # One offloaded request is one trace: the hub's span (or, tracing off here, the
        # origin's W3C headers as they came) goes on to the target as its parent.
        self._tracing.inject(headers, request.headers)
        url = f"{target.api_url}/v1/offloaded/{route}"
        try:
            upstream = await self._session.post(
                url, data=body, headers=headers, ssl=self._tls.client
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            log.warning("offload to %s failed: %s", target.name, err)
            return None
        try:
            if upstream.status in {429, 503}:
                log.info("offload: %s has no room either (%d)", target.name, upstream.status)
                return None
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
