"""The alerts' webhooks: the outbox's deliveries (made with each change, hub/state/alerts.py)
POSTed to `alerts.webhooks`, signed as the appliance signs its job webhooks
(shared/webhooks.py: `Kvl-Signature`, `Kvl-Delivery`), retried with backoff until a 2xx
or `alerts.retry_s`. The rows outlive a restart of the hub, so a delivery due while it was
down is made once it is up again; the delivery id stays the same on every retry, so a
receiver does the effect once (shared.webhooks.ReplayGuard)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import TYPE_CHECKING

import aiohttp

from hub.loops import running
from shared import __version__
from shared.supervise import wait_until_set
from shared.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, redact_url, redact_urls, sign

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from hub.alerting.settings import AlertsSettings
    from hub.loops import Running
    from hub.state.alerts import Delivery
    from hub.state.store import AsyncHubStore
    from shared.supervise import Failures

log = logging.getLogger(__name__)
LOOP = "alerts.webhooks"
EVERY_S = 1.0  # how often the outbox is looked at, besides when an alert changed
# Jitter spreads retries out; it guards no secret.
_RANDOM = random.Random()  # noqa: S311


def backoff_s(attempts: int, initial_s: float, max_s: float) -> float:
    """The wait after the `attempts`-th failure in a row: `initial_s` doubling each time,
    at most `max_s`, of which a random half (so receivers that failed together are not
    retried together)."""
    step = min(max_s, initial_s * 2.0 ** min(max(attempts - 1, 0), 64))
    return step / 2 + _RANDOM.uniform(0.0, step / 2)


class AlertSender:
    def __init__(self, store: AsyncHubStore, settings: AlertsSettings) -> None:
        self._store = store
        self._settings = settings
        self._secrets = {w.url: w.secret for w in settings.webhooks}
        self._session: aiohttp.ClientSession | None = None
        self.wake = asyncio.Event()

    async def round(self) -> int:
        """Every delivery due, each attempted once; how many were."""
        due = await self._store.read(self._store.reader.alerts.due_deliveries, time.time())
        if due:
            await asyncio.gather(*(self._attempt(d) for d in due))
        return len(due)

    async def _attempt(self, delivery: Delivery) -> None:
        s = self._settings
        secret = self._secrets.get(delivery.url)
        error: str | None = None
        if secret is None:
            error = "the URL is no longer one of alerts.webhooks"
        else:
            body = delivery.payload.encode()
            headers = {
                "Content-Type": "application/json",
                "User-Agent": f"kovenlab-hub/{__version__}",
                SIGNATURE_HEADER: sign(secret, body, int(time.time())),
                DELIVERY_HEADER: delivery.id,
                "Kvl-Event": f"alert.{delivery.event}",
            }
            try:
                async with self._client().post(
                    delivery.url, data=body, headers=headers, allow_redirects=False
                ) as response:
                    if not 200 <= response.status < 300:
                        error = f"the receiver answered HTTP {response.status}"
            except TimeoutError:
                error = f"no answer within alerts.timeout_s ({s.timeout_s:g} s)"
            except (aiohttp.ClientError, OSError, ValueError) as err:
                # Kept as the delivery's last error, which operators read: any URL in the
                # message is redacted, as in the log (shared.webhooks.redact_url).
                error = redact_urls(f"no connection: {type(err).__name__}: {err}")[:500]
        now = time.time()
        next_at: float | None = None
        if error is not None and secret is not None and now - delivery.created_at < s.retry_s:
            next_at = now + backoff_s(delivery.attempts + 1, s.backoff_initial_s, s.backoff_max_s)
        status = await self._store.run(
            self._store.sync.alerts.delivery_attempted, delivery.id, error=error, next_at=next_at
        )
        if status == "failed":
            log.warning(
                "alert webhook %s to %s given up after %d attempts: %s",
                delivery.id, redact_url(delivery.url), delivery.attempts + 1, error,
            )  # fmt: skip
        elif error is not None:
            log.info(
                "alert webhook %s to %s failed (%s); retrying",
                delivery.id,
                redact_url(delivery.url),
                error,
            )

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._settings.timeout_s)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


@contextlib.asynccontextmanager
async def delivering(
    sender: AlertSender, failures: Failures, tasks: Running
) -> AsyncIterator[None]:
    """The sender, while the context lasts: the outbox every EVERY_S, and at once when an
    alert changed (`sender.wake`)."""

    async def forever() -> None:
        while True:
            sender.wake.clear()  # before the round: a change made during it wakes the next
            with failures.guard(LOOP):
                await sender.round()
            await wait_until_set(sender.wake, EVERY_S)

    try:
        async with running(tasks, LOOP, forever()):
            yield
    finally:
        await sender.close()
