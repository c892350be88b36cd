"""The placement reconciler: the one place that does I/O around the placement planner.

Every `fleet.placement_every_s` it reads a snapshot (deployments, models, nodes with
their last heartbeats, the placements in force), asks the pure planner
(hub/planning/placement.py) where every replica should run, and writes the answer; when
that changed anything the desired state's serial moves, the nodes pull it with their
next heartbeat and converge (fetch the artifact, load it, report it in their heartbeats).

What a node offers the planner comes from its heartbeat and its labels: memory for
models (`model_memory_mib`, the node's model memory budget), GPUs, the isolation level it
can run replicas at (`isolation_max`), and the label `region`. Its tenancy (dedicated to
one tenant, class S3; on a tenant's private site, class S4) is the operator's, from its
row (hub/state/accounts.py), never from its labels.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from hub.models.inspect import deployment_mib
from hub.planning.placement import plan
from hub.planning.snapshots import Assignment, Deployment, Gpu, NodeSnapshot, Plan
from hub.state.nodes import capacity_of
from shared.classes import IsolationLevel

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hub.observability.metrics import HubMetrics
    from hub.settings import HubSettings
    from hub.state.deployments import DeploymentRecord, ModelArtifact
    from hub.state.store import AsyncHubStore, HubStore
    from shared import protocol
    from shared.supervise import Failures

log = logging.getLogger(__name__)


def _snapshot(
    node_id: str,
    site: str,
    labels: Mapping[str, str],
    capacity: protocol.Capacity,
    *,
    tenant: str | None,
    private: bool,
    last_seen: float | None,
    draining: bool,
    revoked: bool,
) -> NodeSnapshot:
    """A node as the planner sees it, from its last heartbeat's capacity (validated, so
    bounded, when it arrived; a row an older hub wrote reads as empty)."""
    labels = dict(labels)
    memory = capacity.model_memory_mib or int(capacity.memory_total_mib * 0.75)
    gpus = tuple(Gpu(g.name, g.memory_total_mib) for g in capacity.gpus)
    return NodeSnapshot(
        id=node_id,
        site=site,
        region=labels.get("region"),
        labels=labels,
        memory_mib=memory,
        gpus=gpus,
        last_seen=last_seen,
        draining=draining,
        revoked=revoked,
        tenant=tenant,
        private=private,
        isolation=IsolationLevel(capacity.isolation_max),
    )


class FleetSnapshots:
    """The fleet's nodes as the planner sees them, read every round but built again only
    for the nodes whose row changed since the last one (a heartbeat, a drain, a
    revocation). Between two rounds a few seconds apart most of the fleet has not called:
    building all 10,000 nodes each round held the interpreter for 0.25 s (0.4 s under
    load), which the node calls then waited for; now 57 ms with a fifth of them changed.
    Used on the reading connection's thread only."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[Any, ...], NodeSnapshot]] = {}

    def read(self, store: HubStore) -> list[NodeSnapshot]:
        known, kept = self._known, {}
        nodes = []
        for row in store.nodes.snapshot_rows():  # hub.state.nodes.SNAPSHOT_COLUMNS
            node_id, site, labels, capacity, last_seen, draining, revoked_at, tenant, private = row
            was = known.get(node_id)
            if was is not None and was[0] == row:
                snapshot = was[1]
            else:
                snapshot = _snapshot(
                    node_id, site, json.loads(labels or "{}"), capacity_of(capacity),
                    tenant=tenant or None, private=bool(private), last_seen=last_seen,
                    draining=bool(draining), revoked=revoked_at is not None,
                )  # fmt: skip
            kept[node_id] = (row, snapshot)
            nodes.append(snapshot)
        self._known = kept
        return nodes


def deployment_of(record: DeploymentRecord, models: dict[str, ModelArtifact]) -> Deployment:
    c: dict[str, Any] = dict(record.constraints)
    name, _, version = record.model.partition("@")
    model = models.get(record.model)
    memory = deployment_mib(model, record.preset) if model is not None else 0
    gpu = bool(c.get("gpu"))
    return Deployment(
        id=record.id,
        model=name,
        version=version,
        replicas=record.replicas,
        service_class=record.service_class,
        memory_mib=memory,
        gpu=gpu,
        # A replica on a GPU holds its weights and KV cache there: the operator's figure,
        # else what the model takes at the deployment's context and slots.
        gpu_memory_mib=int(c.get("gpu_memory_mib") or 0) or (memory if gpu else 0),
        sites=tuple(c.get("sites") or ()),
        regions=tuple(c.get("regions") or ()),
        labels=dict(c.get("labels") or {}),
        tenant=c.get("tenant"),
        isolation=IsolationLevel(record.isolation),
    )


def plan_once(
    store: HubStore, settings: HubSettings, now: float, fleet: FleetSnapshots | None = None
) -> Plan:
    """The plan for a snapshot of the fleet (reads only); `fleet` keeps the nodes built
    in earlier rounds."""
    models = {m.ref: m for m in store.deployments.models()}
    deployments = [deployment_of(r, models) for r in store.deployments.all()]
    current = [Assignment(d, n, g) for d, n, g in store.deployments.placements()]
    # Nothing deployed nor placed: the plan is empty whatever the fleet, so its nodes
    # (thousands of rows) are not read.
    nodes = (fleet or FleetSnapshots()).read(store) if deployments or current else []
    return plan(
        deployments,
        nodes,
        current,
        now=now,
        stale_after_s=settings.fleet.stale_after_s,
        offline_grace_s=settings.fleet.offline_grace_s,
    )


def apply_plan(store: HubStore, decided: Plan) -> bool:
    """Make the placements the plan's; whether that changed any."""
    return store.deployments.apply_placements(
        (a.deployment_id, a.node_id, a.gpu) for a in decided.assignments
    )


class _Reconciler:
    """One placement round at a time; what it keeps between rounds: the fleet's node
    snapshots and the unplaced deployments it last warned about."""

    def __init__(
        self,
        store: AsyncHubStore,
        settings: HubSettings,
        failures: Failures,
        metrics: HubMetrics | None = None,
    ) -> None:
        self._metrics = metrics
        self._store = store
        self._settings = settings
        self._failures = failures
        self._fleet = FleetSnapshots()
        self._unplaced: dict[str, str] = {}

    async def round(self) -> None:
        started = time.perf_counter()
        try:
            await self._round()
        finally:
            if self._metrics is not None:
                self._metrics.reconcile_seconds.observe(time.perf_counter() - started)

    async def _round(self) -> None:
        store = self._store
        try:
            # The snapshot (every node) is read and planned beside the writer, which then
            # only applies the answer.
            started = time.perf_counter()
            decided = await store.read(
                plan_once, store.reader, self._settings, time.time(), self._fleet
            )
            if self._metrics is not None:
                self._metrics.placement_seconds.observe(time.perf_counter() - started)
        except ValueError as err:  # the planner refuses inputs it cannot plan
            # The operator's deployments, not the hub, are at fault: no traceback, but
            # counted, so the operator API shows why nothing moves.
            log.error("placement cannot plan the deployments as they are: %s", err)  # noqa: TRY400
            self._failures.record("placement", err)
            return
        changed = await store.run(apply_plan, store.sync, decided)
        if changed:
            log.info(
                "placements changed: %d replicas placed, %d moved",
                len(decided.assignments),
                len(decided.moved),
            )
        if dict(decided.unplaced) != self._unplaced:
            self._unplaced = dict(decided.unplaced)
            for deployment, why in self._unplaced.items():
                log.warning("deployment %s is short of replicas: %s", deployment, why)


async def reconcile_forever(
    store: AsyncHubStore,
    settings: HubSettings,
    failures: Failures,
    metrics: HubMetrics | None = None,
) -> None:
    """Every `fleet.placement_every_s`, one round, the first at once; a round that raises
    (a database error, a bug) is logged and counted in `failures`, and the next runs.
    `metrics`: where each round's time and the planner's are observed."""
    reconciler = _Reconciler(store, settings, failures, metrics)
    await failures.forever(
        "placement", reconciler.round, settings.fleet.placement_every_s, wait_first=False
    )
