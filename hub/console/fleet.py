"""The fleet page's rows: what the table shows of each node, filtered. Pure functions, so
the page and its live stream show the same thing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hub.views import node_view

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from hub.settings import HubSettings
    from hub.state.nodes import Node
    from shared.protocol import BackupReport

STATUSES = ("online", "stale", "offline", "revoked")
MAX_ROWS = 500  # a page of a large fleet; the filters narrow it


@dataclass(frozen=True)
class Filters:
    site: str = ""
    status: str = ""
    name: str = ""

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> Filters:
        status = query.get("status", "")
        return cls(
            site=query.get("site", "")[:100],
            status=status if status in STATUSES else "",
            name=query.get("name", "").strip()[:100],
        )

    def keep(self, row: Mapping[str, Any]) -> bool:
        return (
            (not self.site or row["site"] == self.site)
            and (not self.status or row["status"] == self.status)
            and (not self.name or self.name.lower() in row["name"].lower())
        )


def fleet_row(node: Node, settings: HubSettings, now: float) -> dict[str, Any]:
    """One node as the fleet table shows it (JSON values: the stream sends it as is)."""
    view = node_view(node, settings, now)
    capacity = node.capacity
    heard = node.last_seen is not None  # before its first heartbeat a node has no load
    return {
        "id": node.id,
        "name": node.name,
        "site": node.site,
        "status": view["status"],
        "draining": node.draining,
        "version": node.versions.get("kvl", "-"),
        "load": f"{capacity.cpu_percent:.0f} %" if heard else "-",
        "queue": str(capacity.queue_waiting) if heard else "-",
        "outbox_lag": str(capacity.outbox_lag) if heard else "-",
        "outbox_alarm": capacity.outbox_alarm,
        "last_seen": ago(node.last_seen, now),
        **backup_cells(capacity.backup, now),
    }


def backup_cells(report: BackupReport | None, now: float) -> dict[str, Any]:
    """The last good scheduled backup, as the fleet table and the alerts page show it:
    `-` without a schedule; `overdue` when the run after it should have ended."""
    if report is None:
        return {"backup": "-", "backup_overdue": False}
    last = ago(report.last_good_at, now) if report.last_good_at is not None else "none yet"
    return {"backup": last, "backup_overdue": now > report.overdue_at}


def fleet_table(
    nodes: Sequence[Node], settings: HubSettings, now: float, filters: Filters
) -> dict[str, Any]:
    """The table: the rows that pass the filters (at most MAX_ROWS), how many passed, and
    how many nodes of the whole fleet are in each status."""
    rows = [fleet_row(n, settings, now) for n in nodes]
    matched = [r for r in rows if filters.keep(r)]
    by_status = dict.fromkeys(STATUSES, 0)
    for row in rows:
        by_status[row["status"]] += 1
    return {"rows": matched[:MAX_ROWS], "matched": len(matched), "counts": by_status}


def ago(at: float | None, now: float) -> str:
    if at is None:
        return "never"
    seconds = max(0, int(now - at))
    if seconds < 120:
        return f"{seconds} s ago"
    if seconds < 7200:
        return f"{seconds // 60} min ago"
    if seconds < 172_800:
        return f"{seconds // 3600} h ago"
    return f"{seconds // 86_400} d ago"


def served_models(node: Node) -> list[str]:
    """The models the node's last heartbeat said it serves."""
    return list(node.capacity.models)


def placement_errors(node: Node) -> dict[str, str]:
    """Why the node could not load what was placed on it, by model (its last heartbeat)."""
    return dict(node.capacity.placement_errors)
