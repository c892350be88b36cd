"""`kvl hub alerts …`: the alerts the hub recorded, their silences, and the same rules as
a Prometheus rules file."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store, parse_duration
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path


def _list(
    config_file: Path | None, data_dir: Path | None, state: str | None, as_json: bool
) -> None:
    from hub.views import alert_view  # noqa: PLC0415

    with opened_store(hub_settings(config_file, data_dir)) as store:
        found = store.alerts.all(state)
    for alert in found:
        view = alert_view(alert)
        if as_json:
            click.echo(json.dumps(view))
            continue
        labels = ",".join(f"{k}={v}" for k, v in alert.labels.items())
        mark = " (silenced)" if alert.silenced else ""
        click.echo(
            f"{alert.state:<9} {alert.severity:<7} {alert.rule:<20} {labels:<40} "
            f"{view['fired_at']}  {alert.summary}{mark}"
        )


@click.group("alerts", invoke_without_command=True)
@common_options
@click.pass_context
@config_errors_exit
def alerts(ctx: click.Context, config_file: Path | None, data_dir: Path | None) -> None:
    """The hub's alerts (`kvl hub alerts` alone: those firing, as `list` prints them)."""
    if ctx.invoked_subcommand is None:
        _list(config_file, data_dir, "firing", as_json=False)


@alerts.command("list")
@common_options
@click.option("--all", "every", is_flag=True, help="Resolved ones too (newest first).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def alerts_list(
    config_file: Path | None, data_dir: Path | None, every: bool, as_json: bool
) -> None:
    """Alerts firing (with --all, resolved ones too): state, severity, rule, labels, since."""
    _list(config_file, data_dir, None if every else "firing", as_json)


@alerts.command("silence")
@common_options
@click.option(
    "--match",
    "matchers",
    multiple=True,
    required=True,
    metavar="LABEL=VALUE",
    help="An alert's rule (rule=node_offline) or label (node=n1); several: all must match.",
)
@click.option("--for", "for_", default="1h", help="How long: 30m, 2h, 1d … (1h).")
@click.option("--comment", default="", help="Why.")
@click.option("--by", "created_by", default="cli", help="Who (cli).")
@config_errors_exit
def alerts_silence(  # noqa: PLR0917 - click passes every option
    config_file: Path | None,
    data_dir: Path | None,
    matchers: tuple[str, ...],
    for_: str,
    comment: str,
    created_by: str,
) -> None:
    """Silence matching alerts: recorded, not delivered. Prints the silence's id."""
    pairs = {}
    for text in matchers:
        label, sep, value = text.partition("=")
        if not sep or not label:
            raise click.BadParameter(f"{text!r} is not LABEL=VALUE", param_hint="--match")
        pairs[label] = value
    until = time.time() + parse_duration(for_)
    with opened_store(hub_settings(config_file, data_dir)) as store:
        silence = store.alerts.create_silence(pairs, until, created_by, comment)
    click.echo(silence.id)


@alerts.command("silences")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def alerts_silences(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """Silences: id, matchers, until, whether still in force, who, why."""
    from hub.views import silence_view  # noqa: PLC0415

    with opened_store(hub_settings(config_file, data_dir)) as store:
        found = store.alerts.silences()
    now = time.time()
    for silence in found:
        view = silence_view(silence, now)
        if as_json:
            click.echo(json.dumps(view))
        else:
            matchers = ",".join(f"{k}={v}" for k, v in silence.matchers.items())
            state = "active" if view["active"] else "ended"
            click.echo(f"{silence.id}  {state:<6} {matchers:<40} until {view['until']}  "
                       f"{silence.created_by}: {silence.comment}")  # fmt: skip


@alerts.command("unsilence")
@common_options
@click.argument("silence_id")
@config_errors_exit
def alerts_unsilence(config_file: Path | None, data_dir: Path | None, silence_id: str) -> None:
    """End a silence (by its id)."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.alerts.delete_silence(silence_id)
    click.echo(f"ended {silence_id}")


@alerts.command("rules")
@common_options
@click.option(
    "--scale",
    type=click.FloatRange(min=0.0, min_open=True, max=1.0),
    default=1.0,
    help="Every alert window this many times as long (1/60: an hour is a minute), for tests.",
)
@config_errors_exit
def alerts_rules(config_file: Path | None, data_dir: Path | None, scale: float) -> None:
    """Print the alert rules as a Prometheus rules file, at these settings' thresholds."""
    from hub.alerting.prometheus import rules_yaml, scaled  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir)
    click.echo(rules_yaml(scaled(settings, scale) if scale != 1.0 else settings), nl=False)
