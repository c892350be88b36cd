"""The alert rules, pure: what fires for a snapshot of the fleet. The hub's alert loop
(hub/alerting/loop.py) evaluates them on its store; hub/alerting/prometheus.py writes the
same rules, with the same thresholds, for a Prometheus that scrapes the hub.

Each rule fires per subject (its labels): a node (`node`, `site`), or a class's objective
over a pair of windows (`class`, `objective`, `window`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hub.planning.health import seen_within
from hub.state.alerts import Firing
from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence, Set

    from hub.alerting.settings import AlertsSettings
    from hub.settings import HubSettings
    from hub.state.certificates import IssuedCertificate

SLO_BURN = "slo_burn"
NODE_STALE = "node_stale"
NODE_OFFLINE = "node_offline"
OUTBOX_ALARM = "outbox_alarm"
WORKER_RESTARTS = "worker_restarts"
CERTIFICATE_EXPIRY = "certificate_expiry"
CERTIFICATE_RENEWAL = "certificate_renewal"
LEASE_LAPSED = "lease_lapsed"
BACKUP_OVERDUE = "backup_overdue"
NODE_RULES = (
    NODE_STALE,
    NODE_OFFLINE,
    OUTBOX_ALARM,
    CERTIFICATE_EXPIRY,
    CERTIFICATE_RENEWAL,
    LEASE_LAPSED,
)
RULES = (SLO_BURN, *NODE_RULES, WORKER_RESTARTS, BACKUP_OVERDUE)
# The labels of the hub's own backups' alert (a node's are its name and site).
OWN_BACKUP = {"hub": "this hub"}
# A value stored and sent is finite (a target of 1 burns without bound on one miss).
_MOST = 1e12

_UNITS = (("d", 86_400), ("h", 3600), ("m", 60), ("s", 1))


def duration(seconds: float) -> str:
    """A window as Prometheus writes one (`1h`, `5m`, `90s`): whole seconds, in the
    largest unit that divides them."""
    whole = max(1, round(seconds))
    for unit, size in _UNITS:
        if whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"  # pragma: no cover - seconds divide everything


@dataclass(frozen=True)
class BurnPair:
    """A multi-window burn-rate alert: the budget burns above `factor` times its
    sustainable rate over both windows."""

    long_s: float
    short_s: float
    factor: float
    severity: str

    @property
    def window(self) -> str:
        return f"{duration(self.long_s)}/{duration(self.short_s)}"


def burn_pairs(settings: AlertsSettings) -> list[BurnPair]:
    return [BurnPair(b.long_s, b.short_s, b.factor, b.severity) for b in settings.burn]


class BackupLike(Protocol):
    """Of scheduled backups, what `backup_overdue` judges (`protocol.BackupReport`)."""

    @property
    def overdue_at(self) -> float: ...
    @property
    def last_good_at(self) -> float | None: ...


class HeartbeatLike(Protocol):
    """The fields of a node's last heartbeat the node rules judge (`protocol.Capacity`)."""

    @property
    def backup(self) -> BackupLike | None: ...

    @property
    def outbox_alarm(self) -> bool: ...
    @property
    def outbox_lag(self) -> int: ...
    @property
    def leases_lapsed(self) -> int: ...
    @property
    def lease_failures(self) -> int: ...


class NodeLike(Protocol):
    """What the node rules read of a node: a `Node`, or the lighter `NodeHealth` the alert
    loop reads (hub/state/nodes.py)."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def site(self) -> str: ...
    @property
    def last_seen(self) -> float | None: ...
    @property
    def revoked(self) -> bool: ...
    @property
    def capacity(self) -> HeartbeatLike: ...


class SloTotalsLike(Protocol):
    """A class's totals over a window (hub/fleet/objectives.py `SloTotals`)."""

    @property
    def service_class(self) -> str: ...
    @property
    def met(self) -> Mapping[str, int]: ...
    @property
    def missed(self) -> Mapping[str, int]: ...


def burn_alerts(
    pairs: Sequence[BurnPair],
    totals: Mapping[float, Sequence[SloTotalsLike]],
    target: Callable[[str, str], float],
    burn_rate: Callable[[int, int, float], float],
) -> list[Firing]:
    """The burn-rate alerts: `totals` by window (seconds, each of the pairs' windows) by
    class; `target(class, objective)`; `burn_rate(missed, total, target)`."""
    fired: list[Firing] = []
    for pair in pairs:
        long = {t.service_class: t for t in totals.get(pair.long_s, ())}
        short = {t.service_class: t for t in totals.get(pair.short_s, ())}
        for cls in sorted(long.keys() & short.keys()):
            for objective in protocol.OBJECTIVES:
                share = target(cls, objective)
                rates = []
                for window in (long[cls], short[cls]):
                    missed = window.missed.get(objective, 0)
                    total = missed + window.met.get(objective, 0)
                    rates.append(burn_rate(missed, total, share))
                if min(rates) <= pair.factor:
                    continue
                fired.append(
                    Firing(
                        SLO_BURN,
                        {"class": cls, "objective": objective, "window": pair.window},
                        pair.severity,
                        min(rates[0], _MOST),
                        f"{cls} {objective}: the error budget burns {_times(rates[0])} its "
                        f"rate over {duration(pair.long_s)} and {_times(rates[1])} over "
                        f"{duration(pair.short_s)} (target {share:g}; fires above "
                        f"{pair.factor:g}x)",
                    )
                )
    return fired


def _times(rate: float) -> str:
    return "without bound" if math.isinf(rate) else f"{rate:.1f}x"


def node_alerts(
    now: float,
    nodes: Sequence[NodeLike],
    certificates: Mapping[str, IssuedCertificate],
    signing_ca: str | None,
    settings: HubSettings,
) -> list[Firing]:
    """Stale and offline nodes (of those ever heard from), outbox alarms, certificates
    near their end, nodes heard from whose newest certificate is a CA's that signs no
    more (`signing_ca`: the fingerprint of the one that does): each heartbeat answer tells
    such a node to renew; and nodes heard from that serve accounts without a live quota
    lease (protocol 5). Those two fire only once they have held `alerts.renew_grace_s` and
    `alerts.lease_grace_s` (the loop holds them: `held`)."""
    fleet, alerts = settings.fleet, settings.alerts
    fired: list[Firing] = []
    for node in nodes:
        if node.revoked:
            continue
        labels = {"node": node.name, "site": node.site}
        if node.last_seen is not None:
            age = now - node.last_seen
            if not seen_within(node.last_seen, now, fleet.offline_after_s):
                fired.append(
                    Firing(NODE_OFFLINE, labels, "page", age,
                           f"{node.name} ({node.site}): no heartbeat for {age:.0f} s")
                )  # fmt: skip
            elif not seen_within(node.last_seen, now, fleet.stale_after_s):
                fired.append(
                    Firing(NODE_STALE, labels, "ticket", age,
                           f"{node.name} ({node.site}): no heartbeat for {age:.0f} s")
                )  # fmt: skip
        heard = seen_within(node.last_seen, now, fleet.stale_after_s)
        lapsed, failures = node.capacity.leases_lapsed, node.capacity.lease_failures
        # Only while heard: a stale node's last word is old, and node_stale says more.
        if lapsed and heard:
            fired.append(
                Firing(LEASE_LAPSED, labels, "ticket", float(lapsed),
                       f"{node.name} ({node.site}): serves {_many(lapsed, 'account')} "
                       f"without a live quota lease ({_many(failures, 'lease call')} failed "
                       "in a row), on their class's safe capacity or refusing them")
            )  # fmt: skip
        if node.capacity.outbox_alarm:
            fired.append(
                Firing(OUTBOX_ALARM, labels, "ticket", 1.0,
                       f"{node.name} ({node.site}): its usage outbox raised its alarm "
                       f"({node.capacity.outbox_lag} events waiting for the hub)")
            )  # fmt: skip
        certificate = certificates.get(node.id)
        if certificate is None:
            continue
        left = certificate.not_after - now
        if left < alerts.certificate_expiry_s:
            fired.append(
                Firing(CERTIFICATE_EXPIRY, labels, "page", left,
                       f"{node.name} ({node.site}): its certificate "
                       + (f"expires in {left:.0f} s" if left > 0 else "has expired"))
            )  # fmt: skip
        if signing_ca is not None and certificate.ca != signing_ca and heard:
            fired.append(
                Firing(CERTIFICATE_RENEWAL, labels, "ticket", now - certificate.issued_at,
                       f"{node.name} ({node.site}): told to renew (its certificate is a CA's "
                       "that signs no more), and has not")
            )  # fmt: skip
    return fired


def _many(count: int, thing: str) -> str:
    return f"{count} {thing}" + ("" if count == 1 else "s")


def restart_alerts(
    restarts: Mapping[str, int], nodes: Sequence[NodeLike], settings: AlertsSettings
) -> list[Firing]:
    """Nodes whose model workers restarted more than `restarts` times in the window
    (`restarts`: by node id, over `restarts_window_s`)."""
    by_id = {n.id: n for n in nodes if not n.revoked}
    fired = []
    for node_id, count in sorted(restarts.items()):
        node = by_id.get(node_id)
        if node is None or count <= settings.restarts:
            continue
        fired.append(
            Firing(WORKER_RESTARTS, {"node": node.name, "site": node.site}, "page",
                   float(count),
                   f"{node.name} ({node.site}): model workers restarted {count} times in "
                   f"{duration(settings.restarts_window_s)}")
        )  # fmt: skip
    return fired


def backup_alerts(now: float, nodes: Sequence[NodeLike], own: BackupLike | None) -> list[Firing]:
    """Scheduled backups past when the run after the last good one should have ended: of
    each node whose last heartbeat reports a schedule (by the node's own clock, as it
    said when), and of the hub itself. A node that stopped sending heartbeats is judged on
    its last: its backups are as unknown as the rest of it, and node_stale says so too."""
    fired = []
    for node in nodes:
        report = node.capacity.backup
        if node.revoked or report is None or now <= report.overdue_at:
            continue
        fired.append(
            Firing(BACKUP_OVERDUE, {"node": node.name, "site": node.site}, "ticket",
                   now - report.overdue_at,
                   f"{node.name} ({node.site}): {_no_backup_since(report)}")
        )  # fmt: skip
    if own is not None and now > own.overdue_at:
        fired.append(
            Firing(BACKUP_OVERDUE, dict(OWN_BACKUP), "ticket", now - own.overdue_at,
                   f"the hub: {_no_backup_since(own)}")
        )  # fmt: skip
    return fired


def _no_backup_since(report: BackupLike) -> str:
    if report.last_good_at is None:
        return "no good backup yet, and its schedule's first run is over"
    taken = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(report.last_good_at))
    return f"no good backup since {taken}: its schedule's next run is over"


def held(settings: AlertsSettings) -> dict[str, float]:
    """Rules that fire only once their condition has held this long (seconds)."""
    return {CERTIFICATE_RENEWAL: settings.renew_grace_s, LEASE_LAPSED: settings.lease_grace_s}


Key = tuple[str, str]  # a firing's rule and labels (`Firing.key`)


def hold(
    firing: Sequence[Firing],
    already: Set[Key],
    holding: Mapping[Key, float],
    now: float,
    settings: AlertsSettings,
) -> tuple[list[Firing], dict[Key, float]]:
    """Of `firing`, those to record now: a held rule's once its condition has held long
    enough (`holding`: since when each has, as the last round left it) or while it fires
    already (`already`); any other rule's at once. With what to hold for the next round:
    a condition that stops holding starts its grace again."""
    grace = held(settings)
    kept, since_now = [], {}
    for fire in firing:
        wait = grace.get(fire.rule)
        if wait is None or fire.key in already:
            kept.append(fire)
            continue
        since = since_now[fire.key] = holding.get(fire.key, now)
        if now - since >= wait:
            kept.append(fire)
    return kept, since_now
