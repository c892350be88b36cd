"""The fleet's objectives as the operator API, the CLI and the console show them: the
report of a window (`report_view`: each class's objectives per group against their
targets, budget left, burn rate) and its time series (`series_view`: the points of the
charts), read from the store's buckets (hub/state/objectives.py) and judged by the pure
rules of hub/planning/slo.py and hub/fleet/budgets.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hub.fleet import budgets
from hub.planning.slo import histogram, quantile, totals_of
from shared import protocol

if TYPE_CHECKING:
    from hub.planning.slo import Grouping
    from hub.settings import ObjectivesSettings
    from hub.state.objectives import SloFilters
    from hub.state.store import HubStore

POINTS = 24  # a chart's points over its window, unless a step is asked for


def report_view(
    store: HubStore,
    settings: ObjectivesSettings,
    *,
    window: str,
    by: Grouping,
    filters: SloFilters,
    now: float,
) -> dict[str, Any]:
    """A window's report, as JSON: each (class, objective, group) row of `budgets.report`
    (the budget left over the budget period, the burn rate over the window), and each
    group's requests by outcome."""
    [report] = reports_view(store, settings, windows=[window], by=by, filters=filters, now=now)
    return report


def reports_view(
    store: HubStore,
    settings: ObjectivesSettings,
    *,
    windows: list[str],
    by: Grouping,
    filters: SloFilters,
    now: float,
) -> list[dict[str, Any]]:
    """`report_view` of each window, the budget period's sums read once for all."""
    period_s = settings.budget_period_s
    period = store.objectives.totals(now - period_s, now, by, filters)
    reports = []
    for window in windows:
        length = budgets.window_s(window)
        totals = (
            period
            if length == period_s
            else store.objectives.totals(now - length, now, by, filters)
        )
        rows = budgets.report(totals, settings.target, period)
        reports.append(
            {
                "window": window,
                "since": now - length,
                "until": now,
                "by": by,
                "budget_period": settings.budget_period,
                "data": [r.view() for r in rows],
                "requests": [
                    {"service_class": t.service_class, "group": t.group, "requests": t.requests,
                     "admitted": t.admitted, "refused": t.refused}
                    for t in totals
                ],
            }
        )  # fmt: skip
    return reports


def series_view(
    store: HubStore,
    settings: ObjectivesSettings,
    *,
    window: str,
    step_s: float | None,
    filters: SloFilters,
    now: float,
) -> dict[str, Any]:
    """A window's points per class, oldest first: requests, each objective's attainment
    and burn rate, and the TTFT's median and 95th percentile (from the histograms)."""
    length = budgets.window_s(window)
    since = now - length
    step, points = store.objectives.series(since, now, step_s or length / POINTS, filters)
    data = []
    for point in points:
        t = totals_of(point.service_class, "", point.counters)
        ttft = histogram(point.counters, "ttft")
        data.append(
            {
                "start": point.start,
                "service_class": t.service_class,
                "requests": t.requests,
                "admitted": t.admitted,
                "attainment": {
                    o: budgets.attainment(t.met[o], t.missed[o]) for o in protocol.OBJECTIVES
                },
                "burn_rate": {
                    o: budgets.burn_rate(
                        t.missed[o], t.met[o] + t.missed[o], settings.target(t.service_class, o)
                    )
                    for o in protocol.OBJECTIVES
                },
                "ttft_p50_s": quantile(ttft, 0.5),
                "ttft_p95_s": quantile(ttft, 0.95),
            }
        )
    return {"window": window, "since": since, "until": now, "step_s": step, "data": data}
