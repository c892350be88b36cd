"""Heartbeats, written behind: the buffer the node API adds to, and the flusher that
writes it every second."""

from __future__ import annotations

import contextlib
import heapq
import random
import time
from typing import TYPE_CHECKING

from hub.loops import running

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from hub.loops import Running
    from hub.planning.slo import Ingested
    from hub.state.nodes import Heartbeat
    from hub.state.store import AsyncHubStore
    from shared.supervise import Failures

HEARTBEATS_EVERY_S = 1.0
# A flush is written as several turns of the store's one writer, each its own transaction,
# with the calls queued meanwhile (the syncs' group commits) taking their turns between:
# one turn of the whole flush held them for its whole length, 60 ms at 5,000 nodes, and
# that was their p99. At most this many nodes' rows, or nodes' objectives, a turn.
ROWS_A_TURN = 1000
COUNTS_A_TURN = 32
_NODES_REMEMBERED = 200_000  # nodes whose last counting time is kept
# The spread of first countings guards no secret. A generator of its own: drawing from the
# module's shared one moved the process's global random state from the hub's thread, which
# a caller's own use of it (hypothesis, in the fuzz tests) saw change under it.
_RANDOM = random.Random()  # noqa: S311


class Heartbeats:
    """Heartbeats are soft state, written behind: a node's last one waits here and the
    flusher (`flushing`) writes every waiting one in one transaction a second, so a fleet
    of thousands costs one commit a second, not one per heartbeat. A crash loses at most
    that second of `last_seen`, which the next heartbeat restores. The flusher also keeps
    `desired_serial` fresh, which heartbeat answers carry so a node pulls its desired
    state only when it changed.

    A node's objectives are counted at most once every `count_every_s`
    (`objectives.count_every_s`): they are cumulative, so the newest heartbeat holds all
    that came before it, and counting one in four of a node's heartbeats (every minute,
    at 15 s heartbeats) counts the same values for a quarter of the flush's work. The
    newest not yet counted waits here and is counted when its node's period ends, whether
    or not another heartbeat came (a node gone quiet is counted all the same); a node not
    yet counted by this process, after a random share of the period; the last flush, on
    the way out, counts every one waiting. A crash loses what waits here as it
    loses `last_seen`: the node's next heartbeat carries the same counters, and more."""

    def __init__(
        self,
        count_every_s: float = 0.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        spread: Callable[[], float] = _RANDOM.random,
    ) -> None:
        self._waiting: dict[str, Heartbeat] = {}
        self.count_every_s = count_every_s
        self._clock = clock
        # A node this process has not counted yet waits a random share of the period: a
        # hub that starts (or restarts) hears every node within one heartbeat interval,
        # and counting them all in that interval is the whole cost the period saves.
        self._spread = spread
        # The newest heartbeat of each node whose objectives wait to be counted, when each
        # node was last counted, and (when its period ends, node) for those waiting.
        self._uncounted: dict[str, Heartbeat] = {}
        self._counted_at: dict[str, float] = {}
        self._due: list[tuple[float, str]] = []
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

    def take(self, *, last: bool = False) -> tuple[list[Heartbeat], list[Heartbeat]]:
        """The heartbeats waiting, to be written; and the heartbeats whose objectives are
        due to be counted (`last`: all that wait)."""
        taken, self._waiting = list(self._waiting.values()), {}
        if taken and self.taken is not None:
            self.taken([beat.at for beat in taken])
        now = self._clock()
        for beat in taken:
            if beat.objectives is None:
                continue
            node = beat.node_id
            if node not in self._uncounted:
                since = self._counted_at.get(node)
                if since is None:  # not counted by this process yet
                    due = now + self._spread() * self.count_every_s
                else:
                    due = since + self.count_every_s
                heapq.heappush(self._due, (due, node))
            self._uncounted[node] = beat
        counted = []
        while self._due and (last or self._due[0][0] <= now):
            _, node = heapq.heappop(self._due)
            counted.append(self._uncounted.pop(node))
            self._counted_at[node] = now
        if len(self._counted_at) > _NODES_REMEMBERED:
            # Forgetting when a node was counted only counts its next heartbeat sooner.
            self._counted_at = {n: self._counted_at[n] for n in self._uncounted}
        return taken, counted


@contextlib.asynccontextmanager
async def flushing(
    store: AsyncHubStore, beats: Heartbeats, failures: Failures, tasks: Running
) -> AsyncIterator[None]:
    """The flusher, while the context lasts: every HEARTBEATS_EVERY_S the waiting
    heartbeats written and the objectives due counted, then the serials read; a last
    flush on the way out."""

    async def serials() -> None:
        read = await store.run(store.sync.serials.current)
        beats.desired_serial = read[0]
        store.note_serials(read)

    async def flush(*, last: bool = False) -> None:
        # A round that fails (the write, the serials) loses only that second's
        # heartbeats, which the nodes' next ones replace; the loop goes on.
        waiting, counted = beats.take(last=last)
        turns: list[tuple[list[Heartbeat], list[Heartbeat]]] = [
            (waiting[i : i + ROWS_A_TURN], []) for i in range(0, len(waiting), ROWS_A_TURN)
        ]
        turns += [
            ([], counted[i : i + COUNTS_A_TURN]) for i in range(0, len(counted), COUNTS_A_TURN)
        ]
        for rows, counts in turns:
            ingested = await store.run(store.sync.heartbeats, rows, counts)
            if ingested:
                for counter in beats.objective_listeners:
                    with failures.guard(listener_loop(counter)):
                        counter(ingested)
        if waiting:
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
    with failures.guard("heartbeats"):  # the last flush, on the way out: every count waiting
        await flush(last=True)


def listener_loop(listener: Callable[..., object]) -> str:
    """The name a heartbeat listener's failures are counted under."""
    return f"heartbeats.{getattr(listener, '__name__', 'listener')}"
