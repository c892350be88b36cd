"""`kvl hub backup` and `kvl hub restore` (hub/backup.py): the hub in one archive file,
taken while it serves, and put back into a stopped hub."""

from __future__ import annotations

import datetime
from pathlib import Path

import click

from hub.cli.common import hub_settings
from shared.backup_archive import BackupError
from shared.cli import (
    common_options,
    config_errors_exit,
    opened_archive,
    opening_options,
    passphrase_from,
    sealing_options,
)


@click.command("backup")
@common_options
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--no-artifacts",
    is_flag=True,
    help="Leave out DATA/artifacts/ (model files and package archives): add them again "
    "after a restore.",
)
@sealing_options
@config_errors_exit
def backup(
    *,
    config_file: Path | None,
    data_dir: Path | None,
    out: Path,
    no_artifacts: bool,
    recipients: tuple[str, ...],
    passphrase_file: Path | None,
) -> None:
    """Back the hub up into the archive OUT (a tar; gzipped if OUT ends in .gz), while it
    serves: its store, its CA and keys, and its artifacts. OUT holds the CA's key: it is
    written mode 0600; keep it as safe as the hub, or seal it."""
    from hub import backup as hub_backup  # noqa: PLC0415 - `kvl hub --help` stays light
    from shared import sealing  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir)
    try:
        seal = sealing.sealing_of(recipients, passphrase_from(passphrase_file))
        made = sealing.write_sealed(
            out, seal, lambda path: hub_backup.backup(settings, path, artifacts=not no_artifacts)
        )
    except BackupError as err:
        raise click.ClickException(str(err)) from err
    manifest = made.manifest
    click.echo(
        f"backed up the hub to {out}: its {manifest.store} store (schema "
        f"{manifest.migrations[-1] if manifest.migrations else 'empty'}, desired serial "
        f"{manifest.serials.get('desired_serial', 0)}) and {len(manifest.members) - 1} "
        f"file(s), {manifest.size} bytes"
    )
    for name in made.left_out:
        click.echo(f"not in the backup: {settings.data_dir / name}", err=True)


@click.command("restore")
@common_options
@click.argument("archive", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option(
    "--force",
    is_flag=True,
    help="Restore into a data directory (or database) that is not empty: what it holds is "
    "moved aside first, into DATA/replaced-TIME/.",
)
@opening_options
@config_errors_exit
def restore(
    *,
    config_file: Path | None,
    data_dir: Path | None,
    archive: Path,
    force: bool,
    identity_files: tuple[Path, ...],
    passphrase_file: Path | None,
) -> None:
    """Restore a hub's backup into this hub's data directory (and database), with no hub
    running on them (a sealed one opened with --identity or --passphrase-file). The archive
    is checked whole first; the desired-state serial then moves past any a node may hold,
    so every node takes the restored state."""
    from hub import backup as hub_backup  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir)
    try:
        with opened_archive(archive, settings.data_dir, identity_files, passphrase_file) as plain:
            restored = hub_backup.restore(settings, plain, force=force)
    except BackupError as err:
        raise click.ClickException(str(err)) from err
    manifest = restored.manifest
    taken = datetime.datetime.fromtimestamp(manifest.created_at, datetime.UTC)
    click.echo(
        f"restored the hub as it was at {taken:%Y-%m-%d %H:%M:%S} UTC into {settings.data_dir}"
    )
    if restored.set_aside is not None:
        click.echo(f"what was there before is in {restored.set_aside}")
    for key, (before, after) in restored.serials.items():
        click.echo(f"{key}: {before} -> {after}")
    click.echo(
        "what changed since the backup is not restored: nodes enrolled since must enroll "
        "again, accounts, keys and revocations made since must be made again, and usage the "
        "hub acknowledged since is missing until the nodes resend it (docs/operations.md, "
        "Backup and restore)",
        err=True,
    )
