"""Error budgets, pure: attainment, budget left and burn rate of an objective over a window,
and the report the API, the CLI and the console show (one row per class, objective and
group).

An objective's target is the share of its requests that must meet it (0.99: 99 % of S1
requests reach their first token within SLO.B). Its error budget over the budget period is
the share allowed to miss, (1 - target) of the requests; `budget_left` is what of it is
not spent yet (1: untouched, 0: spent, below 0: overspent). The burn rate over a window
is how fast it is spent there: the window's error ratio over (1 - target), 1 spending
exactly the budget over the period, 14.4 spending a 30-day budget in about two days."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from hub.planning.slo import SloTotals


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
# The longest window the hourly buckets reach back over (they are kept 35 days).
MAX_WINDOW_S = 35 * 86_400


def window_s(text: str) -> float:
    """A window as people write it (`5m`, `1h`, `1d`, `30d`, `2w`) in seconds; ValueError
    when it is not one, or longer than the buckets are kept."""
    match = re.fullmatch(r"(\d{1,7})([smhdw])", text.strip())
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a window like 1h, 1d or 30d")
    seconds = float(int(match.group(1)) * _UNITS[match.group(2)])
    if seconds > MAX_WINDOW_S:
        raise ValueError(f"{text!r} is longer than the 35 days objectives are kept")
    return seconds


def attainment(met: int, missed: int) -> float | None:
    """The share that met the objective; None when nothing counted either way."""
    total = met + missed
    return met / total if total else None


def burn_rate(missed: int, total: int, target: float) -> float:
    """The error ratio over the error budget's share, (missed / total) / (1 - target);
    0 when nothing was counted."""
    if total <= 0:
        return 0.0
    allowed = 1.0 - target
    if allowed <= 0:  # a target of 1: any miss burns without bound; none, nothing
        return float("inf") if missed else 0.0
    return (missed / total) / allowed


def budget_left(missed: int, total: int, target: float) -> float:
    """The share of the error budget not spent, 1 - missed / ((1 - target) * total): 1 when
    nothing was counted, below 0 once overspent."""
    if total <= 0:
        return 1.0
    allowed = (1.0 - target) * total
    if allowed <= 0:
        return 1.0 if not missed else float("-inf")
    return 1.0 - missed / allowed


@dataclass(frozen=True)
class BudgetRow:
    """One objective of one class and group over a window; `budget_left` over the budget
    period (the window's own when no period totals were given)."""

    service_class: str
    objective: str
    group: str
    good: int
    bad: int
    attainment: float | None
    target: float
    budget_left: float
    burn_rate: float
    requests: int

    def view(self) -> dict[str, Any]:
        return asdict(self)


def report(
    window: Iterable[SloTotals],
    target: Callable[[str, str], float],
    period: Iterable[SloTotals] | None = None,
) -> list[BudgetRow]:
    """Each (class, objective, group) of `window`: good (met), bad (missed), attainment,
    the target, the budget left over `period` (the same classes and groups over the budget
    period; the window itself when None) and the window's burn rate. Objectives that
    counted nothing in the window are left out."""
    window = list(window)
    over: dict[tuple[str, str], SloTotals] = {
        (t.service_class, t.group): t for t in (window if period is None else period)
    }
    rows = []
    for t in sorted(window, key=lambda t: (t.service_class, t.group)):
        for objective in protocol.OBJECTIVES:
            good, bad = t.met.get(objective, 0), t.missed.get(objective, 0)
            if good + bad == 0:
                continue
            goal = target(t.service_class, objective)
            spent = over.get((t.service_class, t.group))
            p_bad = spent.missed.get(objective, 0) if spent else 0
            p_total = p_bad + (spent.met.get(objective, 0) if spent else 0)
            rows.append(
                BudgetRow(
                    service_class=t.service_class,
                    objective=objective,
                    group=t.group,
                    good=good,
                    bad=bad,
                    attainment=attainment(good, bad),
                    target=goal,
                    budget_left=budget_left(p_bad, p_total, goal),
                    burn_rate=burn_rate(bad, good + bad, goal),
                    requests=t.requests,
                )
            )
    return rows
