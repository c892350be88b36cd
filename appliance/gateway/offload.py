"""Burst offload, the node's two halves.

Origin: a completion this node must shed for load (429 `overloaded` or `queue_full`),
of a class that allows it (`classes.sN.offload`), goes through the tunnel to the hub,
which hands it to the node with the most headroom; the answer (streamed or not) comes
back through the same two hops with `X-Kvl-Served-By` naming the node that served it.
When the hub finds no node with room, the client gets the hub's 429 with `Retry-After`;
when the hub cannot be reached, the local refusal stands.

The client's own API key goes with the request (`X-Kvl-Client-Key`, through the tunnel),
never an account or class of the origin's saying.

Target: the hub calls `/v1/offloaded/chat/completions` or `/v1/offloaded/completions`
with the client's key as `Authorization: Bearer`. This node authenticates it like any
key (it holds the hashes of the fleet's keys from its desired state) and takes account
and class from it, so no node can have another run a request as someone else. It runs
as any request of that account here — admission, quota lease, usage event — so it is
charged once, here, and never offloaded again (no loops). A LAN client may call these
routes too: with its own key, that is a request that will not be offloaded.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web
from opentelemetry.trace import SpanKind

from appliance.fleet.client import HubError
from shared import jsonlimits, protocol
from shared.errors import ApiError, DomainError, ErrorCode

if TYPE_CHECKING:
    from appliance.fleet.link import FleetLink
    from appliance.inference.admission import AdmissionControl
    from appliance.inference.completions import Prepared
    from appliance.observability.metrics import Metrics
    from appliance.observability.tracing import Tracing
    from shared.classes import ServiceClass

log = logging.getLogger(__name__)

OFFLOADED_PREFIX = "/v1/offloaded/"
SHED = {ErrorCode.overloaded, ErrorCode.queue_full}
PASSED_HEADERS = ("Content-Type", "X-Kvl-Model", protocol.SERVED_BY_HEADER, "Retry-After")


class Offload:
    def __init__(self, admission: AdmissionControl, metrics: Metrics, tracing: Tracing) -> None:
        self._admission = admission
        self._metrics = metrics
        self._tracing = tracing
        self.link: FleetLink | None = None  # set when the node is in a fleet

    def eligible(self, err: DomainError, prepared: Prepared) -> bool:
        return err.code in SHED and self.possible(prepared.klass)

    def possible(self, klass: ServiceClass) -> bool:
        """Whether a request of `klass` refused here for load could go to the fleet now."""
        return (
            self._admission.class_settings(klass).offload
            and self.link is not None
            and self.link.connected
        )

    async def forward(
        self, request: web.Request, prepared: Prepared, body: dict[str, Any], shed: DomainError
    ) -> web.StreamResponse:
        """Send the request through the hub and relay its answer; `shed` is the local
        refusal, which stands if the hub cannot be reached. The hop is a client span
        (`offload`): the hub's span is its child, the serving node's the hub's."""
        with self._tracing.span(
            "offload", {"kvl.model": prepared.model}, kind=SpanKind.CLIENT
        ) as span:
            response = await self._forward(request, prepared, body, shed)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _forward(
        self, request: web.Request, prepared: Prepared, body: dict[str, Any], shed: DomainError
    ) -> web.StreamResponse:
        assert self.link is not None  # noqa: S101 - eligible() checked it
        route = request.path.removeprefix("/v1/")
        _, _, client_key = request.headers.get("Authorization", "").partition(" ")
        headers = {
            "Content-Type": "application/json",
            protocol.CLIENT_KEY_HEADER: client_key.strip(),
        }
        # The hub's span, then the serving node's, join this request's trace.
        self._tracing.inject(headers, request.headers)
        try:
            hub = await self.link.hub()
            if hub is None:
                raise shed
            upstream = await hub.offload(route, json.dumps(body).encode(), headers)
        except HubError:
            self._metrics.offloads.labels("sent", "hub_unreachable").inc()
            raise shed from None
        try:
            if upstream.status == 429:  # the fleet has no room either: its answer, and when
                self._metrics.offloads.labels("sent", "refused").inc()
                raise _error_of(upstream.status, await upstream.read(), upstream.headers)
            if upstream.status >= 400:
                # Refused for another reason (a key of this node's own, not the fleet's;
                # a hub of another protocol): the local refusal stands.
                self._metrics.offloads.labels("sent", "refused").inc()
                log.info("offload of %s refused by the hub (%d)", prepared.id, upstream.status)
                raise shed
            response = web.StreamResponse(status=upstream.status)
            for name in PASSED_HEADERS:
                if name in upstream.headers:
                    response.headers[name] = upstream.headers[name]
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            self._metrics.offloads.labels("sent", "served").inc()
            log.info(
                "offloaded %s to %s",
                prepared.id,
                upstream.headers.get(protocol.SERVED_BY_HEADER, "?"),
            )
            return response
        finally:
            upstream.release()


def _error_of(status: int, raw: bytes, headers: Any) -> ApiError:
    """The fleet's refusal, in this API's error shape."""
    try:
        error = jsonlimits.loads(raw)["error"]
        code = ErrorCode(error["code"])
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = (ErrorCode.overloaded, f"the fleet refused the request ({status})")
    retry = headers.get("Retry-After")
    return ApiError(code, message, retry_after=float(retry) if retry else None)
