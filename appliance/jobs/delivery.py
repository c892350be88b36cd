"""Webhook delivery: durable, signed, retried with backoff until a 2xx or `webhook_retry_s`.

Deliveries are rows (made in the transaction that ends their job), so they survive
restarts. The body is fixed at the first attempt and the delivery id never changes, so every
retry is the same event to the receiver; only the signature's timestamp is new each time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

from appliance.jobs.backoff import backoff_s
from appliance.jobs.bodies import event_body
from shared import __version__
from shared.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, sign

if TYPE_CHECKING:
    from appliance.settings import JobSettings
    from appliance.state.jobs import Delivery, JobStore
    from appliance.state.store import AsyncStore
    from shared.telemetry import Metrics

log = logging.getLogger(__name__)

# Deliveries in flight at once: one slow receiver does not hold up the others.
MAX_PARALLEL = 8
LOOP = "jobs.webhooks"  # its name among the background loops' failures


class WebhookSender:
    def __init__(
        self, store: AsyncStore, jobs: JobStore, settings: JobSettings, metrics: Metrics
    ) -> None:
        self._store = store
        self._jobs = jobs
        self._settings = settings
        self._metrics = metrics
        self._wake = asyncio.Event()
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._settings.webhook_timeout_s),
            headers={"User-Agent": f"kovenlab-edge/{__version__}"},
        )
        self._task = asyncio.create_task(self._loop(), name="kvl-webhooks")

    def wake(self) -> None:
        """A delivery was scheduled."""
        self._wake.set()

    async def close(self) -> None:
        """Stop; attempts cut short are retried after the next start."""
        tasks = list(self._in_flight.values())
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            # The schedule could not be read (the database, a bug): the guard logs and
            # counts it, and the loop looks again after a pause instead of stopping.
            timeout: float | None = self._settings.webhook_backoff_max_s
            with self._metrics.failures.guard(LOOP):
                timeout = await self._launch_due()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _launch_due(self) -> float | None:
        """Start the deliveries that are due; how long until the next one is (None: until
        woken)."""
        free = MAX_PARALLEL - len(self._in_flight)
        if free <= 0:
            return None  # a finishing delivery wakes the loop
        due = await self._store.run(self._jobs.due_deliveries, free, set(self._in_flight))
        for delivery in due:
            task = asyncio.create_task(self._deliver(delivery), name=f"kvl-webhook-{delivery.id}")
            self._in_flight[delivery.id] = task
            task.add_done_callback(functools.partial(self._forget, delivery.id))
        if len(self._in_flight) >= MAX_PARALLEL:
            return None
        next_at = await self._store.run(self._jobs.next_delivery_at, set(self._in_flight))
        return None if next_at is None else max(0.0, next_at - time.time())

    def _forget(self, delivery_id: str, _task: asyncio.Task[None]) -> None:
        self._in_flight.pop(delivery_id, None)
        self._wake.set()

    async def _deliver(self, delivery: Delivery) -> None:
        attempted = False
        with self._metrics.failures.guard(LOOP):
            await self._attempt(delivery)
            attempted = True
        if not attempted:
            # Not the receiver's failure (the database, a bug): the row stays due, and the
            # loop tries again after a pause.
            log.warning("webhook delivery %s could not be attempted", delivery.id)
            await asyncio.sleep(self._settings.webhook_backoff_initial_s)

    async def _attempt(self, delivery: Delivery) -> None:
        session = self._session
        if session is None:
            raise RuntimeError("WebhookSender.start() was not called")
        payload = delivery.payload
        if payload is None:
            job = await self._store.run(self._jobs.get, delivery.job_id)
            text = json.dumps(event_body(delivery, job), separators=(",", ":"))
            payload = await self._store.run(self._jobs.fix_payload, delivery.id, text)
        body = payload.encode()
        secrets = await self._store.run(self._jobs.signing_secrets, delivery.account_id)
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign(
                secrets.current, body, int(time.time()), previous_secrets=secrets.previous
            ),
            DELIVERY_HEADER: delivery.id,
            "Kvl-Event": delivery.event,
        }
        status: int | None = None
        error: str | None = None
        try:
            async with session.post(
                delivery.url, data=body, headers=headers, allow_redirects=False
            ) as response:
                status = response.status
            if not 200 <= status < 300:
                error = f"the receiver answered HTTP {status}"
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as err:
            error = (f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)[:500]
        s = self._settings
        updated = await self._store.run(
            self._jobs.delivery_attempted,
            delivery.id,
            status_code=status,
            error=error,
            delivered=error is None,
            retry_s=s.webhook_retry_s,
            backoff_s=backoff_s(
                delivery.attempts + 1, s.webhook_backoff_initial_s, s.webhook_backoff_max_s
            ),
        )
        outcome = {"delivered": "delivered", "pending": "retried", "failed": "failed"}
        self._metrics.webhook_deliveries.labels(outcome[updated.status]).inc()
        if updated.status == "failed":
            log.warning(
                "webhook %s of %s to %s given up after %d attempts: %s",
                delivery.id,
                delivery.job_id,
                delivery.url,
                updated.attempts,
                error,
            )
        elif error is not None:
            log.info("webhook %s to %s failed (%s); retrying", delivery.id, delivery.url, error)
