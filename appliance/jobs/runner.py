"""The job runner: pending items from SQLite, through the completion service, as S0 work.

At most `jobs.max_concurrent_items` items generate at once. Each item's result is committed
(with the end of its job, when it was the last) before the item counts as done, so after a
restart, even after `kill -9`, the runner picks up exactly the items that have no result: an
item that was mid-generation runs again, a finished one never does. Its usage event has an
id made from the item, so it is charged once however often it ran.

Refusals for now are not results: a TryLater (a full queue, an overload, a quota) or an
Unavailable (the model loading, restarting, out of memory, the outbox full). The item stays
pending and the runner pauses, with exponential backoff, before it starts anything again:
S0 work yields to the traffic that caused them. A quota is one account's, not the node's:
its refusal pauses that account's jobs alone (with a backoff of its own), and other
accounts' jobs run meanwhile. A TryLater is retried for as long as it lasts, and so is a full
outbox (the hub will come back; the job must not fail for it); after
`jobs.item_max_attempts` other Unavailables, the error becomes the item's result (a model
that never comes back).

An item's result is the answer its route gives (OpenAI's batch results are): an error's is
its code's status and the one error shape (shared.errors), as the gateway answers it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from appliance.inference.bodies import response_body
from appliance.inference.completions import CompletionService, Generation, Sink, invalid_output
from appliance.inference.schemas import completion_request
from appliance.jobs.backoff import backoff_s
from shared.classes import ServiceClass
from shared.errors import (
    AccountLimit,
    DomainError,
    InternalError,
    InvalidApiKey,
    OutboxFull,
    RevokedApiKey,
    TryLater,
    Unavailable,
    error_body,
)
from shared.supervise import wait_until_set

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from appliance.inference.completions import Prepared
    from appliance.serving.engine import Finished
    from appliance.settings import JobSettings
    from appliance.state.jobs import Job, JobStore, PendingItem
    from appliance.state.store import ApiKey, AsyncStore

    # Runs one item of another route: (the job's key, the item's body) -> (status, body).
    ItemHandler = Callable[[ApiKey, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
    from appliance.observability.metrics import Metrics

log = logging.getLogger(__name__)

ROUTE = "/v1/jobs"  # the route usage events of job items are recorded under
LOOP = "jobs.runner"  # its name among the background loops' failures
CHAT_URL = "/v1/chat/completions"
TEXT_URL = "/v1/completions"

# "Not now", whichever error says why: the item runs again later.
_NOT_NOW = (TryLater, Unavailable)


@dataclass(frozen=True)
class _Result:
    status_code: int
    body: dict[str, Any]

    @classmethod
    def failed(cls, error: DomainError) -> _Result:
        return cls(error.code.status, error_body(error.code, error.message, param=error.param))


@dataclass(frozen=True)
class _Retry:
    error: DomainError


@dataclass
class _Running(Sink):
    """An item in flight; as the sink of its completion, it keeps the generation, so a
    cancel of its job can stop it."""

    item: PendingItem
    task: asyncio.Task[None] | None = None
    generation: Generation | None = None
    cancelled: bool = False

    async def started(self, generation: Generation) -> None:
        self.generation = generation
        if self.cancelled:
            generation.cancel()


@dataclass
class _AccountPause:
    """An account over a quota: none of its items starts before `until` (loop time)."""

    until: float = 0.0
    refusals: int = 0  # quota refusals since its last result: its backoff's exponent
    jobs: set[str] = field(default_factory=set)  # its jobs seen while paused: passed over


class _PassOver(Collection[tuple[str, int]]):
    """The items `JobStore.pending_items` is to pass over: those running, and every item of
    the jobs of accounts waiting out a quota, however many. Its size is that of the running
    ones, which is what `pending_items` reads beyond its limit per job; a job passed over
    has all its rows passed, whatever their number, and the next job's are read."""

    def __init__(self, running: set[tuple[str, int]], jobs: set[str]) -> None:
        self._running = running
        self._jobs = jobs

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        return key in self._running or key[0] in self._jobs

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._running)

    def __len__(self) -> int:
        return len(self._running)


class JobRunner:
    def __init__(
        self,
        store: AsyncStore,
        jobs: JobStore,
        completions: CompletionService,
        *,
        settings: JobSettings,
        metrics: Metrics,
        on_end: Callable[[Job], None],
    ) -> None:
        self._store = store
        self._jobs = jobs
        self._completions = completions
        self._settings = settings
        self._metrics = metrics
        self._on_end = on_end
        self._running: dict[tuple[str, int], _Running] = {}
        self._started: set[str] = set()  # jobs this process has marked running
        self._cancelled: set[str] = set()  # jobs cancelled while pending items were read
        self._wake = asyncio.Event()
        self._paused_until = 0.0  # loop time; no item starts before it
        self._failures = 0  # transient failures in a row: the backoff's exponent
        self._accounts: dict[str, _AccountPause] = {}  # by name: accounts over a quota
        self._task: asyncio.Task[None] | None = None
        # Items of other routes (a package job's `/v1/packages`): url -> what runs one, given
        # the job's key and the item's body, answering (status, body).
        self.handlers: dict[str, ItemHandler] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._dispatch(), name="kvl-job-runner")

    def wake(self) -> None:
        """Look for work now (a job was created, an item ended)."""
        self._wake.set()

    def running(self, job_id: str | None = None) -> int:
        """Items generating now (of one job, or of all)."""
        return sum(1 for key in self._running if job_id is None or key[0] == job_id)

    def cancel(self, job_id: str) -> None:
        """Stop the job's items in flight (its cancel is already committed): a generation
        stops at its next token and its tokens are still recorded."""
        self._started.discard(job_id)
        self._cancelled.add(job_id)
        for running in self._running.values():
            if running.item.job_id != job_id:
                continue
            running.cancelled = True
            if running.generation is not None:
                running.generation.cancel()
            elif running.task is not None:
                running.task.cancel()  # still preparing: nothing spent yet

    async def close(self) -> None:
        """Stop: items in flight are abandoned without a result, so they run again at start."""
        tasks = [r.task for r in self._running.values() if r.task is not None]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            timeout: float | None = None
            pause = self._paused_until - loop.time()
            if pause > 0:
                timeout = pause
            else:
                # The database failed us (disk full, locked), or a bug: the guard logs and
                # counts it, and the runner tries again after a pause instead of stopping.
                timeout = self._settings.retry_max_s
                with self._metrics.failures.guard(LOOP):
                    timeout = await self._launch_pending()
            await wait_until_set(self._wake, timeout)

    async def _launch_pending(self) -> float | None:
        """Start the items that may run now; seconds until an account's pause ends that
        holds back items (None: nothing to wait for but a wake)."""
        now = asyncio.get_running_loop().time()
        waiting = self._waiting_accounts(now)
        free = self._settings.max_concurrent_items - len(self._running)
        self._cancelled.clear()
        while free > 0:
            passed = {job for name in waiting for job in self._accounts[name].jobs}
            skip = _PassOver(set(self._running), passed)
            items = await self._store.run(self._jobs.pending_items, free, skip)
            seen_more = False
            for item in items:
                if item.account in waiting:
                    # A job of a paused account read for the first time: passed over from
                    # now on, and the places it took are read again.
                    seen_more |= item.job_id not in passed
                    self._accounts[item.account].jobs.add(item.job_id)
                    continue
                if item.job_id in self._cancelled:
                    continue  # read just before its job's cancel was committed
                self._launch(item)
                free -= 1
            if not seen_more:
                break
        self._metrics.job_items_running.set(len(self._running))
        holding = [self._accounts[n].until - now for n in waiting if self._accounts[n].jobs]
        return max(0.0, min(holding)) if holding else None

    def _launch(self, item: PendingItem) -> None:
        running = _Running(item)
        self._running[item.key] = running
        running.task = asyncio.create_task(
            self._run(running), name=f"kvl-job-{item.job_id}-{item.index}"
        )
        running.task.add_done_callback(functools.partial(self._forget, item.key))

    def _waiting_accounts(self, now: float) -> set[str]:
        """Accounts whose pause still runs; those whose pause is over are read again."""
        waiting: set[str] = set()
        for name, pause in list(self._accounts.items()):
            if pause.until > now:
                waiting.add(name)
            elif pause.refusals == 0:
                del self._accounts[name]  # over, and a result since: forgotten
            else:
                pause.jobs.clear()  # over: its jobs are read again (its backoff stays)
        return waiting

    def _forget(self, key: tuple[str, int], _task: asyncio.Task[None]) -> None:
        self._running.pop(key, None)
        self._metrics.job_items_running.set(len(self._running))
        self._wake.set()

    async def _run(self, running: _Running) -> None:
        item = running.item
        recorded = False
        with self._metrics.failures.guard(LOOP):
            await self._run_item(running)
            recorded = True
        if not recorded:
            # The database failed us (disk full): the item stays pending and runs again.
            log.warning("job item %s/%d could not be recorded", item.job_id, item.index)
            self._pause(f"job item {item.job_id}/{item.index} could not be recorded")

    async def _run_item(self, running: _Running) -> None:
        item = running.item
        if item.job_id not in self._started:
            if await self._store.run(self._jobs.start, item.job_id):
                self._metrics.jobs.labels("running").inc()
            self._started.add(item.job_id)
        try:
            outcome = await self._execute(running)
        except Exception:
            # A bug, not the client's doing: the item's answer is what the route would give.
            log.exception("job item %s/%d failed", item.job_id, item.index)
            outcome = _Result.failed(InternalError(f"internal error in job {item.job_id}"))
        if outcome is None:
            return  # cancelled with its job
        if isinstance(outcome, _Retry):
            error = outcome.error
            attempts = await self._store.run(self._jobs.retry_item, item.job_id, item.index)
            waits = isinstance(error, (TryLater, OutboxFull))
            if waits or attempts < self._settings.item_max_attempts:
                self._metrics.job_items.labels("retried").inc()
                if isinstance(error, AccountLimit):
                    self._pause_account(item, error)  # the account's limit, not the node's
                else:
                    self._pause(error.message, error.retry_after)
                return
            log.warning(
                "job item %s/%d gives up after %d tries: %s",
                item.job_id,
                item.index,
                attempts,
                error.message,
            )
            outcome = _Result.failed(error)
        self._failures = 0
        if (pause := self._accounts.get(item.account)) is not None:
            pause.refusals = 0  # within its quota again: its next refusal starts afresh
        ended = await self._store.run(
            self._jobs.finish_item, item.job_id, item.index, outcome.status_code, outcome.body
        )
        if ended.recorded:
            done = "completed" if 200 <= outcome.status_code < 300 else "failed"
            self._metrics.job_items.labels(done).inc()
        if ended.ended is not None:
            self._started.discard(item.job_id)
            self._metrics.jobs.labels(ended.ended.status).inc()
            self._on_end(ended.ended)

    async def _execute(self, running: _Running) -> _Result | _Retry | None:
        """Run one item as its route would, non-streamed; None if its job was cancelled."""
        item = running.item
        service = self._completions
        handler = self.handlers.get(item.url)
        if handler is not None:
            return await self._handled(handler, item)
        try:
            key = await self._key(item)
            # The body was validated at creation; parsing it again gives the request model.
            req = completion_request(item.body, chat=item.url == CHAT_URL)
            # A job's completions are S0 (the lowest slot priority); the id makes the usage
            # event the item's own, the same on every run of it.
            completed = await service.run(
                req,
                key,
                ROUTE,
                running,
                service_class=ServiceClass.S0,
                request_id=item.usage_id,
                record=self._record,
            )
        except DomainError as err:
            return _Retry(err) if isinstance(err, _NOT_NOW) else _Result.failed(err)
        if completed.cancelled:
            return None
        if completed.problems:
            return _Result.failed(invalid_output(completed))
        return _Result(200, response_body(completed))

    async def _handled(self, handler: ItemHandler, item: PendingItem) -> _Result | _Retry:
        try:
            status, body = await handler(await self._key(item), item.body)
        except DomainError as err:
            return _Retry(err) if isinstance(err, _NOT_NOW) else _Result.failed(err)
        return _Result(status, body)

    async def _record(self, prepared: Prepared, finished: Finished, status: int) -> None:
        # Already recorded: this item finished before a restart and before its result was
        # committed; it is charged once.
        if not await self._store.run(self._jobs.usage_recorded, prepared.id):
            await self._completions.record(prepared, finished, status)

    async def _key(self, item: PendingItem) -> ApiKey:
        keys = await self._store.run(self._store.sync.list_keys, item.account)
        key = next((k for k in keys if k.prefix == item.key_prefix), None)
        if key is None:
            raise InvalidApiKey("the API key that created this job is gone")
        if key.revoked:
            # Revoking a key stops the work it started.
            raise RevokedApiKey(f"the API key {key.prefix} was revoked")
        return key

    def _pause_account(self, item: PendingItem, error: DomainError) -> None:
        """Start none of the account's items for a while; other accounts' still run."""
        pause = self._accounts.setdefault(item.account, _AccountPause())
        pause.refusals += 1
        s = self._settings
        wait = backoff_s(pause.refusals, s.retry_initial_s, s.retry_max_s)
        if error.retry_after is not None:
            wait = max(wait, min(error.retry_after, s.retry_max_s))
        pause.until = max(pause.until, asyncio.get_running_loop().time() + wait)
        pause.jobs.add(item.job_id)
        log.info("jobs of account %s wait %.1f s: %s", item.account, wait, error.message)

    def _pause(self, reason: str, retry_after: float | None = None) -> None:
        """Start nothing for a while: the next step of the backoff, or the server's hint."""
        self._failures += 1
        s = self._settings
        wait = backoff_s(self._failures, s.retry_initial_s, s.retry_max_s)
        if retry_after is not None:
            wait = max(wait, min(retry_after, s.retry_max_s))
        loop = asyncio.get_running_loop()
        self._paused_until = max(self._paused_until, loop.time() + wait)
        log.info("job runner pauses %.1f s: %s", wait, reason)
