"""`kvl hub nodes …`: the node registry."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path


@click.group("nodes")
def nodes() -> None:
    """The node registry."""


def _row(name: str, site: str, status: str, address: str, seen: str) -> str:
    return f"{name:<20} {site:<16} {status:<8} {address:<15} {seen}"


@nodes.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def nodes_list(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List nodes: name, site, status (online, stale, offline, revoked), address, last seen."""
    from hub.views import node_view  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir)
    with opened_store(settings) as store:
        rows = store.nodes()
    now = time.time()
    if rows and not as_json:
        click.echo(_row("NAME", "SITE", "STATUS", "ADDRESS", "LAST SEEN"))
    for node in rows:
        view = node_view(node, settings, now)
        if as_json:
            click.echo(json.dumps(view))
        else:
            seen = "never" if node.last_seen is None else f"{now - node.last_seen:.0f} s ago"
            click.echo(_row(node.name, node.site, view["status"], node.overlay_address, seen))


@nodes.command("revoke")
@common_options
@click.argument("node")
@config_errors_exit
def nodes_revoke(config_file: Path | None, data_dir: Path | None, node: str) -> None:
    """Revoke a node (by id or name): its calls are refused from now on."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        revoked = store.revoke_node(node)
    click.echo(f"revoked {revoked.name} ({revoked.id})")


@nodes.command("drain")
@common_options
@click.argument("node")
@click.option("--undo", is_flag=True, help="Take the node back into placement.")
@config_errors_exit
def nodes_drain(config_file: Path | None, data_dir: Path | None, node: str, undo: bool) -> None:
    """Drain a node: its replicas move elsewhere and it gets no new ones (--undo ends it)."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        done = store.set_draining(node, draining=not undo)
    click.echo(f"{done.name} {'drains' if done.draining else 'takes replicas again'}")
