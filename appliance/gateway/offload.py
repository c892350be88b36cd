"""Burst offload, the node's two halves.

Origin: a completion this node must shed for load (429 `overloaded` or `queue_full`),
of a class that allows it (`classes.sN.offload`), goes through the tunnel to the hub,
which hands it to the node with the most headroom; the answer (streamed or not) comes
back through the same two hops with `X-Kvl-Served-By` naming the node that served it.
When the hub finds no node with room, the client gets the hub's 429 with `Retry-After`;
when the hub cannot be reached, the local refusal stands.

Target: the hub calls `/v1/offloaded/chat/completions` or `/v1/offloaded/completions`
with this node's offload secret (from its desired state), the account and class the
request runs as, and the origin's name. It runs as any request of that account here —
admission, quota lease, usage event — so it is charged once, here, and never offloaded
again (no loops).
"""

from __future__ import annotations

import hmac
import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from appliance.fleet.client import HubError
from appliance.state.store import ApiKey
from shared.classes import ServiceClass
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from appliance.fleet.link import FleetLink
    from appliance.gateway.admission import AdmissionControl
    from appliance.gateway.completions import Prepared
    from appliance.state.store import AsyncStore
    from shared.telemetry import Metrics

log = logging.getLogger(__name__)

OFFLOADED_PREFIX = "/v1/offloaded/"
SHED = {ErrorCode.overloaded, ErrorCode.queue_full}
PASSED_HEADERS = ("Content-Type", "X-Kvl-Model", "X-Kvl-Served-By", "Retry-After")


class Offload:
    def __init__(self, admission: AdmissionControl, metrics: Metrics) -> None:
        self._admission = admission
        self._metrics = metrics
        self.link: FleetLink | None = None  # set when the node is in a fleet

    def eligible(self, err: ApiError, prepared: Prepared) -> bool:
        return (
            err.code in SHED
            and self._admission.class_settings(prepared.klass).offload
            and self.link is not None
            and self.link.connected
        )

    async def forward(
        self, request: web.Request, prepared: Prepared, body: dict[str, Any], shed: ApiError
    ) -> web.StreamResponse:
        """Send the request through the hub and relay its answer; `shed` is the local
        refusal, which stands if the hub cannot be reached."""
        assert self.link is not None  # noqa: S101 - eligible() checked it
        route = request.path.removeprefix("/v1/")
        headers = {
            "Content-Type": "application/json",
            "X-Kvl-Account": prepared.key.account.name,
            "X-Kvl-Class": prepared.klass.value,
        }
        try:
            hub = await self.link.hub()
            if hub is None:
                raise shed
            upstream = await hub.offload(route, json.dumps(body).encode(), headers)
        except HubError:
            self._metrics.offloads.labels("sent", "hub_unreachable").inc()
            raise shed from None
        try:
            if upstream.status >= 400:
                self._metrics.offloads.labels("sent", "refused").inc()
                raise _error_of(upstream.status, await upstream.read(), upstream.headers)
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
                "offloaded %s to %s", prepared.id, upstream.headers.get("X-Kvl-Served-By", "?")
            )
            return response
        finally:
            upstream.release()


def _error_of(status: int, raw: bytes, headers: Any) -> ApiError:
    """The fleet's refusal, in this API's error shape."""
    try:
        error = json.loads(raw)["error"]
        code = ErrorCode(error["code"])
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = ErrorCode.overloaded, f"the fleet refused the request ({status})"
    retry = headers.get("Retry-After")
    return ApiError(code, message, retry_after=float(retry) if retry else None)


async def offloaded_key(request: web.Request, store: AsyncStore) -> ApiKey:
    """The hub hands this node a request: its secret checks, and the request runs as
    the account and class it names."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            ErrorCode.missing_api_key, "offloaded requests come from the hub, with its secret"
        )
    secret = await store.run(store.sync.meta, "offload_secret")
    if secret is None or not hmac.compare_digest(token.strip().encode(), secret.encode()):
        raise ApiError(ErrorCode.invalid_api_key, "offloaded requests come from the hub only")
    name = request.headers.get("X-Kvl-Account", "")
    try:
        klass = ServiceClass(request.headers.get("X-Kvl-Class", ""))
    except ValueError as err:
        raise ApiError(
            ErrorCode.invalid_parameter, "X-Kvl-Class must be S0..S4", param="X-Kvl-Class"
        ) from err
    if not name:
        raise ApiError(
            ErrorCode.missing_parameter, "X-Kvl-Account names the account", param="X-Kvl-Account"
        )
    account = await store.run(store.sync.ensure_account, name)
    return ApiKey(
        id=-1,
        prefix="offload",
        account=replace(account, service_class=klass),
        created_at="",
        revoked_at=None,
        admin=False,
    )
