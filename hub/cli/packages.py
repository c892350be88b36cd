"""`kvl hub packages …`: content packages across the fleet, and the archives the hub seeds
to nodes."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hub.cli.common import hub_settings, opened_store
from shared.cli import common_options, config_errors_exit


@click.group("packages")
def packages() -> None:
    """Content packages across the fleet, and the archives the hub seeds to nodes."""


@packages.command("add")
@common_options
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--seed", "seed", is_flag=True, help="Seed it to nodes at once.")
@click.option("--site", default=None, help="With --seed: only this site's nodes.")
@config_errors_exit
def packages_add(
    config_file: Path | None, data_dir: Path | None, file: Path, *, seed: bool, site: str | None
) -> None:
    """Keep a package archive (an appliance's `/v1/packages/ID/exports/oci`) to seed."""
    from hub.packages import add_bundle  # noqa: PLC0415
    from shared.oci import LayoutError  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir)
    with opened_store(settings) as store:
        try:
            record = add_bundle(store, settings.artifacts_dir, file.read_bytes())
        except LayoutError as err:
            raise click.ClickException(f"{file}: not a package archive: {err}") from err
        if seed:
            store.packages.seed(record.id, record.version, site)
    where = f" and seeded to {site or 'every node'}" if seed else ""
    click.echo(f"package {record.id}@{record.version} ({record.title}): kept{where}")


@packages.command("list")
@common_options
@click.option("--query", "-q", default=None, help="Only ids, titles or topics with this.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@config_errors_exit
def packages_list(
    config_file: Path | None, data_dir: Path | None, *, query: str | None, as_json: bool
) -> None:
    """Packages the fleet reported or the hub holds: where each is, where it is seeded."""
    from hub.views import package_view  # noqa: PLC0415

    with opened_store(hub_settings(config_file, data_dir)) as store:
        found = store.packages.find(query)
        names = store.nodes.names()
    for p in found:
        view = package_view(p, names)
        if as_json:
            click.echo(json.dumps(view))
            continue
        seeded = f"seeded to {p.seeded_to}" if p.seeded_to else "not seeded"
        held = "held by the hub" if p.bundle_sha256 else "not held"
        click.echo(
            f"{p.id}@{p.version}  {p.title!r}  {p.items} items  on {len(p.nodes)} node(s)  "
            f"{held}, {seeded}"
        )


@packages.command("seed")
@common_options
@click.argument("package_id")
@click.option("--version", default=None, help="The version (default: the newest held).")
@click.option("--site", default=None, help="Only this site's nodes (default: every node).")
@config_errors_exit
def packages_seed(
    config_file: Path | None,
    data_dir: Path | None,
    package_id: str,
    *,
    version: str | None,
    site: str | None,
) -> None:
    """Seed a package the hub holds: nodes fetch it, check it and pin it in their cache."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.packages.seed(package_id, version, site)
    click.echo(f"seeding {package_id} to {site or 'every node'}")


@packages.command("unseed")
@common_options
@click.argument("package_id")
@click.option("--version", default=None, help="The version (default: every version).")
@config_errors_exit
def packages_unseed(
    config_file: Path | None, data_dir: Path | None, package_id: str, *, version: str | None
) -> None:
    """Stop seeding a package: nodes unpin it, and their caches may evict it."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.packages.unseed(package_id, version)
    click.echo(f"no longer seeding {package_id}")
