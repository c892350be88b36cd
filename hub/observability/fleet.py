"""The fleet's gauges, set from the store just before each scrape: nodes by status, and
each node's last heartbeat, outbox alarm, lapsed leases, certificate expiry and scheduled
backups (and the hub's own). Two reads
beside the writer (every node's row, each node's newest certificate), so a scrape never
waits on the fleet's heartbeats and events."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from hub.alerting.rules import OWN_BACKUP
from hub.planning.health import NodeStatus, status_of

if TYPE_CHECKING:
    from hub.observability.metrics import HubMetrics
    from hub.settings import HubSettings
    from hub.state.store import AsyncHubStore
    from shared.protocol import BackupReport


async def refresh(
    metrics: HubMetrics,
    store: AsyncHubStore,
    settings: HubSettings,
    now: float | None = None,
    own_backup: BackupReport | None = None,
) -> None:
    at = time.time() if now is None else now
    nodes = await store.nodes()
    certificates = await store.read(store.reader.certificates.newest)
    fleet = settings.fleet
    statuses: Counter[str] = Counter({s.value: 0 for s in NodeStatus})
    # Cleared first: a node revoked (or renamed) since the last scrape leaves no series.
    for gauge in (
        metrics.node_last_seen,
        metrics.node_outbox_alarm,
        metrics.node_leases_lapsed,
        metrics.node_certificate_expiry,
        metrics.node_backup_last_good,
        metrics.node_backup_overdue,
        metrics.hub_backup_last_good,
        metrics.hub_backup_overdue,
    ):
        gauge.clear()
    if own_backup is not None:
        hub = OWN_BACKUP["hub"]
        metrics.hub_backup_overdue.labels(hub).set(own_backup.overdue_at)
        if own_backup.last_good_at is not None:
            metrics.hub_backup_last_good.labels(hub).set(own_backup.last_good_at)
    for node in nodes:
        status = status_of(node, fleet, at)
        statuses[status.value] += 1
        if node.revoked:
            continue
        labels = (node.name, node.site)
        if node.last_seen is not None:
            metrics.node_last_seen.labels(*labels).set(node.last_seen)
        metrics.node_outbox_alarm.labels(*labels).set(1 if node.capacity.outbox_alarm else 0)
        metrics.node_leases_lapsed.labels(*labels).set(node.capacity.leases_lapsed)
        if (backup := node.capacity.backup) is not None:
            metrics.node_backup_overdue.labels(*labels).set(backup.overdue_at)
            if backup.last_good_at is not None:
                metrics.node_backup_last_good.labels(*labels).set(backup.last_good_at)
        if (certificate := certificates.get(node.id)) is not None:
            metrics.node_certificate_expiry.labels(*labels).set(certificate.not_after)
    for name, count in statuses.items():
        metrics.nodes.labels(name).set(count)
