"""Line charts drawn on the server as inline SVG: no script, no external service, readable
by a screen reader (a title and a description with the latest and highest values)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from markupsafe import Markup, escape

if TYPE_CHECKING:
    from collections.abc import Sequence

WIDTH, HEIGHT = 640, 200
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 24, 28
# Dark enough on white for WCAG AA, and told apart by their dashes as well as their colour.
COLOURS = ("#0b57d0", "#a3361b", "#146c2e")
DASHES = ("", "6 4", "2 3")


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[float, float]]  # (unix seconds, value), oldest first


def line_chart(
    chart_id: str,
    title: str,
    series: Sequence[Series],
    *,
    unit: str,
    start: float,
    end: float,
    y_max: float | None = None,
    gap_s: float | None = None,
) -> Markup:
    """An SVG chart of `series` between `start` and `end` (unix seconds). `y_max` fixes the
    top of the scale (100 for percentages); otherwise it fits the data. A line breaks
    where two points are more than `gap_s` apart (the node sent nothing then)."""
    end = max(end, start + 1.0)
    shown = [
        Series(s.label, [(t, v) for t, v in s.points if start <= t <= end and math.isfinite(v)])
        for s in series
    ]
    values = [v for s in shown for _, v in s.points]
    top = y_max if y_max is not None else nice_ceiling(max(values, default=0.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + (t - start) / (end - start) * plot_w

    def y(v: float) -> float:
        return TOP + plot_h - min(max(v, 0.0), top) / top * plot_h

    parts = [
        (
            f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'role="img" aria-labelledby="{escape(chart_id)}-t {escape(chart_id)}-d">'
        ),
        f'<title id="{escape(chart_id)}-t">{escape(title)}</title>',
        f'<desc id="{escape(chart_id)}-d">{escape(describe(shown, unit))}</desc>',
    ]
    for fraction in (0.0, 0.5, 1.0):
        gy = TOP + plot_h - fraction * plot_h
        parts.append(
            f'<line x1="{LEFT}" y1="{gy:.1f}" x2="{WIDTH - RIGHT}" y2="{gy:.1f}" '
            f'stroke="#c4c7c5" stroke-width="1"/>'
        )
        parts.append(
            f'<text x="{LEFT - 6}" y="{gy + 4:.1f}" text-anchor="end" font-size="12" '
            f'fill="#1f1f1f">{escape(number(top * fraction))}</text>'
        )
    for at, anchor in ((start, "start"), (end, "end")):
        parts.append(
            f'<text x="{x(at):.1f}" y="{HEIGHT - 8}" text-anchor="{anchor}" font-size="12" '
            f'fill="#1f1f1f">{escape(clock(at))}</text>'
        )
    legend_x = LEFT
    for i, s in enumerate(shown):
        colour, dash = COLOURS[i % len(COLOURS)], DASHES[i % len(DASHES)]
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<line x1="{legend_x}" y1="12" x2="{legend_x + 20}" y2="12" stroke="{colour}" '
            f'stroke-width="2.5"{dash_attr}/>'
            f'<text x="{legend_x + 26}" y="16" font-size="12" fill="#1f1f1f">'
            f"{escape(s.label)} ({escape(unit)})</text>"
        )
        legend_x += 40 + 8 * len(s.label) + 8 * len(unit)
        for run in runs(s.points, gap_s):
            if len(run) == 1:
                t, v = run[0]
                parts.append(f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}"/>')
                continue
            points = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in run)
            parts.append(
                f'<polyline points="{points}" fill="none" stroke="{colour}" '
                f'stroke-width="2" stroke-linejoin="round"{dash_attr}/>'
            )
    if not values:
        parts.append(
            f'<text x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" '
            f'font-size="14" fill="#1f1f1f">No samples yet</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - every value above is escaped or a number


def runs(
    points: Sequence[tuple[float, float]], gap_s: float | None
) -> list[list[tuple[float, float]]]:
    """The points split where the time between two exceeds `gap_s`."""
    out: list[list[tuple[float, float]]] = []
    for point in points:
        if out and (gap_s is None or point[0] - out[-1][-1][0] <= gap_s):
            out[-1].append(point)
        else:
            out.append([point])
    return out


def describe(series: Sequence[Series], unit: str) -> str:
    if not any(s.points for s in series):
        return "No samples yet."
    texts = []
    for s in series:
        if s.points:
            latest = s.points[-1][1]
            highest = max(v for _, v in s.points)
            texts.append(
                f"{s.label}: latest {number(latest)} {unit}, highest {number(highest)} {unit}"
            )
    return "; ".join(texts) + "."


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at or above `value` (1 for 0)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(step * power for step in (1.0, 2.0, 2.5, 5.0, 10.0) if value <= step * power)


def number(value: float) -> str:
    if abs(value) >= 100_000:
        return f"{value / 1000:.0f}k"
    if abs(value) >= 10_000:
        return f"{value / 1000:.1f}".rstrip("0").rstrip(".") + "k"
    if abs(value) >= 10 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.1f}"


def clock(at: float) -> str:
    return time.strftime("%H:%M UTC", time.gmtime(at))
