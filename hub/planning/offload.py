"""Burst offload: which nodes may take a request that its own node had to shed.

A node that must refuse a request for load (429 `overloaded` or `queue_full`) forwards
it through the tunnel to the hub, which hands it to another node. The candidates are the
nodes that serve the model, are online (seen within `stale_after_s`, as
hub/planning/health.py defines it), have a fleet listener the hub calls over mutual TLS,
and are not the node the request came from.

What a node says of its own load may be wrong, or a lie told to draw requests (which
carry clients' keys), so what the hub measures itself ranks first:

1. the offloads to the node that failed lately (unreachable, a handshake its certificate
   failed, a server error), fewest first: a node that fails is tried last;
2. the age of its last heartbeat, in halves of `stale_after_s`: a node heard lately first;
3. the hub's measure of its offload latency (to the answer's headers), in steps of
   `LATENCY_STEP_S`: a node not measured yet counts as fast, so it is tried;
4. then what the last heartbeat tells: the shortest queue, the idlest CPU, the most free
   memory.
An offloaded request carries a mark and is never offloaded again, whatever happens at
its second node: at most one hop, so no loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from hub.planning.health import seen_within

LATENCY_STEP_S = 0.1  # offload latencies closer than this rank by the node's load


@dataclass(frozen=True)
class NodeLoad:
    """What the hub knows of a node: from its last heartbeat (what the node says), and
    from the hub's own offloads to it (what the hub measured)."""

    id: str
    name: str
    models: tuple[str, ...]  # refs, name@version
    queue_waiting: int
    cpu_percent: float
    memory_available_mib: int
    last_seen: float | None
    revoked: bool = False
    reachable: bool = True  # it has a fleet listener (mutual TLS) the hub knows
    failures: int = 0  # offloads to it that failed lately (hub-measured)
    latency_s: float | None = None  # its recent offload latency (hub-measured)


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
    half = stale_after_s / 2

    def rank(n: NodeLoad) -> tuple[int, int, int, int, float, int, str]:
        age = now - (n.last_seen or now)
        latency = 0 if n.latency_s is None else int(n.latency_s / LATENCY_STEP_S)
        return (
            n.failures, int(max(0.0, age) // half), latency,
            n.queue_waiting, n.cpu_percent, -n.memory_available_mib, n.id,
        )  # fmt: skip

    return sorted(fit, key=rank)
