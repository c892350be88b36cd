"""The alert loop: every `alerts.every_s`, the rules (hub/alerting/rules.py) evaluated on
a snapshot of the fleet, and what changed recorded (hub/state/alerts.py) with its webhook
deliveries in one transaction. Each group of inputs is read under its own guard: one that
fails (logged, counted under `alerts.<part>`) leaves its rules' alerts as they were, the
other rules are evaluated all the same."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from hub.alerting import rules
from hub.fleet.budgets import burn_rate
from hub.loops import running
from hub.state.alerts import labels_text
from hub.state.nodes import HEALTH_CHUNK

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from hub.loops import Running
    from hub.settings import HubSettings
    from hub.state.alerts import AlertRecord, Firing
    from hub.state.nodes import NodeHealth
    from hub.state.store import AsyncHubStore
    from shared.protocol import BackupReport
    from shared.supervise import Failures

log = logging.getLogger(__name__)
LOOP = "alerts"


class Evaluator:
    """One evaluation at a time; what it keeps between them: since when each held rule's
    condition has held (`rules.held`)."""

    def __init__(
        self,
        store: AsyncHubStore,
        settings: HubSettings,
        failures: Failures,
        *,
        signing_ca: Callable[[], str | None],
        changed: Callable[[], None] = lambda: None,
        own_backup: Callable[[], BackupReport | None] = lambda: None,
    ) -> None:
        self._store = store
        self._settings = settings
        self._failures = failures
        self._signing_ca = signing_ca
        self._changed = changed
        self._own_backup = own_backup
        self._holding: dict[tuple[str, str], float] = {}

    async def round(self) -> list[tuple[AlertRecord, str]]:
        store, settings = self._store, self._settings
        alerts = settings.alerts
        now = time.time()
        firing: list[Firing] = []
        evaluated: set[str] = set()
        nodes = await fleet_health(store)
        with self._failures.guard(f"{LOOP}.nodes"):
            certificates = await store.read(store.reader.certificates.newest)
            firing += rules.node_alerts(now, nodes, certificates, self._signing_ca(), settings)
            evaluated.update(rules.NODE_RULES)
        with self._failures.guard(f"{LOOP}.backups"):
            own = await asyncio.to_thread(self._own_backup)
            firing += rules.backup_alerts(now, nodes, own)
            evaluated.add(rules.BACKUP_OVERDUE)
        with self._failures.guard(f"{LOOP}.restarts"):
            since = now - alerts.restarts_window_s
            restarts = await store.read(store.reader.objectives.worker_restarts_since, since)
            firing += rules.restart_alerts(restarts, nodes, alerts)
            evaluated.add(rules.WORKER_RESTARTS)
        with self._failures.guard(f"{LOOP}.objectives"):
            pairs = rules.burn_pairs(alerts)
            windows = sorted({w for p in pairs for w in (p.long_s, p.short_s)})
            totals = {
                w: await store.read(store.reader.objectives.totals, now - w, now, "class")
                for w in windows
            }
            firing += rules.burn_alerts(pairs, totals, settings.objectives.target, burn_rate)
            evaluated.add(rules.SLO_BURN)
        already = {
            (a.rule, labels_text(a.labels))
            for a in await store.read(store.reader.alerts.all, "firing")
        }
        firing = self._hold(firing, already, now)
        urls = [w.url for w in alerts.webhooks]
        changes = await store.run(store.sync.alerts.record, firing, sorted(evaluated), urls)
        for alert, event in changes:
            log.warning(
                "alert %s %s %s: %s%s",
                alert.rule,
                labels_text(alert.labels),
                event,
                alert.summary,
                " (silenced)" if alert.silenced else "",
            )
        if changes:
            self._changed()
        return changes

    def _hold(
        self, firing: list[Firing], already: set[tuple[str, str]], now: float
    ) -> list[Firing]:
        """Held rules' firings once they have held long enough (or fire already)."""
        kept, self._holding = rules.hold(firing, already, self._holding, now, self._settings.alerts)
        return kept


async def fleet_health(store: AsyncHubStore) -> list[NodeHealth]:
    """Every node's health, read a chunk at a time beside the writer: the node calls run
    between the chunks."""
    nodes: list[NodeHealth] = []
    while True:
        chunk = await store.read(store.reader.nodes.health, nodes[-1].id if nodes else "")
        nodes += chunk
        if len(chunk) < HEALTH_CHUNK:
            return nodes


@contextlib.asynccontextmanager
async def evaluating(
    evaluator: Evaluator, every_s: float, failures: Failures, tasks: Running
) -> AsyncIterator[None]:
    """The alert loop, while the context lasts; the first round at once."""
    loop = failures.forever(LOOP, evaluator.round, every_s, wait_first=False)
    async with running(tasks, LOOP, loop):
        yield
