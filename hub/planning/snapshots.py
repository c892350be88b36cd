"""What the placement planner (hub/planning/placement.py) plans over and answers: immutable
snapshots of the fleet's nodes and deployments, and the plan. Each validates itself when
built (`ValueError`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from shared.classes import IsolationLevel, ServiceClass

if TYPE_CHECKING:
    from collections.abc import Mapping

# Reserved classes first: a dedicated or private node is useless to anyone else, and S2
# is promised its capacity before the shared classes take theirs.
_CLASS_ORDER: Mapping[str, int] = {
    ServiceClass.S4: 0,
    ServiceClass.S3: 1,
    ServiceClass.S2: 2,
    ServiceClass.S1: 3,
    ServiceClass.S0: 4,
}


def _frozen(mapping: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, slots=True)
class Gpu:
    """One accelerator of a node; the replicas pinned to it share its memory."""

    name: str
    memory_mib: int


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """What the hub knows of one appliance node at planning time."""

    id: str
    site: str
    region: str | None
    labels: Mapping[str, str] = field(hash=False)  # a read-only copy, so not hashed
    memory_mib: int  # what the node can give to models in total
    gpus: tuple[Gpu, ...]
    last_seen: float | None  # unix seconds of its last heartbeat; None: never
    draining: bool = False  # nothing new, and its replicas move away
    revoked: bool = False  # never eligible
    tenant: str | None = None  # dedicated to this tenant (S3)
    private: bool = False  # on a tenant's private site (S4)
    # The highest level it reports it can run a replica at (its heartbeat's
    # `isolation_max`; I3 counts as I2: dedication is the hub's to know, from `tenant`).
    isolation: IsolationLevel = IsolationLevel.I1

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _frozen(self.labels))
        object.__setattr__(self, "isolation", IsolationLevel(self.isolation))
        if self.memory_mib < 0:
            raise ValueError(f"node {self.id}: memory_mib must be >= 0, not {self.memory_mib}")

    def runs(self, level: IsolationLevel) -> bool:
        """Whether a replica of a deployment at `level` may run here: I2 needs a node that
        can confine a worker in a cgroup; I3 that too, on a node dedicated to a tenant
        (that it is the deployment's own, tenancy checks)."""
        if level == IsolationLevel.I1:
            return True
        return self.isolation.rank >= IsolationLevel.I2.rank and (
            level == IsolationLevel.I2 or self.tenant is not None
        )

    @property
    def tenancy(self) -> tuple[str | None, bool]:
        """The class of deployments the node accepts: (tenant, private)."""
        return (self.tenant, self.private)


@dataclass(frozen=True, slots=True)
class Deployment:
    """A model the fleet should serve, with how many replicas and where they may run."""

    id: str
    model: str
    version: str
    replicas: int  # fleet-wide replicas wanted
    service_class: str  # "S0".."S4"
    memory_mib: int  # one replica: weights, KV cache and worker
    gpu: bool = False  # needs a GPU with gpu_memory_mib free
    gpu_memory_mib: int = 0
    sites: tuple[str, ...] = ()  # empty: any site
    regions: tuple[str, ...] = ()  # empty: any region
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)  # all must match
    tenant: str | None = None  # only nodes dedicated to this tenant
    # I1: its own worker process; I2: and a cgroup with limits; I3: I2 on a node
    # dedicated to its tenant (shared.classes.IsolationLevel).
    isolation: IsolationLevel = IsolationLevel.I1

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _frozen(self.labels))
        try:
            object.__setattr__(self, "isolation", IsolationLevel(self.isolation))
        except ValueError:
            raise ValueError(
                f"deployment {self.id}: unknown isolation level {self.isolation!r} (I1 to I3)"
            ) from None
        problems = [
            f"{name} must be >= 0, not {value}"
            for name, value in (
                ("replicas", self.replicas),
                ("memory_mib", self.memory_mib),
                ("gpu_memory_mib", self.gpu_memory_mib),
            )
            if value < 0
        ]
        if self.service_class not in _CLASS_ORDER:
            problems.append(f"unknown service class {self.service_class!r} (S0 to S4)")
        elif self.service_class == ServiceClass.S3 and self.tenant is None:
            problems.append("an S3 (dedicated) deployment needs a tenant")
        if self.isolation == IsolationLevel.I3 and self.tenant is None:
            problems.append("an I3 deployment needs a tenant (it runs on its nodes only)")
        if problems:
            raise ValueError(f"deployment {self.id}: " + "; ".join(problems))

    @property
    def tenancy(self) -> tuple[str | None, bool]:
        """The nodes it may use: those whose `NodeSnapshot.tenancy` equals this."""
        return (self.tenant, self.service_class == ServiceClass.S4)

    @property
    def order(self) -> tuple[int, str]:
        """Placement order: reserved classes first, then by id."""
        return (_CLASS_ORDER[self.service_class], self.id)


@dataclass(frozen=True, slots=True)
class Assignment:
    """One replica of a deployment on a node (and on one of its GPUs, for GPU work)."""

    deployment_id: str
    node_id: str
    gpu: int | None = None  # index into the node's gpus; None for a CPU-only deployment

    @property
    def key(self) -> tuple[str, str]:
        """What identifies a replica: at most one per deployment and node."""
        return (self.deployment_id, self.node_id)


@dataclass(frozen=True, slots=True)
class Plan:
    """Where every replica should run, what is missing and why, and what had to move."""

    assignments: tuple[Assignment, ...]  # sorted by deployment, then node
    unplaced: Mapping[str, str] = field(hash=False)  # deployment id -> why replicas are missing
    # Replicas of `current` that leave their node, sorted like `assignments`. A replica
    # that stays on its node but is re-pinned to another GPU is in `assignments` only.
    moved: tuple[Assignment, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "unplaced", _frozen(self.unplaced))
