"""The fleet's objectives, as the rest of the hub reads them: what a heartbeat flush added
(`Ingested`: a `SloDelta` per node, class and account, and the nodes' worker restarts),
handed to `Heartbeats.objective_listeners` after each flush that added something; what a
window holds (`SloTotals`, from the store's `slo_totals`); and the TTFT quantiles of a
window's histograms. The records are the store's (hub/state/slo.py, where the counting
rules are), named here so that no one reaches into the store for them."""

from __future__ import annotations

from hub.state.slo import (
    GROUPINGS,
    OTHER_ACCOUNT,
    Grouping,
    Ingested,
    SloDelta,
    SloTotals,
    quantile,
)

__all__ = [
    "GROUPINGS",
    "OTHER_ACCOUNT",
    "Grouping",
    "Ingested",
    "SloDelta",
    "SloTotals",
    "quantile",
]
