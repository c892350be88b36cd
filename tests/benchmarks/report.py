"""What every results table in the docs starts with, and the few formats they share.

The suites' `markdown` functions write the tables docs/benchmarks.md and README.md show
(tests/benchmarks/tables.py puts them there). Older results lack fields the suites write
today (the commit, the machine), so everything here reads with `.get` and says what a
result does not record instead of failing: those results are re-run, not patched.
"""

from __future__ import annotations

from typing import Any

# Written as escapes: ruff takes the characters themselves for look-alikes of x and -.
TIMES = "\N{MULTIPLICATION SIGN}"
DASH = "\N{EN DASH}"


def headline(result: dict[str, Any], *more: str) -> str:
    """`Commit `abc`, 2026-12-01, AMD EPYC, 2 CPUs, …`: which code, when, on what."""
    commit = result.get("commit")
    # structured.py wrote its date as "when" before it wrote "date".
    date = result.get("date") or result.get("when")
    parts = [
        f"Commit `{commit}`" if commit else "Commit not recorded",
        date[:10] if date else "date not recorded",
        machine(result),
        *more,
    ]
    return ", ".join(parts) + "."


def machine(result: dict[str, Any]) -> str:
    """The CPU and its count, from `machine` or (http2.py's layout) the top level."""
    figures = result.get("machine") or {}
    cpu = figures.get("cpu") or result.get("cpu")
    cpus = figures.get("logical_cpus") or result.get("cores")
    if not cpu:
        return "machine not recorded"
    text = f"{cpu}, {cpus} CPUs" if cpus else str(cpu)
    # A run on a GPU (`just bench-gpu`) names its GPUs; a CPU run records an empty list.
    gpus = figures.get("gpus")
    return f"{text}, {' and '.join(gpus)}" if gpus else text


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def target(value: float | None, wanted: float | None, *, at_least: bool = True) -> str:
    """A ratio with its target: bold, as the figure the row is there for."""
    if value is None:
        return "—"
    if wanted is None:
        return f"{value:.2f}"
    return f"**{value:.2f}** (target {'≥' if at_least else '≤'} {wanted:g})"


def span(values: list[float], digits: int = 2) -> str:
    """`1.24-1.59` (an en dash between), or one figure when they are all the same."""
    low, high = min(values), max(values)
    return (
        f"{low:.{digits}f}"
        if f"{low:.{digits}f}" == f"{high:.{digits}f}"
        else (f"{low:.{digits}f}{DASH}{high:.{digits}f}")
    )
