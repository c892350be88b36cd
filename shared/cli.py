"""`kvl`: the one console command. Its groups load lazily, so `kvl hub` never imports the
model runtime and `kvl appliance` never imports the hub."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from shared import __version__
from shared.config import ConfigError, S, load_settings

F = TypeVar("F", bound=Callable[..., Any])


class LazyGroup(click.Group):
    """A group whose commands are imported only when one is run (or its help asked for): a
    command pays for its own imports, not for its siblings'. `lazy` maps a command's name
    to its module, attribute and short help: what `--help` lists without importing it, the
    command's own as click cuts it at 84 characters (tests/test_kvl.py checks each)."""

    def __init__(self, *args: Any, lazy: dict[str, tuple[str, str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.lazy, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.lazy:
            return super().get_command(ctx, cmd_name)
        module, attr, _ = self.lazy[cmd_name]
        command: click.Command = getattr(importlib.import_module(module), attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in self.lazy:
                # A command of its help alone: truncated as click truncates any command's.
                summary = click.Command(name, help=self.lazy[name][2])
                rows.append((name, summary.get_short_help_str(limit)))
            else:
                rows.append((name, self.commands[name].get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(
    cls=LazyGroup,
    lazy={
        "appliance": (
            "appliance.cli",
            "appliance",
            "The appliance: the LAN API, its keys and models.",
        ),
        "hub": ("hub.cli", "hub", "The hub of the fleet."),
        "image": (
            "image.configure",
            "image",
            "The appliance image (`just image` builds it): its provisioning file.",
        ),
        "bundle": (
            "shared.bundle_cli",
            "bundle",
            "Site bundles: models, a release, packages and settings in one signed file.",
        ),
        "demo": (
            "image.demo",
            "demo",
            "A hub and an appliance on this machine, joined over WireGuard (needs root).",
        ),
    },
)
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


def sealing_options(fn: F) -> F:
    """`--recipient` and `--passphrase-file`: a backup sealed with age (shared/sealing.py)."""
    fn = click.option(
        "--passphrase-file",
        type=click.Path(path_type=Path, dir_okay=False, allow_dash=True),
        default=None,
        help="Seal the backup with the passphrase on this file's first line (- reads it "
        "from standard input): OUT is then a tar of identity.age and backup.tar.age.",
    )(fn)
    return click.option(
        "--recipient",
        "recipients",
        multiple=True,
        metavar="AGE1…",
        help="Seal the backup with age to this X25519 recipient (repeat for more): "
        "`age -d -i KEY OUT` opens it.",
    )(fn)


def opening_options(fn: F) -> F:
    """`--identity` and `--passphrase-file`: what opens a sealed backup."""
    fn = click.option(
        "--passphrase-file",
        type=click.Path(path_type=Path, dir_okay=False, allow_dash=True),
        default=None,
        help="The archive is sealed with the passphrase on this file's first line (- reads "
        "it from standard input).",
    )(fn)
    return click.option(
        "--identity",
        "identity_files",
        multiple=True,
        type=click.Path(path_type=Path, dir_okay=False, exists=True),
        help="An age identity file (`age-keygen`'s) that opens a sealed archive; repeat for more.",
    )(fn)


def passphrase_from(path: Path | None) -> str | None:
    """The passphrase on the first line of `path` (`-`: standard input), its line end
    dropped; None without one."""
    if path is None:
        return None
    text: str = sys.stdin.readline() if str(path) == "-" else path.read_text()
    passphrase = text.splitlines()[0] if text else ""
    if not passphrase:
        raise click.BadParameter("it holds no passphrase", param_hint="--passphrase-file")
    return passphrase


def identities_from(paths: tuple[Path, ...]) -> list[str]:
    """The X25519 identities of age identity files."""
    from shared import sealing  # noqa: PLC0415 - pyrage, for the commands that seal

    found = []
    for path in paths:
        try:
            found += sealing.identities(path.read_text())
        except sealing.SealError as err:
            raise click.BadParameter(f"{path}: {err}", param_hint="--identity") from err
    return found


@contextlib.contextmanager
def opened_archive(
    archive: Path, data_dir: Path, identity_files: tuple[Path, ...], passphrase_file: Path | None
) -> Iterator[Path]:
    """The backup `archive` to restore into `data_dir`: itself, or opened (with the
    identities or the passphrase given) into a folder beside the data directory."""
    from shared import sealing  # noqa: PLC0415 - pyrage, for the commands that seal

    with sealing.opened(
        archive,
        data_dir.resolve().parent,
        identity=identities_from(identity_files),
        passphrase=passphrase_from(passphrase_file),
    ) as plain:
        yield plain


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
