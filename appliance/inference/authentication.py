"""API-key authentication, for every door of the appliance: the HTTP middleware and the
gRPC server check a key the same way. No aiohttp here.

A failed attempt is counted against the client's address (`classes.auth_failures_per_minute`);
an address over it waits, whatever key it sends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import InvalidApiKey, MissingApiKey, RevokedApiKey, TooManyAuthFailures

if TYPE_CHECKING:
    from appliance.inference.admission import AdmissionControl
    from appliance.observability.metrics import Metrics
    from appliance.state.store import ApiKey, AsyncStore


async def authenticate(
    authorization: str,
    address: str,
    *,
    store: AsyncStore,
    admission: AdmissionControl,
    metrics: Metrics,
    count: bool = True,
) -> ApiKey:
    """The key of an `authorization` value (`Bearer <key>`), not revoked, from an
    `address` that is not throttled; a DomainError otherwise. `count=False` only asks: a failure
    is not counted (the TLS front's decisions, whose refusals the app then makes itself)."""
    failed = admission.auth_failed if count else _uncounted
    if (wait := admission.auth_throttled(address)) > 0:
        if count:
            metrics.auth_throttled.inc()
        raise TooManyAuthFailures(
            f"too many failed authentications from {address}; retry after {wait:.0f} s",
            retry_after=wait,
        )
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        failed(address)
        raise MissingApiKey(
            "send your API key as `Authorization: Bearer <key>`; create one with "
            "`kvl appliance keys create --account NAME`",
        )
    key = await store.authenticate(token.strip())
    if key is None:
        failed(address)
        raise InvalidApiKey("the API key is not valid")
    if key.revoked:
        failed(address)
        raise RevokedApiKey(f"the API key {key.prefix} was revoked")
    return key


def _uncounted(_address: str) -> None:
    return None
