"""`kvl hub nodes …`: the node registry."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store
from hub.views import node_view, tenancy_text
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path

    from shared import protocol


@click.group("nodes")
def nodes() -> None:
    """The node registry."""


def _row(*columns: str) -> str:
    """NAME, SITE, STATUS, ADDRESS, TENANCY, LAST SEEN, aligned."""
    widths = (20, 16, 8, 15, 16)
    cells = [f"{c:<{w}}" for c, w in zip(columns, widths, strict=False)]
    return " ".join([*cells, *columns[len(widths) :]])


@nodes.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def nodes_list(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List nodes: name, site, status (online, stale, offline, revoked), address, tenancy,
    last seen; and, under a node the hub refused a certificate, why."""
    settings = hub_settings(config_file, data_dir)
    with opened_store(settings) as store:
        rows = store.nodes.all()
    now = time.time()
    if rows and not as_json:
        click.echo(_row("NAME", "SITE", "STATUS", "ADDRESS", "TENANCY", "LAST SEEN"))
    for node in rows:
        view = node_view(node, settings, now)
        if as_json:
            click.echo(json.dumps(view))
            continue
        seen = "never" if node.last_seen is None else f"{now - node.last_seen:.0f} s ago"
        tenancy = tenancy_text(node.tenant, node.private)
        click.echo(_row(node.name, node.site, view["status"], node.overlay_address, tenancy, seen))
        if node.certificate_refused:
            click.echo(f"  certificate refused: {node.certificate_refused}")


@nodes.command("set")
@common_options
@click.argument("node")
@click.option("--tenant", default=None, help="Dedicate the node to this tenant (S3).")
@click.option("--shared", is_flag=True, help="Dedicate it to no tenant (a shared node).")
@click.option(
    "--private/--not-private",
    default=None,
    help="On its tenant's private site (S4), or not.",
)
@config_errors_exit
def nodes_set(  # click passes every option by name
    *,
    config_file: Path | None,
    data_dir: Path | None,
    node: str,
    tenant: str | None,
    shared: bool,
    private: bool | None,
) -> None:
    """Set a node's tenancy (by id or name): the operator's alone; what a node's labels
    say of it grants nothing. What is not given stays as it is."""
    if shared and tenant:
        raise click.UsageError("--tenant and --shared contradict each other")
    with opened_store(hub_settings(config_file, data_dir)) as store:
        found = store.nodes.get(node)
        store.accounts.set_node_tenancy(
            found,
            tenant=None if shared else (tenant or found.tenant),
            private=found.private if private is None else private,
        )
        done = store.nodes.get(found.id)
    click.echo(f"{done.name}: {tenancy_text(done.tenant, done.private)}")


@nodes.command("revoke")
@common_options
@click.argument("node")
@config_errors_exit
def nodes_revoke(config_file: Path | None, data_dir: Path | None, node: str) -> None:
    """Revoke a node (by id or name): its calls are refused from now on."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        revoked = store.nodes.revoke(node)
    click.echo(f"revoked {revoked.name} ({revoked.id})")


@nodes.command("drain")
@common_options
@click.argument("node")
@click.option("--undo", is_flag=True, help="Take the node back into placement.")
@config_errors_exit
def nodes_drain(config_file: Path | None, data_dir: Path | None, node: str, undo: bool) -> None:
    """Drain a node: its replicas move elsewhere and it gets no new ones (--undo ends it)."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        done = store.nodes.set_draining(node, draining=not undo)
    click.echo(f"{done.name} {'drains' if done.draining else 'takes replicas again'}")


@nodes.command("logs")
@common_options
@click.argument("node")
@click.option("--follow", "-f", is_flag=True, help="Go on printing records as they come.")
@click.option(
    "--level",
    type=click.Choice(["debug", "info", "warning", "error", "critical"], case_sensitive=False),
    default="debug",
    show_default=True,
    help="The least severe level printed.",
)
@click.option(
    "--lines", "-n", type=click.IntRange(1, 1000), default=50, show_default=True,
    help="How many of the last records to print first.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print each record as a JSON line.")
@config_errors_exit
def nodes_logs(  # click passes every option by name
    *,
    config_file: Path | None,
    data_dir: Path | None,
    node: str,
    follow: bool,
    level: str,
    lines: int,
    as_json: bool,
) -> None:
    """Print a node's recent log records (by id or name), read through the tunnel on its
    fleet listener with the hub's certificate; --follow goes on until Ctrl-C."""
    from hub.nodelogs import LogQuery, NodeLogs, hub_client_context, reachable_url  # noqa: PLC0415
    from shared.errors import ApiError  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir)
    with opened_store(settings) as store:
        found = store.nodes.get(node)
    query = LogQuery(limit=lines, level=level.upper(), tail=True)

    async def show() -> None:
        context = hub_client_context(settings)
        reader = NodeLogs(lambda: context)
        nonlocal query
        try:
            url = reachable_url(found, settings, time.time())
            answer = await reader.read(found, url, query)
            while True:
                for record in answer.records:
                    click.echo(record.model_dump_json() if as_json else _log_line(record))
                if not follow:
                    return
                query = query.following(answer)
                answer = await reader.read(found, url, query)
        finally:
            await reader.close()

    try:
        asyncio.run(show())
    except ApiError as err:
        raise click.ClickException(err.message) from err
    except KeyboardInterrupt:
        pass


def _log_line(record: protocol.LogRecord) -> str:
    when = datetime.fromtimestamp(record.time, UTC).isoformat(timespec="milliseconds")
    return f"{when.replace('+00:00', 'Z')} {record.level:<8} {record.logger}: {record.message}"
