"""One definition of online, stale and offline (hub/planning/health.py): the registry, the
placement planner and the offload planner agree at the boundaries of the windows."""

from __future__ import annotations

import pytest

from hub.planning.health import NodeStatus, node_status, seen_within
from hub.planning.offload import NodeLoad, candidates
from hub.planning.placement import plan
from hub.planning.snapshots import Assignment, Deployment, NodeSnapshot

NOW = 1_000.0
STALE_AFTER_S = 45.0
OFFLINE_AFTER_S = 120.0


def status(ago: float | None) -> NodeStatus:
    return node_status(
        None if ago is None else NOW - ago,
        NOW,
        revoked=False,
        stale_after_s=STALE_AFTER_S,
        offline_after_s=OFFLINE_AFTER_S,
    )


@pytest.mark.parametrize(
    ("ago", "expected"),
    [
        (0.0, NodeStatus.online),
        (STALE_AFTER_S - 0.001, NodeStatus.online),
        (STALE_AFTER_S, NodeStatus.stale),  # the window's end: no longer within it
        (OFFLINE_AFTER_S - 0.001, NodeStatus.stale),
        (OFFLINE_AFTER_S, NodeStatus.offline),
        (None, NodeStatus.offline),  # never seen
        (-OFFLINE_AFTER_S, NodeStatus.online),  # a clock ahead of ours: seen, just now
    ],
)
def test_a_window_ends_at_its_length_exactly(ago: float | None, expected: NodeStatus) -> None:
    assert status(ago) is expected
    last_seen = None if ago is None else NOW - ago
    assert seen_within(last_seen, NOW, STALE_AFTER_S) is (expected is NodeStatus.online)


@pytest.mark.parametrize("ago", [0.0, STALE_AFTER_S - 0.001, STALE_AFTER_S, STALE_AFTER_S + 1])
def test_the_planners_take_as_online_what_the_registry_shows_online(ago: float) -> None:
    online = status(ago) is NodeStatus.online
    last_seen = NOW - ago

    # Placement: a new replica goes to an online node only.
    node = NodeSnapshot(
        id="n1", site="a", region=None, labels={}, memory_mib=8000, gpus=(), last_seen=last_seen
    )
    chat = Deployment(
        id="chat", model="m", version="1", replicas=1, service_class="S1", memory_mib=1000
    )
    placed = plan(
        [chat],
        [node],
        [],
        now=NOW,
        stale_after_s=STALE_AFTER_S,
        offline_grace_s=OFFLINE_AFTER_S,
    )
    assert bool(placed.assignments) is online

    # Offload: only an online node is a candidate.
    load = NodeLoad(
        id="n1", name="n1", models=("m@1",), queue_waiting=0, cpu_percent=0.0,
        memory_available_mib=8000, last_seen=last_seen,
    )  # fmt: skip
    chosen = candidates(
        [load], model="m", origin="n0", offloaded=False, now=NOW, stale_after_s=STALE_AFTER_S
    )
    assert bool(chosen) is online


def test_a_node_is_up_for_placement_until_the_grace_ends_exactly() -> None:
    """Its replicas stay while it is seen within the grace period, not at its end."""
    chat = Deployment(
        id="chat", model="m", version="1", replicas=1, service_class="S1", memory_mib=1000
    )
    for ago, stays in ((OFFLINE_AFTER_S - 0.001, True), (OFFLINE_AFTER_S, False)):
        node = NodeSnapshot(
            id="n1", site="a", region=None, labels={}, memory_mib=8000, gpus=(),
            last_seen=NOW - ago,
        )  # fmt: skip
        kept = plan(
            [chat],
            [node],
            [Assignment("chat", "n1")],
            now=NOW,
            stale_after_s=STALE_AFTER_S,
            offline_grace_s=OFFLINE_AFTER_S,
        )
        assert (kept.moved == ()) is stays
