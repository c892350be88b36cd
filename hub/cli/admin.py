"""`kvl hub admin …`: the people who log in to the hub's web console."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path

NAME = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,99}$"


def _password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    password: str = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    return password


def _hash(password: str) -> str:
    from hub.console.auth import PasswordRefusedError, hash_password  # noqa: PLC0415

    try:
        return hash_password(password)
    except PasswordRefusedError as err:
        raise click.ClickException(str(err)) from err


@click.group("admin")
def admin() -> None:
    """People who log in to the web console (/console/), with argon2id-hashed passwords."""


@admin.command("create")
@common_options
@click.option("--name", required=True, help="The login name.")
@click.option(
    "--password-stdin", is_flag=True, help="Read the password from the first line of stdin."
)
@config_errors_exit
def admin_create(
    config_file: Path | None, data_dir: Path | None, name: str, password_stdin: bool
) -> None:
    """Create a console user; prompts for the password (at least 10 characters)."""
    import re  # noqa: PLC0415

    if not re.match(NAME, name):
        raise click.BadParameter("1 to 100 letters, digits, dots, @, dashes or underscores")
    hashed = _hash(_password(password_stdin))
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.console.add_user(name, hashed, time.time())
    click.echo(f"console user {name} created; log in at https://HUB:PORT/console/")


@admin.command("password")
@common_options
@click.argument("name")
@click.option(
    "--password-stdin", is_flag=True, help="Read the password from the first line of stdin."
)
@config_errors_exit
def admin_password(
    config_file: Path | None, data_dir: Path | None, name: str, password_stdin: bool
) -> None:
    """Set a console user's password; their logins end."""
    hashed = _hash(_password(password_stdin))
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.console.set_password_hash(name, hashed, end_sessions=True)
    click.echo(f"password of {name} changed; their logins ended")


@admin.command("list")
@common_options
@config_errors_exit
def admin_list(config_file: Path | None, data_dir: Path | None) -> None:
    """List console users: name, created."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        rows = store.console.users()
    for user in rows:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(user.created_at))
        click.echo(f"{user.name:<24} created {created}{'  disabled' if user.disabled else ''}")


@admin.command("delete")
@common_options
@click.argument("name")
@config_errors_exit
def admin_delete(config_file: Path | None, data_dir: Path | None, name: str) -> None:
    """Delete a console user; their logins end at once."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.console.delete_user(name)
    click.echo(f"deleted console user {name}")
