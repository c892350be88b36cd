"""Service classes S0-S4 (docs/api.md, "Service classes"): every account has one. Isolation
levels I1-I3 (docs/hub.md, "Tenancy and isolation"): every deployment states one."""

from enum import StrEnum


class ServiceClass(StrEnum):
    S0 = "S0"
    S1 = "S1"
    S2 = "S2"
    S3 = "S3"
    S4 = "S4"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]

    @property
    def priority(self) -> int:
        """Batch-slot priority on an appliance: S2 first, S0 last. S3 and S4 are placement
        decisions of the hub (a dedicated node, a private site); on their node they run as
        standard work."""
        return _PRIORITIES[self]


_DESCRIPTIONS = {
    ServiceClass.S0: "shared: best effort, preemptible",
    ServiceClass.S1: "standard: admission-controlled, quota per account",
    ServiceClass.S2: "reserved: guaranteed slots, never preempted by S0/S1",
    ServiceClass.S3: "dedicated: a whole node for one tenant",
    ServiceClass.S4: "private: a private site, hub optional",
}

DEFAULT_CLASS = ServiceClass.S1

_PRIORITIES = {
    ServiceClass.S0: 0,
    ServiceClass.S1: 1,
    ServiceClass.S2: 2,
    ServiceClass.S3: 1,
    ServiceClass.S4: 1,
}


class IsolationLevel(StrEnum):
    """How far a model replica is kept from everything else on its node; each level holds
    the ones below it.

    - I1: its own worker process (every replica).
    - I2: I1, in a cgroup v2 of its own with `memory.max` and `cpu.max` set, where the
      node can make one (a cgroup v2 hierarchy with the memory and cpu controllers,
      writable by the appliance).
    - I3: I2, on a node dedicated to the deployment's tenant (label `tenant=T`): no other
      tenant's work or keys on that machine.
    """

    I1 = "I1"
    I2 = "I2"
    I3 = "I3"

    @property
    def rank(self) -> int:
        """1, 2 or 3: a node that runs a level runs every lower one."""
        return int(self.value[1])
