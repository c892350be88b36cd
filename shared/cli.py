"""`kvl`: the one console command. Its groups load lazily, so `kvl hub` never imports the
model runtime and `kvl appliance` never imports the hub."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from shared import __version__
from shared.config import ConfigError, S, load_settings

_GROUPS = {
    "appliance": (
        "appliance.cli",
        "appliance",
        "The appliance: serve the LAN API, keys, models, discovery.",
    ),
    "hub": ("hub.cli", "hub", "The hub of the fleet."),
    "image": ("image.configure", "image", "The appliance image: its provisioning file."),
    "demo": (
        "image.demo",
        "demo",
        "A hub and an appliance on this machine, joined over WireGuard.",
    ),
}

F = TypeVar("F", bound=Callable[..., Any])


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_GROUPS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _GROUPS:
            return None
        module, attr, _ = _GROUPS[cmd_name]
        command: click.Command = getattr(importlib.import_module(module), attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, _, help_) in sorted(_GROUPS.items())])


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="kvl")
def main() -> None:
    """Kovenlab Edge: the appliance and the hub of its fleet."""


def common_options(fn: F) -> F:
    """`--config` and `--data-dir`, which every kvl command takes."""
    fn = click.option(
        "--data-dir",
        type=click.Path(path_type=Path, file_okay=False),
        default=None,
        help="Data directory (database, models); overrides `data_dir` of the config.",
    )(fn)
    return click.option(
        "--config",
        "config_file",
        type=click.Path(path_type=Path, dir_okay=False),
        envvar="KVL_CONFIG",
        default=None,
        help="YAML settings file (also $KVL_CONFIG).",
    )(fn)


def settings_from(
    cls: type[S], config_file: Path | None, data_dir: Path | None, **server: Any
) -> S:
    """Settings as a command sees them: the config file and environment, then its flags
    (`--data-dir`, and the `server` ones it was given)."""
    overrides: dict[str, Any] = {"data_dir": data_dir} if data_dir is not None else {}
    given = {k: v for k, v in server.items() if v is not None}
    if given:
        overrides["server"] = given
    return load_settings(cls, config_file=config_file, overrides=overrides)


def config_errors_exit(fn: F) -> F:
    """Print every configuration problem and exit with status 2."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            click.echo(err.render(), err=True)
            raise SystemExit(2) from err

    return wrapper  # type: ignore[return-value]


if __name__ == "__main__":  # `python -m shared.cli`, used by the tests
    main()
