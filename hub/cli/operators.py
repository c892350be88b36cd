"""`kvl hub operators …`: operator tokens for the hub's admin API and its console."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path


@click.group("operators")
def operators() -> None:
    """Operator tokens for the hub's admin API (/v1/admin) and its console."""


@operators.command("create")
@common_options
@click.option("--name", required=True, help="Who or what holds it.")
@config_errors_exit
def operators_create(config_file: Path | None, data_dir: Path | None, name: str) -> None:
    """Create an operator token; it is printed once, alone on stdout."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        new = store.operators.create(name)
    click.echo(new.plaintext)


@operators.command("revoke")
@common_options
@click.argument("prefix")
@config_errors_exit
def operators_revoke(config_file: Path | None, data_dir: Path | None, prefix: str) -> None:
    """Revoke an operator token by its prefix (or the whole token)."""
    from shared.keys import OPERATOR_TOKEN, parse_prefix  # noqa: PLC0415

    prefix = parse_prefix(prefix, OPERATOR_TOKEN) or prefix
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.operators.revoke(prefix)
    click.echo(f"revoked {prefix}")
