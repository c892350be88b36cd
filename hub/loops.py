"""The hub's background loops: the heartbeat flusher and its listeners, the placement
reconciler, the WireGuard peer reconciler, the console's sample pruner. Each runs its
rounds under the application's one `Failures` (shared.supervise): a round that raises is
logged with its traceback and counted under the loop's name, and the loop goes on. The
operator API shows the count (`GET /v1/admin/loops`).

Nothing of the hub's is imported here: the application's keys (hub/appkeys.py) name
`Running`, and every loop is handed what it runs under.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Coroutine

    from shared.supervise import Failures

log = logging.getLogger(__name__)


class Running:
    """The loop tasks an application started, by loop name: whether each still runs is
    part of what the operator API reports."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def names(self) -> list[str]:
        return sorted(name for name, task in self.tasks.items() if not task.done())

    def stopped(self) -> list[str]:
        return sorted(name for name, task in self.tasks.items() if task.done())


def _ended(name: str, task: asyncio.Task[None]) -> None:
    # A supervised loop ends only when cancelled; anything else is a bug worth shouting.
    if task.cancelled():
        return
    error = task.exception()
    log.error("background loop %s ended; it no longer runs", name, exc_info=error)


@contextlib.asynccontextmanager
async def running(
    tasks: Running, name: str, loop: Coroutine[object, object, None]
) -> AsyncIterator[asyncio.Task[None]]:
    """Run `loop` as a task while the context lasts (an application's cleanup context),
    listed in `tasks`, then cancel it and wait for it to end."""
    task = asyncio.create_task(loop, name=f"kvl-hub-{name}")
    task.add_done_callback(lambda done: _ended(name, done))
    tasks.tasks[name] = task
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def report(tasks: Running, failures: Failures) -> dict[str, object]:
    """What the operator API answers: the loops that run, any that stopped, and each
    loop's failures (count, last error, when)."""
    return {"running": tasks.names(), "stopped": tasks.stopped(), "failures": failures.report()}
