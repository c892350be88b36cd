"""`kvl hub accounts …`: the fleet's accounts, their quotas and their budgets."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import click

from hub.cli.common import hub_settings, opened_store, parse_duration
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path


@click.group("accounts")
def accounts() -> None:
    """Accounts of the fleet: service class, quotas and tenancy, pushed to their nodes."""


@accounts.command("set")
@common_options
@click.argument("name")
@click.option(
    "--class", "service_class", type=click.Choice(["S0", "S1", "S2", "S3", "S4"]), default="S1"
)
@click.option("--rpm", type=click.IntRange(0), default=None, help="Requests per minute.")
@click.option("--tokens-per-day", type=click.IntRange(0), default=None, help="Tokens per day.")
@click.option(
    "--budget-tokens",
    type=click.IntRange(0),
    default=None,
    help="A global budget across the fleet, spent by nodes through leases (unset: none).",
)
@click.option("--budget-period", default="1d", help="The budget's period: 1h, 1d, 7d … (1d).")
@config_errors_exit
def accounts_set(
    config_file: Path | None,
    data_dir: Path | None,
    name: str,
    *,
    service_class: str,
    rpm: int | None,
    tokens_per_day: int | None,
    budget_tokens: int | None,
    budget_period: str,
) -> None:
    """Create or change an account (unset quotas: the class's defaults; each node
    enforces them on its own, while a budget holds across the fleet)."""
    from hub.planning.quota import Budget  # noqa: PLC0415

    period_s = parse_duration(budget_period)
    budget = None if budget_tokens is None else Budget(budget_tokens, period_s)
    with opened_store(hub_settings(config_file, data_dir)) as store:
        serial = store.accounts.put(
            name,
            service_class,
            requests_per_minute=rpm,
            tokens_per_day=tokens_per_day,
            budget=budget,
        )
    click.echo(f"account {name} ({service_class}); desired state serial {serial}")


@accounts.command("bind")
@common_options
@click.argument("name")
@click.option("--tenant", default=None, help="The tenant it belongs to (unset: a shared account).")
@click.option("--site", "sites", multiple=True, help="Only nodes of this site (repeat).")
@click.option(
    "--dedicated", is_flag=True, help="Only its tenant's dedicated nodes serve it (needs --tenant)."
)
@config_errors_exit
def accounts_bind(
    config_file: Path | None,
    data_dir: Path | None,
    name: str,
    *,
    tenant: str | None,
    sites: tuple[str, ...],
    dedicated: bool,
) -> None:
    """Bind an account to a tenant and sites, exactly as given (what is not given is
    cleared): the nodes whose desired state gives it follow
    (docs/hub.md#tenancy-and-isolation)."""
    from hub.planning.tenancy import Tenancy  # noqa: PLC0415

    if dedicated and not tenant:
        raise click.BadParameter("an account restricted to dedicated nodes names its --tenant")
    if any(not s for s in sites) or tenant == "":
        raise click.BadParameter("a tenant or a site is not empty")
    tenancy = Tenancy(tenant, tuple(dict.fromkeys(sites)), dedicated)
    with opened_store(hub_settings(config_file, data_dir)) as store:
        serial = store.accounts.set_tenancy(name, tenancy)
    click.echo(f"account {name}: {_tenancy_text(tenancy)}; desired state serial {serial}")


@accounts.command("unbind")
@common_options
@click.argument("name")
@config_errors_exit
def accounts_unbind(config_file: Path | None, data_dir: Path | None, name: str) -> None:
    """Make an account shared again: no tenant, every site."""
    from hub.planning.tenancy import Tenancy  # noqa: PLC0415

    with opened_store(hub_settings(config_file, data_dir)) as store:
        serial = store.accounts.set_tenancy(name, Tenancy())
    click.echo(f"account {name}: shared, every site; desired state serial {serial}")


def _tenancy_text(tenancy: Any) -> str:
    who = f"tenant {tenancy.tenant}" if tenancy.tenant else "shared"
    if tenancy.dedicated:
        who += " (its dedicated nodes only)"
    where = f"sites {', '.join(tenancy.sites)}" if tenancy.sites else "every site"
    return f"{who}, {where}"


@accounts.command("list")
@common_options
@config_errors_exit
def accounts_list(config_file: Path | None, data_dir: Path | None) -> None:
    """List accounts: name, class, quotas."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        rows = store.accounts.all()
    for row in rows:
        budget = "-"
        if row["budget_tokens"] is not None:
            budget = f"{row['budget_tokens']} per {row['budget_period_s']:g} s"
        tenancy = row["tenant"] or "shared"
        if row["dedicated"]:
            tenancy += " (dedicated)"
        if row["sites"]:
            tenancy += f" at {','.join(row['sites'])}"
        click.echo(
            f"{row['name']:<24} {row['service_class']}  rpm {row['requests_per_minute'] or '-'}  "
            f"tokens/day {row['tokens_per_day'] or '-'}  budget {budget}  tenancy {tenancy}"
        )


@accounts.command("quota")
@common_options
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@config_errors_exit
def accounts_quota(
    config_file: Path | None, data_dir: Path | None, name: str, as_json: bool
) -> None:
    """An account's budget this period: consumed (in the ledger), leased per node, left."""
    from hub.views import quota_view  # noqa: PLC0415

    with opened_store(hub_settings(config_file, data_dir)) as store:
        quota = store.leases.quota(name, time.time())
        names = store.nodes.names()
    if quota is None:
        raise click.ClickException(
            f"account {name!r} has no budget (kvl hub accounts set --budget-tokens)"
        )
    view = quota_view(quota, names)
    if as_json:
        click.echo(json.dumps(view))
        return
    click.echo(
        f"{name}: budget {view['budget_tokens']} per {view['period_s']:g} s, "
        f"consumed {view['consumed']}, leased {sum(view['leased'].values())}, "
        f"remaining {view['remaining']} (period ends {view['period_end']})"
    )
    for node, tokens in sorted(view["leased"].items()):
        click.echo(f"  {node:<24} leased {tokens}")
