"""`kvl hub keys …`: API keys of the fleet's accounts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path


@click.group("keys")
def keys() -> None:
    """API keys of fleet accounts (only hashes go to the nodes)."""


@keys.command("create")
@common_options
@click.option("--account", required=True, help="An account made with `kvl hub accounts set`.")
@click.option("--admin", is_flag=True, help="The key may use the appliances' /v1/admin routes.")
@config_errors_exit
def keys_create(config_file: Path | None, data_dir: Path | None, account: str, admin: bool) -> None:
    """Create a key; it is printed once, alone on stdout."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        new = store.accounts.create_key(account, admin=admin)
    click.echo(new.plaintext)


@keys.command("revoke")
@common_options
@click.argument("prefix")
@config_errors_exit
def keys_revoke(config_file: Path | None, data_dir: Path | None, prefix: str) -> None:
    """Revoke a key by its prefix (or the whole key) on every node."""
    from shared.keys import parse_prefix  # noqa: PLC0415

    prefix = parse_prefix(prefix) or prefix
    with opened_store(hub_settings(config_file, data_dir)) as store:
        serial = store.accounts.revoke_key(prefix)
    click.echo(f"revoked {prefix}; desired state serial {serial}")
