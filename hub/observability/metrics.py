"""The hub's Prometheus metrics, on a registry per application (never the global one):
its HTTP routes, its background work (heartbeat flushes, the ledger, placement, the
store), and the fleet's objectives as the nodes' heartbeats report them.

The fleet's counters (`kvl_fleet_*_total`) are fed by a heartbeat listener (`objectives`,
in `Heartbeats.objective_listeners`) with what each flush added; the per-node gauges and
the nodes by status are set from the store just before each scrape
(hub/observability/fleet.py).
Nothing here imports the rest of the hub: every part that observes is handed this."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from shared import __version__, protocol
from shared.supervise import Failures

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# The objectives' bounds (shared/protocol.py): up to an hour, S0's longest objective, so
# no request of any class lands in +Inf; and the hub's own quick calls below them.
LATENCY_BUCKETS = tuple(sorted({0.001, 0.0025, 0.005, 0.01, 0.025, *protocol.LATENCY_BOUNDS_S}))
_BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000)


class SloDelta(Protocol):
    """What a heartbeat added for one (class, account) on one node (hub/fleet/objectives.py
    `SloDelta`): the attributes read here."""

    @property
    def service_class(self) -> str: ...
    @property
    def admitted(self) -> int: ...
    @property
    def refused(self) -> Mapping[str, int]: ...
    @property
    def met(self) -> Mapping[str, int]: ...
    @property
    def missed(self) -> Mapping[str, int]: ...


class Ingested(Protocol):
    """What one heartbeat flush added (hub/fleet/objectives.py `Ingested`)."""

    @property
    def series(self) -> Sequence[SloDelta]: ...
    @property
    def worker_restarts(self) -> Sequence[tuple[str, str, str, int]]: ...


class HubMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvl_hub_http_requests",
            "HTTP requests by route (its pattern), method and status code.",
            ["route", "method", "code"],
            registry=r,
        )
        self.errors = Counter(
            "kvl_hub_http_errors",
            "Error responses by route and error code (shared/errors.py).",
            ["route", "code"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvl_hub_http_request_duration_seconds",
            "Time from request to response, by route (an offload's: until its stream ends).",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.flush_lag = Histogram(
            "kvl_hub_heartbeat_flush_lag_seconds",
            "Age of the oldest heartbeat a flush wrote: how far `last_seen` trails.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.flush_batch = Histogram(
            "kvl_hub_heartbeat_flush_batch",
            "Heartbeats written per flush (one per node heard since the last).",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.ledger_events = Counter(
            "kvl_hub_ledger_events",
            "Events the nodes synced into the ledger, by kind and outcome (new, or a "
            "duplicate: a resend, stored once).",
            ["kind", "outcome"],
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            "kvl_hub_reconcile_duration_seconds",
            "Time of one placement reconciler round (snapshot, plan, apply).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.placement_seconds = Histogram(
            "kvl_hub_placement_duration_seconds",
            "Time the placement planner took over a snapshot of the fleet.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.nodes = Gauge(
            "kvl_hub_nodes",
            "Nodes by status (online, stale, offline, revoked), at the scrape.",
            ["status"],
            registry=r,
        )
        self.background_failures = Counter(
            "kvl_hub_background_failures",
            "Exceptions a background loop survived (logged with their traceback; the loop "
            "went on with its next round), by loop.",
            ["loop"],
            registry=r,
        )
        self.artifact_bytes = Counter(
            "kvl_hub_artifact_bytes",
            "Bytes of model files, packages and release bundles the hub sent its nodes, by "
            "site: what each site's link to the hub carried of them.",
            ["site"],
            registry=r,
        )
        self.db_seconds = Histogram(
            "kvl_hub_db_duration_seconds",
            "Time of a store call on its thread, waiting included, by operation (the "
            "store function's name).",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.build = Info("kvl_hub_build", "The hub's version and node protocol.", registry=r)
        self.build.info({"version": __version__, "protocol": str(protocol.PROTOCOL_VERSION)})
        self.fleet_requests = Counter(
            "kvl_fleet_requests",
            "Requests that reached admission on the fleet's nodes, by class and outcome "
            "(admitted, or the refusal's reason), from their heartbeats.",
            ["class", "outcome"],
            registry=r,
        )
        self.slo_events = Counter(
            "kvl_fleet_slo_events",
            "Requests measured against an objective of their class, by class, objective "
            "(admit, first_token, complete) and outcome (met, missed), from heartbeats.",
            ["class", "objective", "outcome"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "kvl_fleet_worker_restarts",
            "Model worker restarts the nodes reported, by node and site.",
            ["node", "site"],
            registry=r,
        )
        self.node_last_seen = Gauge(
            "kvl_fleet_node_last_seen_timestamp_seconds",
            "When each node's last heartbeat arrived (unix seconds; nodes never heard "
            "from and revoked ones are not listed).",
            ["node", "site"],
            registry=r,
        )
        self.node_outbox_alarm = Gauge(
            "kvl_fleet_node_outbox_alarm",
            "1 while a node's last heartbeat raised its outbox alarm (usage waiting too long "
            "for the hub), else 0.",
            ["node", "site"],
            registry=r,
        )
        self.node_leases_lapsed = Gauge(
            "kvl_fleet_node_leases_lapsed",
            "Accounts a node's last heartbeat said it serves without a live quota lease (its "
            "lease calls fail: on their class's safe capacity, or refused); 0 when none.",
            ["node", "site"],
            registry=r,
        )
        self.node_certificate_expiry = Gauge(
            "kvl_fleet_node_certificate_expiry_timestamp_seconds",
            "When each node's newest certificate expires (unix seconds).",
            ["node", "site"],
            registry=r,
        )
        self.node_backup_last_good = Gauge(
            "kvl_fleet_node_backup_last_good_timestamp_seconds",
            "When each node's newest scheduled backup was taken (unix seconds; nodes "
            "without a schedule, or with no backup yet, are not listed).",
            ["node", "site"],
            registry=r,
        )
        self.node_backup_overdue = Gauge(
            "kvl_fleet_node_backup_overdue_timestamp_seconds",
            "When each node's scheduled backup is overdue: the run after its last good one "
            "should have ended (unix seconds; nodes without a schedule are not listed).",
            ["node", "site"],
            registry=r,
        )
        self.hub_backup_last_good = Gauge(
            "kvl_hub_backup_last_good_timestamp_seconds",
            "When the hub's newest scheduled backup was taken (unix seconds; not listed "
            "without a schedule, or with no backup yet).",
            ["hub"],
            registry=r,
        )
        self.hub_backup_overdue = Gauge(
            "kvl_hub_backup_overdue_timestamp_seconds",
            "When the hub's scheduled backup is overdue (unix seconds; not listed without "
            "a schedule).",
            ["hub"],
            registry=r,
        )
        # The application's one record of its loops' failures, counted above.
        self.failures = Failures(self.background_failures)

    # -- what the hub's parts call ---------------------------------------------------------

    def timed_call(self, operation: str, seconds: float) -> None:
        """A store call's time (hub/state/store.py)."""
        self.db_seconds.labels(operation).observe(seconds)

    def flushed(self, arrivals: Sequence[float], now: float | None = None) -> None:
        """A heartbeat flush wrote heartbeats that arrived at `arrivals`."""
        if not arrivals:
            return
        at = time.time() if now is None else now
        self.flush_lag.observe(max(0.0, at - min(arrivals)))
        self.flush_batch.observe(len(arrivals))

    def ledger(self, kinds: Mapping[str, int], new: Mapping[str, int]) -> None:
        """A batch of `kinds` (events by kind), of which `new` were new."""
        for kind, count in kinds.items():
            fresh = new.get(kind, 0)
            if fresh:
                self.ledger_events.labels(kind, "new").inc(fresh)
            if count > fresh:
                self.ledger_events.labels(kind, "duplicate").inc(count - fresh)

    def objectives(self, ingested: Ingested) -> None:
        """What a heartbeat flush added to the fleet's objectives (an entry of
        `Heartbeats.objective_listeners`)."""
        for delta in ingested.series:
            cls = delta.service_class
            if delta.admitted:
                self.fleet_requests.labels(cls, "admitted").inc(delta.admitted)
            for reason, count in delta.refused.items():
                if count:
                    self.fleet_requests.labels(cls, reason).inc(count)
            for outcome, counts in (("met", delta.met), ("missed", delta.missed)):
                for objective, count in counts.items():
                    if count:
                        self.slo_events.labels(cls, objective, outcome).inc(count)
        for _node_id, node, site, restarts in ingested.worker_restarts:
            if restarts:
                self.worker_restarts.labels(node, site).inc(restarts)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition body and its content type: OpenMetrics unless only the classic
        Prometheus text format is acceptable to the scraper."""
        if "application/openmetrics-text" in accept or "text/plain" not in accept:
            return generate_openmetrics(self.registry), OPENMETRICS_CONTENT_TYPE  # type: ignore[no-untyped-call]
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
