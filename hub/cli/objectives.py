"""`kvl hub objectives`: the fleet's objectives over a window, against their targets."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path

    from hub.planning.slo import Grouping


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.3f} %"


def _row(*cells: str) -> str:
    widths = (6, 12, 24, 10, 10, 11, 9, 12, 10)
    return " ".join(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True)).rstrip()


@click.command("objectives")
@common_options
@click.option("--window", default="1h", show_default=True, help="5m, 1h, 1d, 30d, … (at most 35d).")
@click.option(
    "--by",
    type=click.Choice(["class", "account", "site", "node"]),
    default="class",
    show_default=True,
    help="Group each class's objectives by account, site or node.",
)
@click.option("--class", "service_class", help="Only this service class (S0..S4).")
@click.option("--account", help="Only this account ((other): those the hub does not know).")
@click.option("--site", help="Only this site.")
@click.option("--node", help="Only this node (id or name).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@config_errors_exit
def objectives(
    *,
    config_file: Path | None,
    data_dir: Path | None,
    window: str,
    by: Grouping,
    service_class: str | None,
    account: str | None,
    site: str | None,
    node: str | None,
    as_json: bool,
) -> None:
    """The fleet's objectives over a window: per class (and group) and objective, the
    requests that met and missed it, attainment against the target, the error budget left
    over the budget period, and the burn rate (1: spending exactly the budget)."""
    from hub.fleet.budgets import window_s  # noqa: PLC0415 - `--help` stays light
    from hub.fleet.objectives import report_view  # noqa: PLC0415
    from hub.state.objectives import SloFilters  # noqa: PLC0415

    try:
        window_s(window)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--window") from err
    settings = hub_settings(config_file, data_dir)
    filters = SloFilters(service_class, account, site, node)
    with opened_store(settings) as store:
        report = report_view(
            store, settings.objectives, window=window, by=by, filters=filters, now=time.time()
        )
    if as_json:
        click.echo(json.dumps(report))
        return
    rows = report["data"]
    if not rows:
        click.echo(f"nothing counted in the last {window}")
        return
    click.echo(f"last {window}; error budget over {report['budget_period']}")
    click.echo(_row("CLASS", "OBJECTIVE", by.upper(), "MET", "MISSED", "ATTAINED", "TARGET",
                    "BUDGET LEFT", "BURN RATE"))  # fmt: skip
    for r in rows:
        click.echo(
            _row(r["service_class"], r["objective"], r["group"] or "-", str(r["good"]),
                 str(r["bad"]), _percent(r["attainment"]), f"{100 * r['target']:g} %",
                 f"{100 * r['budget_left']:.1f} %", f"{r['burn_rate']:.2f}")
        )  # fmt: skip
