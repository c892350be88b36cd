"""Webhook delivery: durable, signed, retried with backoff until a 2xx or `webhook_retry_s`.

Deliveries are rows (made in the transaction that ends their job), so they survive
restarts. The body is fixed at the first attempt and the delivery id never changes, so every
retry is the same event to the receiver; only the signature's timestamp is new each time.

Every attempt checks its destination again (appliance.jobs.destinations): the connector
resolves names through a resolver that keeps only allowed addresses, so the address checked
is the address connected to. What an attempt records for the job's owner is only a class
of failure (refused, timeout, the status code): never what answered, its body or headers,
which would make the appliance a probe of the network it sits in. The operator's log has
the details, with the URL's userinfo, query and fragment redacted (the client's credential,
if it put one there, is not the operator's to read).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import socket
import time
from typing import TYPE_CHECKING

import aiohttp
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import ThreadedResolver

from appliance.jobs.backoff import backoff_s
from appliance.jobs.bodies import event_body
from appliance.jobs.destinations import WebhookDestinationError, ip_literal, url_host
from shared import __version__
from shared.supervise import wait_until_set
from shared.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, redact_url, redact_urls, sign

if TYPE_CHECKING:
    from aiohttp.abc import ResolveResult

    from appliance.jobs.destinations import WebhookDestinations
    from appliance.observability.metrics import Metrics
    from appliance.settings import JobSettings
    from appliance.state.jobs import Delivery, JobStore
    from appliance.state.store import AsyncStore

log = logging.getLogger(__name__)

# Deliveries in flight at once: one slow receiver does not hold up the others.
MAX_PARALLEL = 8
LOOP = "jobs.webhooks"  # its name among the background loops' failures
# What a failed attempt records, whatever the detail: the class of failure, nothing of what
# answered (or that something did).
REFUSED = "refused: no connection to an allowed address of the webhook URL"
TIMEOUT = "timeout: no answer within jobs.webhook_timeout_s"


class WebhookSender:
    def __init__(
        self,
        store: AsyncStore,
        jobs: JobStore,
        settings: JobSettings,
        metrics: Metrics,
        destinations: WebhookDestinations,
    ) -> None:
        self._store = store
        self._jobs = jobs
        self._settings = settings
        self._metrics = metrics
        self._destinations = destinations
        self._wake = asyncio.Event()
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # Names resolved at each attempt, through the check: no address is remembered
            # from an earlier answer of the name's DNS.
            connector=aiohttp.TCPConnector(
                resolver=_CheckingResolver(self._destinations), use_dns_cache=False
            ),
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
            await wait_until_set(self._wake, timeout)

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
        # For the operator's log only, any URL in it redacted as the URL itself is: the
        # client's userinfo or query may hold a credential (shared.webhooks.redact_url).
        detail = ""
        try:
            self._check_literal(delivery.url)
            async with session.post(
                delivery.url, data=body, headers=headers, allow_redirects=False
            ) as response:
                status = response.status  # and nothing else of the answer is kept
            if not 200 <= status < 300:
                error = f"non-2xx: the receiver answered HTTP {status}"
        except TimeoutError as err:  # aiohttp's timeouts are TimeoutErrors too
            error, detail = TIMEOUT, redact_urls(repr(err))
        except (aiohttp.ClientError, OSError, ValueError) as err:
            error, detail = REFUSED, redact_urls(repr(err))
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
                "webhook %s of %s to %s given up after %d attempts: %s %s",
                delivery.id,
                delivery.job_id,
                redact_url(delivery.url),
                updated.attempts,
                error,
                detail,
            )
        elif error is not None:
            log.info(
                "webhook %s to %s failed (%s %s); retrying",
                delivery.id,
                redact_url(delivery.url),
                error,
                detail,
            )

    def _check_literal(self, url: str) -> None:
        """An IP address in the URL reaches no resolver: it is checked here."""
        host = url_host(url)
        if self._destinations.allows_host(host):
            return
        address = ip_literal(host)
        if address is None:
            return  # a name: the resolver checks what it resolves to
        if (why := self._destinations.refusal(address)) is not None:
            raise WebhookDestinationError(f"{host} is {why}")


class _CheckingResolver(AbstractResolver):
    """The default resolver, keeping only the addresses webhooks may go to: the connector
    connects to what it returns, so what was checked is what is reached."""

    def __init__(self, destinations: WebhookDestinations) -> None:
        self._destinations = destinations
        self._inner = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if self._destinations.allows_host(host):
            return results
        allowed = [
            r
            for r in results
            if self._destinations.refusal(ipaddress.ip_address(r["host"].partition("%")[0])) is None
        ]
        if not allowed:
            raise WebhookDestinationError(f"{host} resolves to no address webhooks may go to")
        return allowed

    async def close(self) -> None:
        await self._inner.close()
