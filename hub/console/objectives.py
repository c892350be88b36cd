"""The console's objectives page: each configured window's report (attainment against the
target, error budget left, burn rate per class, objective and group), and charts of
attainment and burn rate over time drawn on the server (hub/console/charts.py). The
report is the operator API's and the CLI's (hub/fleet/objectives.py)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from hub.api.requests import ObjectivesQuery
from hub.console.charts import Series, line_chart
from hub.console.web import error_page, hub_settings, hub_store, page, render
from hub.fleet.objectives import reports_view, series_view

# The objective the charts follow: the one a person waits on.
CHARTED = "first_token"


def objective_charts(series: dict[str, Any], *, start: float, end: float) -> list[Any]:
    """Attainment (%) and burn rate of `CHARTED` per class, from a `series_view`."""
    by_class: dict[str, list[dict[str, Any]]] = {}
    for point in series["data"]:
        by_class.setdefault(point["service_class"], []).append(point)
    step = series["step_s"]
    middle = step / 2 if step else 0.0

    def points(rows: list[dict[str, Any]], key: str, scale: float) -> list[tuple[float, float]]:
        return [
            # In the middle of its step, or now for the step under way.
            (min(p["start"] + middle, end), scale * p[key][CHARTED])
            for p in rows
            if p[key][CHARTED] is not None and (key != "burn_rate" or p["requests"])
        ]

    gap = 1.5 * step if step else None
    attainment = [
        Series(c, points(rows, "attainment", 100.0)) for c, rows in sorted(by_class.items())
    ]
    burn = [Series(c, points(rows, "burn_rate", 1.0)) for c, rows in sorted(by_class.items())]
    return [
        line_chart("slo-attainment", "First token within SLO.B, by class", attainment,
                   unit="%", start=start, end=end, y_max=100.0, gap_s=gap),
        line_chart("slo-burn", "Error budget burn rate (first token), by class", burn,
                   unit="x budget", start=start, end=end, gap_s=gap),
    ]  # fmt: skip


@page
async def objectives_page(request: web.Request) -> web.StreamResponse:
    try:
        q = ObjectivesQuery.model_validate(dict(request.query))
    except ValidationError:
        return error_page(request, 400, "Bad request", "That grouping or filter is not one.")
    store = hub_store(request)
    settings = hub_settings(request).objectives
    now = time.time()
    filters = q.filters()
    reports = await store.read(
        reports_view,
        store.reader,
        settings,
        windows=settings.windows,
        by=q.by,
        filters=filters,
        now=now,
    )
    # The charts span the second window (1d by default): long enough to see a trend, fine
    # enough to see an hour's trouble.
    charted = settings.windows[min(1, len(settings.windows) - 1)]
    series = await store.read(
        series_view, store.reader, settings, window=charted, step_s=None, filters=filters, now=now
    )
    return render(
        request,
        "objectives.html",
        reports=reports,
        charts=objective_charts(series, start=series["since"], end=now),
        charted=charted,
        query=q,
        budget_period=settings.budget_period,
    )


def objectives_routes() -> list[web.RouteDef]:
    return [web.get("/console/objectives", objectives_page)]
