"""The hub's placement planner (hub/planning/placement.py): its rules as properties over
random small fleets, checked against a restatement of the rules written here, and as
examples that read like its documentation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hub.planning.placement import plan
from hub.planning.snapshots import Assignment, Deployment, Gpu, NodeSnapshot, Plan
from tests.budget import tries

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

NOW = 1_000_000.0
STALE_AFTER_S = 30.0
OFFLINE_GRACE_S = 300.0
SITES = ("a", "b", "c")
REGIONS = ("eu", "us")
TENANTS = ("t1", "t2")

T = TypeVar("T")

PROPERTIES = settings(max_examples=tries(200), deadline=None)


@dataclass(frozen=True)
class World:
    deployments: tuple[Deployment, ...]
    nodes: tuple[NodeSnapshot, ...]
    current: tuple[Assignment, ...] = ()

    def with_node(self, node_id: str, **changes: Any) -> World:
        nodes = tuple(replace(n, **changes) if n.id == node_id else n for n in self.nodes)
        return replace(self, nodes=nodes)

    def planned(self, now: float = NOW) -> Plan:
        return plan(
            self.deployments,
            self.nodes,
            self.current,
            now=now,
            stale_after_s=STALE_AFTER_S,
            offline_grace_s=OFFLINE_GRACE_S,
        )


def node(node_id: str, **fields: Any) -> NodeSnapshot:
    """A healthy shared node with 8000 MiB and no GPU, unless told otherwise."""
    base: dict[str, Any] = {
        "id": node_id,
        "site": "a",
        "region": "eu",
        "labels": {},
        "memory_mib": 8000,
        "gpus": (),
        "last_seen": NOW,
    }
    return NodeSnapshot(**(base | fields))


def deployment(deployment_id: str, **fields: Any) -> Deployment:
    """One S1 replica of 1000 MiB, anywhere, unless told otherwise."""
    base: dict[str, Any] = {
        "id": deployment_id,
        "model": "gemma-3-270m",
        "version": "1",
        "replicas": 1,
        "service_class": "S1",
        "memory_mib": 1000,
    }
    return Deployment(**(base | fields))


def where(p: Plan) -> dict[str, list[str]]:
    """Deployment id -> the nodes of its replicas, for examples that read at a glance."""
    out: dict[str, list[str]] = {}
    for a in p.assignments:
        out.setdefault(a.deployment_id, []).append(a.node_id)
    return out


# -- random worlds -----------------------------------------------------------------------------

node_labels = st.fixed_dictionaries(
    {}, optional={"tier": st.sampled_from(("edge", "core")), "cam": st.just("yes")}
)
# A label few nodes carry: deployments that ask for it read their candidates another way.
RARE = {"room": "lab"}
MEMORY = (500, 1000, 2000, 4000, 8000)
GPU_MEMORY = (2000, 4000, 8000, 12000)


def mostly(usual: T, *others: T, odds: int = 2) -> st.SearchStrategy[T]:
    """`usual` `odds` times as often as all the `others` together: the rules are
    exercised best where most things are normal and placements compete."""
    return st.sampled_from((usual,) * odds * len(others) + others)


def rarely(odds: int) -> st.SearchStrategy[bool]:
    """True once in `odds + 1` draws (a plain boolean is true half the time)."""
    return st.sampled_from((False,) * odds + (True,))


def some(values: Sequence[str], odds: int) -> st.SearchStrategy[tuple[str, ...]]:
    """Mostly none (any), sometimes one or two."""
    return mostly((), *((v,) for v in values), tuple(values[:2]), odds=odds)


@st.composite
def nodes(draw: st.DrawFn, node_id: str, odds: int = 2) -> NodeSnapshot:
    """A node, healthy and shared `odds` times as often as not."""
    # Heartbeat ages on both sides of the stale window and of the grace period.
    ago = draw(mostly(0.0, None, 29.0, 30.0, 31.0, 299.0, 300.0, 301.0, 5000.0, odds=odds))
    return NodeSnapshot(
        id=node_id,
        site=draw(st.sampled_from(SITES)),
        region=draw(st.sampled_from((*REGIONS, *REGIONS, None))),
        labels=draw(node_labels) | (RARE if draw(rarely(9)) else {}),
        memory_mib=draw(mostly(8000, 16000, 4000, 2000, 0, odds=1)),
        gpus=tuple(
            Gpu("gpu", m) for m in draw(st.lists(st.sampled_from((8000, 16000, 4000)), max_size=2))
        ),
        last_seen=None if ago is None else NOW - ago,
        draining=draw(rarely(5 * odds)),
        revoked=draw(rarely(10 * odds)),
        tenant=draw(mostly(None, *TENANTS, odds=2 * odds)),
        private=draw(rarely(5 * odds)),
    )


@st.composite
def deployments(draw: st.DrawFn, deployment_id: str, odds: int = 2) -> Deployment:
    """A deployment, unconstrained and shared about `odds` times as often as not."""
    service_class = draw(mostly("S1", "S0", "S2", "S3", "S4", odds=odds // 2))
    gpu = draw(rarely(2))
    return Deployment(
        id=deployment_id,
        model="m",
        version="1",
        replicas=draw(st.integers(0, 3)),
        service_class=service_class,
        memory_mib=draw(st.sampled_from(MEMORY)),
        gpu=gpu,
        gpu_memory_mib=draw(st.sampled_from(GPU_MEMORY)) if gpu else 0,
        sites=draw(some(SITES, odds)),
        regions=draw(some(REGIONS, odds)),
        labels=draw(mostly({}, {"tier": "edge"}, {"cam": "yes"}, RARE, odds=odds)),
        tenant=draw(st.sampled_from(TENANTS))
        if service_class == "S3"
        else draw(mostly(None, TENANTS[0], odds=5 * odds)),
    )


@st.composite
def worlds(draw: st.DrawFn, max_nodes: int = 8, *, past: bool = True, odds: int = 2) -> World:
    """1 to `max_nodes` nodes and 1 to 6 deployments (see `odds` there), and a `current`
    left by the past (none without `past`).

    The past: deployments of other sizes or replica counts, on nodes that were healthy or
    offline (so replicas crowd on the others) and may have had other labels, sites,
    tenancy, memory or GPUs, planned the same way; plus assignments stale in every other
    way (gone deployments and nodes, broken constraints, wrong or missing GPU pins)."""
    fleet = tuple(draw(nodes(f"n{i}", odds)) for i in range(draw(st.integers(1, max_nodes))))
    work = tuple(draw(deployments(f"d{i}", odds)) for i in range(draw(st.integers(1, 6))))
    if not past:
        return World(work, fleet)
    before = World(
        tuple(draw(mostly(d, draw(drifted(d)))) for d in work),
        tuple(
            replace(
                draw(mostly(n, draw(nodes(n.id, odds)))),
                last_seen=draw(mostly(NOW, None)),
                draining=False,
                revoked=False,
            )
            for n in fleet
        ),
    )
    current = list(before.planned().assignments)
    taken = {a.key for a in current}
    pairs = [
        (d, n)
        for d in [*(d.id for d in work), "gone"]
        for n in [*(n.id for n in fleet), "lost"]
        if (d, n) not in taken
    ]
    for d, n in draw(
        st.lists(st.sampled_from(pairs), max_size=4, unique=True) if pairs else st.just([])
    ):
        current.append(Assignment(d, n, draw(st.sampled_from((None, 0, 1, 2)))))
    return World(work, fleet, tuple(current))


@st.composite
def drifted(draw: st.DrawFn, d: Deployment) -> Deployment:
    """`d` as it was before a change of size or replica count."""
    return replace(
        d,
        replicas=draw(st.integers(0, 4)),
        memory_mib=draw(st.sampled_from(MEMORY)),
        gpu_memory_mib=draw(st.sampled_from(GPU_MEMORY)) if d.gpu else 0,
    )


@st.composite
def settled(draw: st.DrawFn) -> tuple[World, Plan]:
    """A world whose `current` is its own plan: the steady state that changes start from.
    Its fleet is small and mostly healthy, its deployments mostly unconstrained, so that
    most replicas are placed and share nodes and GPUs."""
    world = draw(worlds(max_nodes=4, odds=8))
    world = replace(world, current=world.planned().assignments)
    return world, world.planned()


# -- the rules, restated -------------------------------------------------------------------------


def honours(d: Deployment, n: NodeSnapshot) -> bool:
    """Every constraint except capacity."""
    return (
        (not d.sites or n.site in d.sites)
        and (not d.regions or n.region in d.regions)
        and all(n.labels.get(k) == v for k, v in d.labels.items())
        and n.tenant == d.tenant
        and n.private == (d.service_class == "S4")
        and n.memory_mib >= d.memory_mib
        and (not d.gpu or any(g.memory_mib >= d.gpu_memory_mib for g in n.gpus))
    )


def up(n: NodeSnapshot, now: float = NOW) -> bool:
    # Seen within the window: less than it ago (hub/planning/health.py).
    return not n.revoked and n.last_seen is not None and now - n.last_seen < OFFLINE_GRACE_S


def takes_new(n: NodeSnapshot, now: float = NOW) -> bool:
    online = n.last_seen is not None and now - n.last_seen < STALE_AFTER_S
    return up(n, now) and online and not n.draining


def fits_together(replicas: Iterable[tuple[Deployment, int | None]], n: NodeSnapshot) -> bool:
    """Whether these (deployment, GPU pin) replicas fit on `n` as they are pinned."""
    memory = n.memory_mib
    gpus = dict(enumerate(g.memory_mib for g in n.gpus))
    for d, pin in replicas:
        memory -= d.memory_mib
        if d.gpu:
            if pin not in gpus:
                return False
            gpus[pin] -= d.gpu_memory_mib
    return memory >= 0 and all(v >= 0 for v in gpus.values())


def room_left(world: World, p: Plan) -> dict[str, tuple[int, list[int]]]:
    """Node id -> the memory and the memory of each GPU it has left under the plan."""
    by_d = {d.id: d for d in world.deployments}
    left = {n.id: (n.memory_mib, [g.memory_mib for g in n.gpus]) for n in world.nodes}
    for a in p.assignments:
        d = by_d[a.deployment_id]
        memory, gpus = left[a.node_id]
        if a.gpu is not None:
            gpus[a.gpu] -= d.gpu_memory_mib
        left[a.node_id] = (memory - d.memory_mib, gpus)
    return left


def has_room(d: Deployment, left: tuple[int, list[int]]) -> bool:
    memory, gpus = left
    return memory >= d.memory_mib and (not d.gpu or max(gpus, default=-1) >= d.gpu_memory_mib)


def check(world: World, p: Plan, now: float = NOW) -> None:
    """Every rule of the module that one plan can show."""
    by_d = {d.id: d for d in world.deployments}
    by_n = {n.id: n for n in world.nodes}
    before = {a.key for a in world.current}
    keys = [a.key for a in p.assignments]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)  # one replica of a deployment per node
    for a in p.assignments:
        d, n = by_d[a.deployment_id], by_n[a.node_id]
        assert up(n, now)
        assert not n.draining
        assert a.key in before or takes_new(n, now)  # new replicas only on fresh nodes
        assert honours(d, n)
        assert a.gpu in range(len(n.gpus)) if d.gpu else a.gpu is None
    left = room_left(world, p)
    for node_id, (memory, gpus) in left.items():
        assert memory >= 0, f"{node_id} over its memory"
        assert min(gpus, default=0) >= 0, f"{node_id} over a GPU's memory"

    placed = Counter(a.deployment_id for a in p.assignments)
    assert all(placed[d.id] <= d.replicas for d in world.deployments)
    short = {d.id for d in world.deployments if placed[d.id] < d.replicas}
    assert set(p.unplaced) == short
    for d_id in short:
        d = by_d[d_id]
        assert p.unplaced[d_id].startswith(f"{placed[d_id]} of {d.replicas} replicas placed: ")
        assert p.unplaced[d_id].endswith(".")
        # The shortfall is real: no node could take one more.
        holders = {a.node_id for a in p.assignments if a.deployment_id == d_id}
        for n in world.nodes:
            if n.id not in holders and takes_new(n, now) and honours(d, n):
                assert not has_room(d, left[n.id]), f"{d_id} is short but {n.id} has room"

    moved = [a.key for a in p.moved]
    assert moved == sorted(moved)
    assert set(moved) == before - set(keys)  # and a replica that left does not come back
    check_moves_are_excused(world, p, now)


def check_moves_are_excused(world: World, p: Plan, now: float) -> None:
    """Stickiness: a replica of `current` moves only for one of the module's reasons."""
    by_d = {d.id: d for d in world.deployments}
    by_n = {n.id: n for n in world.nodes}

    def valid(a: Assignment) -> bool:
        d, n = by_d.get(a.deployment_id), by_n.get(a.node_id)
        return d is not None and n is not None and up(n, now) and not n.draining and honours(d, n)

    stays = [a for a in world.current if valid(a)]
    wanted = Counter(a.deployment_id for a in stays)
    left = room_left(world, p)
    for a in p.moved:
        if not valid(a) or wanted[a.deployment_id] > by_d[a.deployment_id].replicas:
            continue  # gone, down, draining, a constraint changed, or replicas reduced
        # Otherwise only for room (a deployment grew, a node shrank): its node was crowded,
        # and what stayed there leaves no room for it.
        d, n = by_d[a.deployment_id], by_n[a.node_id]
        here = [(by_d[b.deployment_id], b.gpu) for b in stays if b.node_id == n.id]
        assert not fits_together(here, n), f"{a} moved off a node that had room for all"
        assert not has_room(d, left[n.id]), f"{a} moved off a node that still has room for it"


def reference(world: World) -> tuple[Assignment, ...]:
    """A plan from scratch the plain way: every replica by a scan of the whole fleet for
    the node with the most memory free, then the lowest id; the planner's indexes must
    agree with it."""
    memory = {n.id: n.memory_mib for n in world.nodes}
    gpus = {n.id: [g.memory_mib for g in n.gpus] for n in world.nodes}
    rank = {c: i for i, c in enumerate(("S4", "S3", "S2", "S1", "S0"))}
    out = []
    for d in sorted(world.deployments, key=lambda d: (rank[d.service_class], d.id)):
        holders: set[str] = set()
        for _ in range(d.replicas):
            fits = [
                n
                for n in world.nodes
                if n.id not in holders
                and takes_new(n)
                and honours(d, n)
                and memory[n.id] >= d.memory_mib
                and (not d.gpu or max(gpus[n.id], default=-1) >= d.gpu_memory_mib)
            ]
            if not fits:
                break
            best = min(fits, key=lambda n: (-memory[n.id], n.id))
            gpu = None
            if d.gpu:
                free = gpus[best.id]
                gpu = min(range(len(free)), key=lambda i: (-free[i], i))
                free[gpu] -= d.gpu_memory_mib
            memory[best.id] -= d.memory_mib
            holders.add(best.id)
            out.append(Assignment(d.id, best.id, gpu))
    return tuple(sorted(out, key=lambda a: a.key))


# -- properties ---------------------------------------------------------------------------------


@PROPERTIES
@given(worlds())
def test_every_plan_honours_every_rule_and_places_all_it_can(world: World) -> None:
    check(world, world.planned())


@PROPERTIES
@given(worlds(max_nodes=40, past=False))
def test_new_replicas_go_where_a_plain_scan_of_the_fleet_would_put_them(world: World) -> None:
    assert world.planned().assignments == reference(world)


@PROPERTIES
@given(worlds(), st.data())
def test_the_plan_depends_on_the_inputs_not_their_order(world: World, data: st.DataObject) -> None:
    shuffled = World(
        tuple(data.draw(st.permutations(world.deployments))),
        tuple(data.draw(st.permutations(world.nodes))),
        tuple(data.draw(st.permutations(world.current))),
    )
    assert shuffled.planned() == world.planned() == world.planned()


@PROPERTIES
@given(worlds())
def test_replanning_an_unchanged_fleet_moves_nothing(world: World) -> None:
    first = world.planned()
    again = replace(world, current=first.assignments).planned()
    assert again == Plan(assignments=first.assignments, unplaced=first.unplaced, moved=())


@PROPERTIES
@given(settled(), st.data())
def test_an_outage_shorter_than_the_grace_moves_nothing(
    state: tuple[World, Plan], data: st.DataObject
) -> None:
    world, steady = state
    busy = sorted({a.node_id for a in steady.assignments})
    assume(busy)
    victim = data.draw(st.sampled_from(busy))
    # Shorter than the grace (an outage of the grace exactly is past it: hub/planning/health.py).
    ago = data.draw(st.floats(STALE_AFTER_S + 1, OFFLINE_GRACE_S - 1))
    during = world.with_node(victim, last_seen=NOW - ago)
    p = during.planned()
    check(during, p)
    assert p.moved == ()
    assert p.assignments == steady.assignments  # and nothing new on the stale node


@PROPERTIES
@given(settled(), st.data())
def test_an_outage_past_the_grace_moves_replicas_and_the_return_moves_none_back(
    state: tuple[World, Plan], data: st.DataObject
) -> None:
    world, steady = state
    busy = sorted({a.node_id for a in steady.assignments})
    assume(busy)
    victim = data.draw(st.sampled_from(busy))
    was = next(n for n in world.nodes if n.id == victim)
    gone = world.with_node(victim, last_seen=NOW - OFFLINE_GRACE_S - 1)
    outage = gone.planned()
    check(gone, outage)
    assert {a.key for a in outage.moved} == {
        a.key for a in steady.assignments if a.node_id == victim
    }
    assert all(a.node_id != victim for a in outage.assignments)

    back = replace(gone, current=outage.assignments).with_node(victim, last_seen=was.last_seen)
    returned = back.planned()
    check(back, returned)
    assert returned.moved == ()
    assert set(outage.assignments) <= set(returned.assignments)
    # It takes only what nothing else could: replicas still missing.
    assert all(
        a.deployment_id in outage.unplaced for a in returned.assignments if a.node_id == victim
    )


@PROPERTIES
@given(settled(), st.data())
def test_draining_moves_everything_off_a_node_and_nothing_else(
    state: tuple[World, Plan], data: st.DataObject
) -> None:
    world, steady = state
    victim = data.draw(st.sampled_from([n.id for n in world.nodes]))
    drained = world.with_node(victim, draining=True)
    p = drained.planned()
    check(drained, p)
    assert {a.key for a in p.moved} == {a.key for a in steady.assignments if a.node_id == victim}
    assert all(a.node_id != victim for a in p.assignments)


@PROPERTIES
@given(settled(), st.data())
def test_a_node_that_shrinks_keeps_what_still_fits(
    state: tuple[World, Plan], data: st.DataObject
) -> None:
    world, steady = state
    busy = sorted({a.node_id for a in steady.assignments})
    assume(busy)
    chosen = data.draw(st.sampled_from(busy))
    victim = next(n for n in world.nodes if n.id == chosen)
    shrunk = world.with_node(
        victim.id,
        memory_mib=data.draw(st.integers(0, victim.memory_mib)),
        gpus=tuple(
            replace(g, memory_mib=data.draw(st.integers(0, g.memory_mib))) for g in victim.gpus
        ),
    )
    p = shrunk.planned()
    check(shrunk, p)
    assert all(a.node_id == victim.id for a in p.moved)


@PROPERTIES
@given(settled(), st.data())
def test_reducing_replicas_drops_only_the_excess(
    state: tuple[World, Plan], data: st.DataObject
) -> None:
    world, steady = state
    placed = Counter(a.deployment_id for a in steady.assignments)
    assume(placed)
    target = data.draw(st.sampled_from(sorted(placed)))
    fewer = data.draw(st.integers(0, placed[target] - 1))
    reduced = replace(
        world,
        deployments=tuple(
            replace(d, replicas=fewer) if d.id == target else d for d in world.deployments
        ),
    )
    p = reduced.planned()
    check(reduced, p)
    assert len(p.moved) == placed[target] - fewer
    assert all(a.deployment_id == target for a in p.moved)
    assert set(steady.assignments) - set(p.moved) <= set(p.assignments)


# -- examples -----------------------------------------------------------------------------------


def test_new_replicas_spread_to_the_nodes_with_the_most_free_memory() -> None:
    fleet = (node("small", memory_mib=4000), node("big", memory_mib=16000), node("mid"))
    p = World((deployment("chat", replicas=2), deployment("embed", memory_mib=8000)), fleet)
    assert where(p.planned()) == {"chat": ["big", "mid"], "embed": ["big"]}


def test_reducing_replicas_keeps_those_on_online_nodes_then_the_lowest_ids() -> None:
    fleet = (node("n1", last_seen=NOW - 60), node("n2"), node("n3"), node("n4"))
    current = tuple(Assignment("chat", n) for n in ("n1", "n2", "n3", "n4"))
    p = World((deployment("chat", replicas=2),), fleet, current).planned()
    assert where(p) == {"chat": ["n2", "n3"]}
    assert p.moved == (Assignment("chat", "n1"), Assignment("chat", "n4"))


def test_a_rare_label_finds_its_best_nodes_in_a_large_fleet() -> None:
    fleet = [node(f"n{i:02d}", memory_mib=8000 + i) for i in range(40)]
    fleet += [node(f"lab{i}", labels=RARE, memory_mib=4000 + i) for i in range(3)]
    p = World((deployment("chat", replicas=2, labels=RARE),), tuple(fleet)).planned()
    assert where(p) == {"chat": ["lab1", "lab2"]}


def test_ties_go_to_the_lowest_node_id() -> None:
    p = World((deployment("chat", replicas=2),), (node("n3"), node("n1"), node("n2"))).planned()
    assert where(p) == {"chat": ["n1", "n2"]}


def test_reserved_classes_are_placed_first() -> None:
    work = (
        deployment("a-shared", service_class="S0", memory_mib=6000),
        deployment("z-reserved", service_class="S2", memory_mib=6000),
    )
    p = World(work, (node("n1"),)).planned()
    assert where(p) == {"z-reserved": ["n1"]}
    assert p.unplaced == {
        "a-shared": "0 of 1 replicas placed: no matching node has room for a replica"
        " (6000 MiB of memory free)."
    }


def test_dedicated_and_private_nodes_take_only_their_own_deployments() -> None:
    fleet = (node("shared"), node("acme", tenant="acme"), node("home", private=True))
    work = (
        deployment("public"),
        deployment("acme-only", service_class="S3", tenant="acme"),
        deployment("on-prem", service_class="S4"),
    )
    assert where(World(work, fleet).planned()) == {
        "acme-only": ["acme"],
        "on-prem": ["home"],
        "public": ["shared"],
    }


def test_gpu_replicas_share_a_gpu_while_its_memory_lasts() -> None:
    fleet = (node("n1", memory_mib=64000, gpus=(Gpu("a", 16000), Gpu("b", 8000))),)
    work = tuple(deployment(f"d{i}", gpu=True, gpu_memory_mib=8000) for i in range(4))
    p = World(work, fleet).planned()
    # The GPU with the most memory free, the first of equals.
    assert [(a.deployment_id, a.gpu) for a in p.assignments] == [("d0", 0), ("d1", 0), ("d2", 1)]
    assert p.unplaced["d3"] == (
        "0 of 1 replicas placed: no matching node has room for a replica"
        " (1000 MiB of memory and a GPU with 8000 MiB free)."
    )


def test_a_grown_deployment_moves_the_last_replica_in_placement_order_off_a_full_node() -> None:
    fleet = (node("n1"), node("n2", memory_mib=4000))
    current = (Assignment("a", "n1"), Assignment("b", "n1"))
    grown = (deployment("a", memory_mib=4000), deployment("b", memory_mib=5000))
    p = World(grown, fleet, current).planned()
    assert p.moved == (Assignment("b", "n1"),)
    assert where(p) == {"a": ["n1"]}
    assert "b" in p.unplaced  # n2 is too small for it
    grown_less = (deployment("a", memory_mib=4000), deployment("b", memory_mib=4000))
    assert World(grown_less, fleet, current).planned().moved == ()


def test_a_short_outage_moves_nothing_and_a_long_one_moves_replicas_for_good() -> None:
    fleet = (node("n1"), node("n2", memory_mib=4000))
    world = World((deployment("chat"),), fleet, (Assignment("chat", "n1"),))
    assert world.planned(now=NOW + 200).moved == ()  # n2 went stale as well: nothing new
    later = world.with_node("n2", last_seen=NOW + 400)
    moved = later.planned(now=NOW + 400)
    assert moved.moved == (Assignment("chat", "n1"),)
    assert where(moved) == {"chat": ["n2"]}
    back = replace(later, current=moved.assignments).with_node("n1", last_seen=NOW + 500)
    assert back.planned(now=NOW + 500) == Plan(moved.assignments, {}, ())


def test_nodes_never_seen_revoked_stale_or_draining_get_nothing_new() -> None:
    fleet = (
        node("never", last_seen=None),
        node("revoked", revoked=True),
        node("stale", last_seen=NOW - 60),
        node("draining", draining=True),
    )
    p = World((deployment("chat"),), fleet).planned()
    assert p.assignments == ()
    assert p.unplaced == {
        "chat": "0 of 1 replicas placed: no matching node is up, online and not draining."
    }


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"tenant": "acme", "service_class": "S3"}, "no node is dedicated to tenant acme."),
        ({"service_class": "S4"}, "no node is private (S4 runs only on private nodes)."),
        ({"sites": ("b", "c")}, "no matching node is in site b or c."),
        ({"regions": ("us",)}, "no matching node is in region us."),
        ({"labels": {"tier": "core"}}, "no matching node has the labels tier=core."),
        ({"labels": {"room": "{0}"}}, "no matching node has the labels room={0}."),
        (
            {"replicas": 3, "labels": {"tier": "edge"}},
            "only 2 matching nodes have the labels tier=edge (one replica per node).",
        ),
        (
            {"gpu": True, "gpu_memory_mib": 9000},
            "no matching node has a GPU with 9000 MiB or more.",
        ),
        ({"memory_mib": 20000}, "no matching node has 20000 MiB of memory or more."),
        (
            {"replicas": 3, "sites": ("a",), "gpu": True, "gpu_memory_mib": 100},
            (
                "only 2 matching nodes are in site a (one replica per node),"
                " and only 1 of them has a GPU with 100 MiB or more."
            ),
        ),
    ],
)
def test_unplaced_names_the_constraint_that_failed(changes: dict[str, object], why: str) -> None:
    fleet = (
        node("n1", labels={"tier": "edge"}, gpus=(Gpu("g", 8000),)),
        node("n2", labels={"tier": "edge"}),
        node("n3", site="d", region="eu"),
    )
    p = World((deployment("chat", **changes),), fleet).planned()
    placed = len(p.assignments)
    replicas = changes.get("replicas", 1)
    assert p.unplaced == {"chat": f"{placed} of {replicas} replicas placed: {why}"}


def test_inputs_that_cannot_be_planned_are_refused() -> None:
    with pytest.raises(ValueError, match="two nodes with the same id: 'n1'"):
        World((), (node("n1"), node("n1"))).planned()
    with pytest.raises(ValueError, match="two deployments with the same id: 'd'"):
        World((deployment("d"), deployment("d")), ()).planned()
    with pytest.raises(ValueError, match="two assignments"):
        World((), (), (Assignment("d", "n1"), Assignment("d", "n1", 0))).planned()
    with pytest.raises(ValueError, match="needs a tenant"):
        deployment("d", service_class="S3")
    with pytest.raises(ValueError, match="unknown service class 'S9'"):
        deployment("d", service_class="S9")
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        deployment("d", replicas=-1)


def test_snapshots_are_immutable_and_hashable() -> None:
    source = {"tier": "edge"}
    n = node("n1", labels=source)
    source["tier"] = "core"
    assert n.labels == {"tier": "edge"}  # a copy: the caller's dict cannot change a plan
    assert hash(n) == hash(node("n1", labels={"tier": "edge"}))
    assert len({deployment("d", labels={"a": "1"}), deployment("d", labels={"a": "1"})}) == 1
