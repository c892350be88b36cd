"""Which heartbeats become the node samples the console's charts draw (stored by
hub/state/console.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hub.state.console import Sample

if TYPE_CHECKING:
    from collections.abc import Iterable

    from hub.state.nodes import Heartbeat
    from shared import protocol


def sample_of(at: float, capacity: protocol.Capacity) -> Sample:
    """A sample from a heartbeat: its time and the capacity it reported (validated when it
    arrived: finite, bounded, non-negative numbers)."""
    return Sample(
        at=at,
        cpu_percent=capacity.cpu_percent,
        memory_used_mib=capacity.memory_total_mib - capacity.memory_available_mib,
        memory_total_mib=capacity.memory_total_mib,
        queue_waiting=capacity.queue_waiting,
        outbox_lag=capacity.outbox_lag,
        models=len(capacity.models),
    )


class Sampler:
    """Which heartbeats become samples: a node's first one here, then one each `every_s`.
    It sees the heartbeats as the flusher writes them (hub/fleet/heartbeats.py), so sampling
    never reads the fleet back; each replica samples the nodes that call it."""

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._last: dict[str, float] = {}  # node id -> the time of its last sample

    def due(self, beats: Iterable[Heartbeat]) -> list[tuple[str, Sample]]:
        taken = []
        for beat in beats:
            last = self._last.get(beat.node_id)
            if last is not None and beat.at - last < self._every_s:
                continue
            self._last[beat.node_id] = beat.at
            taken.append((beat.node_id, sample_of(beat.at, beat.capacity)))
        return taken
