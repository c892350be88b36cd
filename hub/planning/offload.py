"""Burst offload: which nodes may take a request that its own node had to shed.

A node that must refuse a request for load (429 `overloaded` or `queue_full`) forwards
it through the tunnel to the hub, which hands it to another node. The candidates are the
nodes that serve the model, are online (seen within `stale_after_s`, as
hub/planning/health.py defines it) and are not the node the request came from; the one
with the most headroom first (the shortest queue, then the idlest CPU, then the most free
memory), as the last heartbeats tell.
An offloaded request carries a mark and is never offloaded again, whatever happens at
its second node: at most one hop, so no loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from hub.planning.health import seen_within


@dataclass(frozen=True)
class NodeLoad:
    """What the hub knows of a node from its last heartbeat."""

    id: str
    name: str
    models: tuple[str, ...]  # refs, name@version
    queue_waiting: int
    cpu_percent: float
    memory_available_mib: int
    last_seen: float | None
    revoked: bool = False
    reachable: bool = True  # the hub knows where its API listens


def serves(load: NodeLoad, model: str) -> bool:
    """`model` as a client names it: `name` or `name@version`."""
    return any(ref == model or ref.split("@", 1)[0] == model for ref in load.models)


def candidates(
    nodes: tuple[NodeLoad, ...] | list[NodeLoad],
    *,
    model: str,
    origin: str,
    offloaded: bool,
    now: float,
    stale_after_s: float,
) -> list[NodeLoad]:
    """Where to send the request, best first; empty when it may not or cannot go."""
    if offloaded:
        return []  # one hop at most
    fit = [
        n
        for n in nodes
        if n.id != origin
        and not n.revoked
        and n.reachable
        and seen_within(n.last_seen, now, stale_after_s)
        and serves(n, model)
    ]
    return sorted(
        fit, key=lambda n: (n.queue_waiting, n.cpu_percent, -n.memory_available_mib, n.id)
    )
