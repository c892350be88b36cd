"""Background loops that survive their own exceptions.

Every periodic task of the hub and the appliance (heartbeat flusher, reconcilers,
samplers, the fleet link, the job runner, webhook deliveries) runs its body under a
`Failures` guard: an exception is logged with its traceback, counted by loop name, and
the loop goes on with its next round. A loop that stops silently is the failure this
module exists to rule out: one bad row or one hostile peer must never end the work for
everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import TracebackType

    from aiohttp import web
    from prometheus_client import Counter

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class LoopFailure:
    count: int
    last_error: str
    last_at: float


class Failures:
    """Failures of background loops, by loop name; mirrored to a Prometheus counter
    (labelled `loop`) where the process has one."""

    def __init__(self, counter: Counter | None = None) -> None:
        self._counter = counter
        self.by_loop: dict[str, LoopFailure] = {}

    def record(self, loop: str, error: BaseException) -> None:
        was = self.by_loop.get(loop)
        self.by_loop[loop] = LoopFailure(
            (was.count if was else 0) + 1, f"{type(error).__name__}: {error}"[:500], time.time()
        )
        if self._counter is not None:
            self._counter.labels(loop).inc()

    def count(self, loop: str) -> int:
        failure = self.by_loop.get(loop)
        return failure.count if failure else 0

    def guard(self, loop: str) -> _Guard:
        """`with failures.guard("name"): body()` — an Exception in the body is logged,
        counted and swallowed; cancellation passes through."""
        return _Guard(self, loop)

    def report(self) -> dict[str, dict[str, object]]:
        """For a health answer: each loop that failed, how often, and its last error."""
        return {
            name: {"failures": f.count, "last_error": f.last_error, "last_at": f.last_at}
            for name, f in sorted(self.by_loop.items())
        }

    async def forever(
        self,
        loop: str,
        body: Callable[[], Awaitable[object]],
        every_s: float | Callable[[], float],
        *,
        wait_first: bool = True,
    ) -> None:
        """Run `body` every `every_s` seconds until cancelled, whatever it raises."""
        first = True
        while True:
            if wait_first or not first:
                await asyncio.sleep(every_s() if callable(every_s) else every_s)
            first = False
            with self.guard(loop):
                await body()


async def wait_until_set(event: asyncio.Event, seconds: float | None) -> bool:
    """Wait for `event` at most `seconds` (None: no limit); whether it was set.

    Not `asyncio.wait_for`: on Python 3.11 it swallows a cancellation that arrives in the
    same turn as the event (CPython gh-86296), so a loop stopped just as it is woken runs
    on and its owner's close() waits for it forever. `asyncio.timeout` passes it through.
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


class _Guard:
    def __init__(self, failures: Failures, loop: str) -> None:
        self._failures = failures
        self._loop = loop

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if error is None or not isinstance(error, Exception):
            return False  # success, or cancellation and exits: not ours to swallow
        log.error(
            "background loop %s failed; it goes on with its next round",
            self._loop,
            exc_info=error,
        )
        self._failures.record(self._loop, error)
        return True


def client_gone(request: web.Request) -> bool:
    """Whether the client of an aiohttp request closed its connection."""
    return request.transport is None or request.transport.is_closing()


async def unless_gone(
    gone: Callable[[], bool], work: Awaitable[T], every_s: float = 0.25
) -> tuple[bool, T | None]:
    """`work` awaited while `gone()` stays false (checked every `every_s`): (True, its
    result), or (False, None) with `work` cancelled once `gone()` holds. For a long poll
    whose client may leave: aiohttp serves on without cancelling a handler whose client
    went, so a follower who closed the stream would hold a wait (and, on the hub, the
    node's own long poll behind it) for its whole length."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            if gone():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return False, None
            await asyncio.wait({task}, timeout=every_s)
        return True, task.result()
    finally:
        if not task.done():  # we were cancelled ourselves
            task.cancel()
