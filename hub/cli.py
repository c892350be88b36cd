"""`kvl hub …`. The hub service itself arrives with the fleet link; today: its configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
import yaml

from hub.settings import EXAMPLE_HEADER, HubSettings
from shared.cli import common_options, config_errors_exit
from shared.config import example_yaml, load_settings

if TYPE_CHECKING:
    from pathlib import Path


@click.group("hub")
def hub() -> None:
    """The hub of the fleet."""


@hub.command("config")
@common_options
@click.option("--example", is_flag=True, help="Print the commented example config instead.")
@config_errors_exit
def show_config(config_file: Path | None, data_dir: Path | None, example: bool) -> None:
    """Validate the hub configuration and print the effective settings."""
    if example:
        click.echo(example_yaml(HubSettings, EXAMPLE_HEADER), nl=False)
        return
    overrides: dict[str, Any] = {"data_dir": data_dir} if data_dir is not None else {}
    settings = load_settings(HubSettings, config_file=config_file, overrides=overrides)
    click.echo(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), nl=False)
