"""Which node the hub hands an offloaded request to: what the hub measured of its own
offloads (failures, latency) and of the node's heartbeats (their age) before what the
node says of its load, which may be a lie told to draw requests and their clients' keys."""

from __future__ import annotations

from hub.offload import FAILURES_KEPT_S, NODES_MEASURED, Measurements, load_of
from hub.planning.offload import NodeLoad, candidates
from hub.state.nodes import Node
from shared import protocol

NOW = 1_000.0
STALE_AFTER_S = 45.0


def _load(
    node: str, *, queue: int = 0, failures: int = 0, latency_s: float | None = None
) -> NodeLoad:
    return NodeLoad(
        node, node, ("m@1",), queue, 10.0, 1000, NOW - 1, failures=failures, latency_s=latency_s
    )


def _order(nodes: list[NodeLoad]) -> list[str]:
    chosen = candidates(
        nodes, model="m", origin="o", offloaded=False, now=NOW, stale_after_s=STALE_AFTER_S
    )
    return [n.id for n in chosen]


def test_what_the_hub_measured_ranks_before_what_a_node_claims() -> None:
    # A node that says it is idle but failed lately comes last, however idle it says.
    assert _order([_load("liar", failures=2), _load("busy", queue=9)]) == ["busy", "liar"]
    # One measured slow (by whole steps) after one measured fast, whatever their queues.
    assert _order([_load("slow", latency_s=2.0), _load("fast", queue=5, latency_s=0.05)]) == [
        "fast",
        "slow",
    ]
    # Latencies within a step rank by the node's load; a node not measured yet is tried.
    assert _order([_load("a", queue=3, latency_s=0.02), _load("b", queue=1)]) == ["b", "a"]
    # A node heard lately before one whose last heartbeat is old (but not stale).
    old = NodeLoad("old", "old", ("m@1",), 0, 0.0, 9000, NOW - 30)
    assert _order([old, _load("fresh", queue=4)]) == ["fresh", "old"]


def test_measurements_forget_old_failures_and_stay_bounded() -> None:
    measured = Measurements()
    measured.failed("n1", at=NOW - FAILURES_KEPT_S - 1)
    measured.failed("n1", at=NOW - 10)
    assert measured.of("n1").failures(NOW) == 1
    measured.answered("n2", 1.0)
    measured.answered("n2", 0.0)
    latency = measured.of("n2").latency_s
    assert latency is not None
    assert 0.0 < latency < 1.0  # a moving average, not the last answer alone
    for i in range(NODES_MEASURED + 10):
        measured.answered(f"x{i}", 0.1)
    assert measured.of("n1").failures(NOW) == 0  # the least recent forgotten
    assert len(measured._nodes) == NODES_MEASURED  # its bound


def test_a_node_is_a_candidate_only_with_a_fleet_listener() -> None:
    """`tls: false` or a LAN API alone: never sent a client's key; a fleet listener
    (mutual TLS) is."""
    base = Node(
        id="n", name="n", site="s", wg_public_key="k", overlay_address="100.64.0.2",
        enrolled_at=0.0, last_seen=NOW, revoked_at=None, address="100.64.0.2",
    )  # fmt: skip

    def with_api(api: protocol.LanApi) -> Node:
        capacity = protocol.Capacity(models=["m@1"], offload=True, api=api)
        return Node(**{**base.__dict__, "capacity": capacity})

    assert not load_of(with_api(protocol.LanApi(port=8080, tls=False)), now=NOW).reachable
    assert not load_of(with_api(protocol.LanApi(port=8443, tls=True)), now=NOW).reachable
    fleet = with_api(protocol.LanApi(port=8443, tls=True, fleet_port=8444))
    assert load_of(fleet, now=NOW).reachable
    assert fleet.fleet_url == "https://100.64.0.2:8444"
