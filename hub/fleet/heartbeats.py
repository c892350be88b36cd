"""Heartbeats, written behind: the buffer the node API adds to, and the flusher that
writes it every second."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from hub.loops import running

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from hub.fleet.objectives import Ingested
    from hub.loops import Running
    from hub.state.store import AsyncHubStore, Heartbeat
    from shared.supervise import Failures

HEARTBEATS_EVERY_S = 1.0


class Heartbeats:
    """Heartbeats are soft state, written behind: a node's last one waits here and the
    flusher (`flushing`) writes every waiting one in one transaction a second, so a fleet
    of thousands costs one commit a second, not one per heartbeat. A crash loses at most
    that second of `last_seen`, which the next heartbeat restores. The flusher also keeps
    `desired_serial` fresh, which heartbeat answers carry so a node pulls its desired
    state only when it changed."""

    def __init__(self) -> None:
        self._waiting: dict[str, Heartbeat] = {}
        # Told the arrival times of the heartbeats each flush takes: the hub's metrics
        # (flush lag: how long the oldest waited; batch size).
        self.taken: Callable[[list[float]], None] | None = None
        self.desired_serial = 0
        # Called with each flushed group, once it is written (the console samples them).
        self.listeners: list[Callable[[list[Heartbeat]], Awaitable[None]]] = []
        # Called with what each flush added to the fleet's objectives (hub/fleet/objectives.py),
        # after every flush that added something: the hub's metrics count it.
        self.objective_listeners: list[Callable[[Ingested], None]] = []

    def add(self, beat: Heartbeat) -> None:
        self._waiting[beat.node_id] = beat

    def take(self) -> list[Heartbeat]:
        taken, self._waiting = list(self._waiting.values()), {}
        if taken and self.taken is not None:
            self.taken([beat.at for beat in taken])
        return taken


@contextlib.asynccontextmanager
async def flushing(
    store: AsyncHubStore, beats: Heartbeats, failures: Failures, tasks: Running
) -> AsyncIterator[None]:
    """The flusher, while the context lasts: every HEARTBEATS_EVERY_S the waiting
    heartbeats written, then the serials read; a last flush on the way out."""

    async def serials() -> None:
        read = await store.run(store.sync.serials)
        beats.desired_serial = read[0]
        store.note_serials(read)

    async def flush() -> None:
        # A round that fails (the write, the serials) loses only that second's
        # heartbeats, which the nodes' next ones replace; the loop goes on.
        waiting = beats.take()
        if waiting:
            ingested = await store.run(store.sync.heartbeats, waiting)
            if ingested:
                for counter in beats.objective_listeners:
                    with failures.guard(listener_loop(counter)):
                        counter(ingested)
            for listener in beats.listeners:
                # Each listener on its own: one that raises takes neither the flush
                # nor the listeners after it down with it.
                with failures.guard(listener_loop(listener)):
                    await listener(waiting)
        await serials()

    await serials()
    # The module constant is read each round, so that tests can shorten it.
    every = failures.forever("heartbeats", flush, lambda: HEARTBEATS_EVERY_S)
    async with running(tasks, "heartbeats", every):
        yield
    with failures.guard("heartbeats"):  # the last flush, on the way out
        await flush()


def listener_loop(listener: Callable[..., object]) -> str:
    """The name a heartbeat listener's failures are counted under."""
    return f"heartbeats.{getattr(listener, '__name__', 'listener')}"
