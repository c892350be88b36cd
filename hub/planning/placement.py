"""Placement: which appliance nodes run which model deployments.

`plan` is a pure function over immutable snapshots: no I/O and no clock of its own (`now`
is an argument). The hub's reconciler feeds it the fleet it knows, applies the result and
records what changed, and every rule below is tested without a fleet
(tests/hub/test_placement.py).

Rules, in the order they apply:

- **Health.** A node is *up* when it is not revoked and was seen within `offline_grace_s`
  of `now` (never seen: not up), and *online* when seen within `stale_after_s`, as
  hub/planning/health.py defines it for the whole hub (at the window's end exactly: not
  within). New replicas go only to nodes that are up, online and not draining.
- **Stickiness (no storms).** A replica in `current` stays where it is while its
  deployment exists and still wants that many replicas, its node is up (an outage shorter
  than the grace period moves nothing) and not draining, the node still meets every
  constraint and the replica still fits. A node that returns after its replicas moved gets
  none back: they run elsewhere, validly; it takes new replicas like any other node.
- **Constraints.** Sites, regions and labels (every label must match). Memory: the
  replicas on a node need at most its `memory_mib` together. GPU: each replica of a GPU
  deployment is pinned to one GPU of its node (`Assignment.gpu`), and the replicas pinned
  to a GPU share its memory.
- **Tenancy.** A dedicated node (`tenant=T`) runs only tenant T's deployments, and a
  tenant's deployment (S3) only T's nodes. A private node runs only S4 deployments, and S4
  runs only on private nodes (honouring its sites like any other deployment).
- **Anti-affinity.** At most one replica of a deployment per node. Whatever cannot be
  placed is reported in `Plan.unplaced` with the first constraint that left too few nodes.
- **Order.** Deployments are handled by class, S4, S3, S2, S1, S0 (reserved capacity is
  claimed first), then by id. A new replica goes to the node with the most free memory
  (spread), ties broken by node id. When a node cannot hold all its current replicas (a
  deployment grew), they are admitted in that same order and the ones that no longer fit
  move; replicas already pinned to a GPU are admitted before ones that need a GPU chosen.
  When a deployment has more replicas than it wants, it keeps those on online nodes first,
  then by node id.
- **Isolation.** A deployment at I2 goes only to nodes that report they can confine a
  worker in a cgroup (`NodeSnapshot.isolation`), at I3 only to such nodes dedicated to
  its tenant; I1 (its own worker process) runs anywhere (`NodeSnapshot.runs`).

Snapshots (hub/planning/snapshots.py) validate themselves when built (`ValueError`); `plan`
raises `ValueError` for two nodes or two deployments with one id, or a deployment
assigned twice to one node.

Nodes that take new replicas are indexed per tenancy class, per site and per label, each
index sorted by free memory, so a deployment reads only the nodes it may use, best first,
and stops at the first without enough memory: a 10,000-node fleet plans in milliseconds
(``python -m tests.benchmarks.placement``).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from hub.planning.health import seen_within
from hub.planning.snapshots import Assignment, Deployment, NodeSnapshot, Plan

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence


# A deployment with labels reads the nodes carrying its rarest label (every one of them)
# instead of its class or sites (best first) when that list is this many times shorter.
_LABEL_SCAN_RATIO = 8


def plan(
    deployments: Sequence[Deployment],
    nodes: Sequence[NodeSnapshot],
    current: Sequence[Assignment],
    *,
    now: float,
    stale_after_s: float,
    offline_grace_s: float,
) -> Plan:
    """Keeps what may stay (stickiness), then places the missing replicas; the rules are
    in the module's docstring. Raises `ValueError` for duplicate ids."""
    by_id = _unique(nodes, lambda n: n.id, "node")
    wanted = _unique(deployments, lambda d: d.id, "deployment")
    _unique(current, lambda a: a.key, "assignment")
    health = _Health(now, stale_after_s, offline_grace_s)
    usage = _Usage()

    kept, moved = _keep(current, wanted, by_id, health, usage)
    holders: dict[str, set[str]] = {d: set() for d in wanted}
    for a in kept:
        holders[a.deployment_id].add(a.node_id)

    short = [d for d in sorted(wanted.values(), key=_order) if len(holders[d.id]) < d.replicas]
    added = _place_new(short, by_id.values(), holders, health, usage) if short else []

    missing = sorted((d for d in short if len(holders[d.id]) < d.replicas), key=lambda d: d.id)
    unplaced: dict[str, str] = {}
    if missing:
        reasons = _Reasons(by_id.values(), health, usage)
        unplaced = {d.id: reasons.why(d, holders[d.id]) for d in missing}
    return Plan(
        assignments=tuple(sorted([*kept, *added], key=_by_key)),
        unplaced=unplaced,
        moved=tuple(sorted(moved, key=_by_key)),
    )


# -- the parts ------------------------------------------------------------------------------


def _order(d: Deployment) -> tuple[int, str]:
    return d.order


def _by_key(a: Assignment) -> tuple[str, str]:
    return a.key


_T = TypeVar("_T")
_K = TypeVar("_K")


def _unique(items: Iterable[_T], key: Callable[[_T], _K], what: str) -> dict[_K, _T]:
    found: dict[_K, _T] = {}
    for item in items:
        k = key(item)
        if k in found:
            raise ValueError(f"two {what}s with the same id: {k!r}")
        found[k] = item
    return found


@dataclass(frozen=True, slots=True)
class _Health:
    now: float
    stale_after_s: float
    offline_grace_s: float

    def up(self, node: NodeSnapshot) -> bool:
        """Keeps its replicas: a short outage moves nothing."""
        return not node.revoked and seen_within(node.last_seen, self.now, self.offline_grace_s)

    def online(self, node: NodeSnapshot) -> bool:
        return seen_within(node.last_seen, self.now, self.stale_after_s)

    def takes_new(self, node: NodeSnapshot) -> bool:
        """A stale node may be on its way out; new work goes where heartbeats are fresh."""
        return self.up(node) and self.online(node) and not node.draining


class _Usage:
    """Memory and per-GPU memory left on each node as replicas land on it; a node is
    looked at only when something lands on it or might, so a steady fleet costs little."""

    def __init__(self) -> None:
        self._free: dict[str, int] = {}
        self._gpu_free: dict[str, list[int]] = {}

    def free(self, node: NodeSnapshot) -> int:
        return self._free.get(node.id, node.memory_mib)

    def gpu_free(self, node: NodeSnapshot) -> list[int]:
        found = self._gpu_free.get(node.id)
        if found is None:
            found = self._gpu_free[node.id] = [g.memory_mib for g in node.gpus]
        return found

    def gpu_for(self, node: NodeSnapshot, d: Deployment, pin: int | None) -> int | None:
        """The GPU a replica of `d` would use: its pin, else the one with the most memory
        free (then the lowest index); None when none has room or `d` needs no GPU."""
        if not d.gpu:
            return None
        free = self.gpu_free(node)
        if pin is not None:
            return pin if 0 <= pin < len(free) and free[pin] >= d.gpu_memory_mib else None
        best = max(range(len(free)), key=lambda i: (free[i], -i), default=None)
        return best if best is not None and free[best] >= d.gpu_memory_mib else None

    def fits(self, node: NodeSnapshot, d: Deployment) -> bool:
        """Room for one more replica of `d`, on whichever GPU `gpu_for` would choose."""
        return self.free(node) >= d.memory_mib and (
            not d.gpu or max(self.gpu_free(node), default=-1) >= d.gpu_memory_mib
        )

    def take(self, node: NodeSnapshot, d: Deployment, gpu: int | None) -> Assignment:
        self._free[node.id] = self.free(node) - d.memory_mib
        if gpu is not None:
            self.gpu_free(node)[gpu] -= d.gpu_memory_mib
        return Assignment(d.id, node.id, gpu)


# -- constraints: one predicate each, shared by placement and by the reasons ------------------


def _tenancy_ok(node: NodeSnapshot, d: Deployment) -> bool:
    return node.tenancy == d.tenancy


def _site_ok(node: NodeSnapshot, d: Deployment) -> bool:
    return not d.sites or node.site in d.sites


def _region_ok(node: NodeSnapshot, d: Deployment) -> bool:
    return not d.regions or node.region in d.regions


def _labels_ok(node: NodeSnapshot, d: Deployment) -> bool:
    return d.labels.items() <= node.labels.items()


def _gpu_ok(node: NodeSnapshot, d: Deployment) -> bool:
    return not d.gpu or any(g.memory_mib >= d.gpu_memory_mib for g in node.gpus)


def _memory_ok(node: NodeSnapshot, d: Deployment) -> bool:
    return node.memory_mib >= d.memory_mib


def _isolation_ok(node: NodeSnapshot, d: Deployment) -> bool:
    return node.runs(d.isolation)


_CONSTRAINTS = (_tenancy_ok, _site_ok, _region_ok, _labels_ok, _isolation_ok, _gpu_ok, _memory_ok)


def _admits(node: NodeSnapshot, d: Deployment) -> bool:
    """Every constraint but capacity and health."""
    return all(ok(node, d) for ok in _CONSTRAINTS)


# -- stickiness -------------------------------------------------------------------------------


def _keep(
    current: Sequence[Assignment],
    wanted: Mapping[str, Deployment],
    by_id: Mapping[str, NodeSnapshot],
    health: _Health,
    usage: _Usage,
) -> tuple[list[Assignment], list[Assignment]]:
    """The replicas of `current` that stay, and those that move (the rules in the module)."""
    moved: list[Assignment] = []
    # (needs a GPU chosen, deployment order, on a stale node, node id): the sort is the policy.
    candidates: list[tuple[tuple[bool, int, str, bool, str], Assignment, Deployment, NodeSnapshot]]
    candidates = []
    for a in current:
        d, node = wanted.get(a.deployment_id), by_id.get(a.node_id)
        if d is None or node is None or not health.up(node) or node.draining:
            moved.append(a)  # deployment or node gone, node offline past the grace, draining
            continue
        if not _admits(node, d):
            moved.append(a)  # a constraint changed (the deployment's or the node's)
            continue
        pinned = not d.gpu or (a.gpu is not None and 0 <= a.gpu < len(node.gpus))
        sort = (not pinned, *d.order, not health.online(node), node.id)
        candidates.append((sort, a, d, node))
    candidates.sort(key=lambda c: c[0])

    kept: list[Assignment] = []
    count: Counter[str] = Counter()
    repin: list[tuple[Assignment, Deployment, NodeSnapshot]] = []

    def admit(d: Deployment, node: NodeSnapshot, pin: int | None) -> bool:
        """Keeps the replica when its deployment still wants it and it still fits."""
        gpu = usage.gpu_for(node, d, pin)
        if count[d.id] >= d.replicas or usage.free(node) < d.memory_mib or (d.gpu and gpu is None):
            return False
        kept.append(usage.take(node, d, gpu))
        count[d.id] += 1
        return True

    for (needs_gpu, *_), a, d, node in candidates:
        if not needs_gpu and admit(d, node, a.gpu):
            continue
        if d.gpu:
            # No GPU recorded, or its GPU is full (another replica grew): once every pinned
            # replica has its place, try the node's other GPUs rather than another node.
            repin.append((a, d, node))
        else:
            moved.append(a)
    repin.sort(key=lambda r: (*r[1].order, not health.online(r[2]), r[2].id))
    moved.extend(a for a, d, node in repin if not admit(d, node, None))
    return kept, moved


# -- new replicas ------------------------------------------------------------------------------


def _place_new(
    short: Sequence[Deployment],
    nodes: Iterable[NodeSnapshot],
    holders: Mapping[str, set[str]],
    health: _Health,
    usage: _Usage,
) -> list[Assignment]:
    """New replicas for the deployments in `short`, in placement order; `holders` grows."""
    index = _Index(nodes, health, usage)
    added: list[Assignment] = []
    for d in short:
        for node in index.best(d, d.replicas - len(holders[d.id]), holders[d.id]):
            before = usage.free(node)
            added.append(usage.take(node, d, usage.gpu_for(node, d, None)))
            holders[d.id].add(node.id)
            index.moved(node, before, usage.free(node))
    return added


_Key = tuple[int, str]  # (-free memory, node id): ascending is best first


class _Index:
    """The nodes that take new replicas, sorted best first per tenancy class and per
    (class, site), and listed per label, so a deployment never reads the whole fleet."""

    def __init__(self, nodes: Iterable[NodeSnapshot], health: _Health, usage: _Usage) -> None:
        self._usage = usage
        self._nodes: dict[str, NodeSnapshot] = {}
        self._by_class: dict[tuple[str | None, bool], list[_Key]] = {}
        self._by_site: dict[tuple[str | None, bool, str], list[_Key]] = {}
        self._by_label: dict[tuple[str, str], list[NodeSnapshot]] = {}
        for node in nodes:
            if not health.takes_new(node):
                continue
            self._nodes[node.id] = node
            key = (-usage.free(node), node.id)
            self._by_class.setdefault(node.tenancy, []).append(key)
            self._by_site.setdefault((*node.tenancy, node.site), []).append(key)
            for label in node.labels.items():
                self._by_label.setdefault(label, []).append(node)
        for keys in (*self._by_class.values(), *self._by_site.values()):
            keys.sort()

    def best(self, d: Deployment, need: int, holders: set[str]) -> list[NodeSnapshot]:
        """Up to `need` nodes for new replicas of `d`, best first, none in `holders`."""
        if d.sites:
            lists = [self._by_site.get((*d.tenancy, s), []) for s in dict.fromkeys(d.sites)]
        else:
            lists = [self._by_class.get(d.tenancy, [])]
        labelled = [self._by_label.get(label, []) for label in d.labels.items()]
        rarest = min(labelled, key=len, default=None)
        if rarest is not None and len(rarest) * _LABEL_SCAN_RATIO < sum(map(len, lists)):
            eligible = [
                (-self._usage.free(n), n.id)
                for n in rarest
                if n.id not in holders and _admits(n, d) and self._usage.fits(n, d)
            ]
            return [self._nodes[node_id] for _, node_id in heapq.nsmallest(need, eligible)]

        chosen: list[NodeSnapshot] = []
        ordered: Iterator[_Key] = iter(lists[0]) if len(lists) == 1 else heapq.merge(*lists)
        for neg_free, node_id in ordered:
            if -neg_free < d.memory_mib:
                break  # sorted: no node after this one has the memory either
            node = self._nodes[node_id]
            if node_id not in holders and _admits(node, d) and self._usage.fits(node, d):
                chosen.append(node)
                if len(chosen) == need:
                    break
        return chosen

    def moved(self, node: NodeSnapshot, before: int, after: int) -> None:
        """Re-sorts a node whose free memory changed from `before` to `after`."""
        for keys in (self._by_class[node.tenancy], self._by_site[(*node.tenancy, node.site)]):
            del keys[bisect_left(keys, (-before, node.id))]
            insort(keys, (-after, node.id))


# -- why replicas are missing --------------------------------------------------------------------


class _Reasons:
    """Explains shortfalls: the fleet grouped per tenancy class and site once, as placement
    indexes it, so each explanation reads only the nodes of its class."""

    def __init__(self, nodes: Iterable[NodeSnapshot], health: _Health, usage: _Usage) -> None:
        self._health = health
        self._usage = usage
        self._grouped: dict[tuple[str | None, bool], dict[str, list[NodeSnapshot]]] = {}
        for node in nodes:
            self._grouped.setdefault(node.tenancy, {}).setdefault(node.site, []).append(node)

    def why(self, d: Deployment, holders: set[str]) -> str:
        """One sentence naming the constraint that left fewer nodes than replicas.

        The constraints narrow the fleet in the order of the module's rules, and a node
        takes one replica at most: the first step that leaves fewer nodes than wanted is
        the reason; when even those nodes hold fewer replicas, the step that left exactly
        as many nodes as were placed says why."""
        placed = len(holders)
        sentence = f"{placed} of {d.replicas} replicas placed"
        first: int | None = None  # nodes left by the first step that left too few
        for step, (left, what) in enumerate(self._narrowing(d, holders)):
            if first is None and left < d.replicas:
                first = left
                subject = "node" if step == 0 else "matching node"
                if left:
                    sentence += f": only {left} {subject}{'s' if left > 1 else ''}"
                    sentence += f" {what(left)} (one replica per node)"
                else:
                    sentence += f": no {subject} {what(1)}"
            if first is not None and left <= placed:
                if left < first:
                    quantity = f"only {left}" if left else "none"
                    sentence += f", and {quantity} of them {what(left or 2)}"
                break
        return sentence + "."

    def _narrowing(
        self, d: Deployment, holders: set[str]
    ) -> Iterator[tuple[int, Callable[[int], str]]]:
        """(nodes left, what they have in common, worded for a count) after each step."""
        by_site = self._grouped.get(d.tenancy, {})
        yield sum(map(len, by_site.values())), _tenancy_text(d)
        sites = dict.fromkeys(d.sites) if d.sites else by_site
        left = [n for site in sites for n in by_site.get(site, ())]
        yield len(left), _worded("is", "in site " + " or ".join(d.sites))
        room = f"{d.memory_mib} MiB of memory" + (
            f" and a GPU with {d.gpu_memory_mib} MiB" if d.gpu else ""
        )
        labels = ", ".join(f"{k}={v}" for k, v in sorted(d.labels.items()))
        steps: list[tuple[Callable[[NodeSnapshot], bool], Callable[[int], str]]] = [
            (lambda n: _region_ok(n, d), _worded("is", "in region " + " or ".join(d.regions))),
            (lambda n: _labels_ok(n, d), _worded("has", "the labels " + labels)),
            (lambda n: _isolation_ok(n, d), _worded("runs", f"isolation {d.isolation}")),
            (
                lambda n: _gpu_ok(n, d),
                _worded("has", f"a GPU with {d.gpu_memory_mib} MiB or more"),
            ),
            (lambda n: _memory_ok(n, d), _worded("has", f"{d.memory_mib} MiB of memory or more")),
            (
                lambda n: n.id in holders or self._health.takes_new(n),
                _worded("is", "up, online and not draining"),
            ),
            (
                lambda n: n.id in holders or self._usage.fits(n, d),
                _worded("has", f"room for a replica ({room} free)"),
            ),
        ]
        for ok, what in steps:
            left = [n for n in left if ok(n)]
            yield len(left), what


def _worded(verb: str, rest: str) -> Callable[[int], str]:
    """`verb rest`, the verb agreeing with a count of nodes ("is"/"are", "has"/"have")."""
    plural = {"is": "are", "has": "have", "runs": "run"}[verb]
    return lambda count: f"{plural if count > 1 else verb} {rest}"


def _tenancy_text(d: Deployment) -> Callable[[int], str]:
    tenant, private = d.tenancy
    if private and tenant is not None:
        return _worded("is", f"private and dedicated to tenant {tenant}")
    if private:
        return _worded("is", "private (S4 runs only on private nodes)")
    if tenant is not None:
        return _worded("is", f"dedicated to tenant {tenant}")
    return _worded("is", "shared (neither private nor dedicated to a tenant)")
