"""`kvl hub settings …`: what the hub sets of its nodes' settings (the chat default, the text
default, aliases, the service classes' objectives), fleet-wide, per site and per node, the
most specific winning. A value set here reaches the nodes at their next heartbeat; to stage
one through canary and waves instead, `kvl hub rollouts start --setting KEY=VALUE`.
(`kvl hub config` is the hub's own configuration.)"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store
from hub.views import configuration_view
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path

    from hub.state.store import HubStore


@click.group("settings")
def settings() -> None:
    """Node settings the hub sets: fleet-wide, per site, per node (the most specific wins)."""


_site = click.option("--site", default=None, help="For this site's nodes (not fleet-wide).")
_node = click.option("--node", default=None, help="For this node (name or id) only.")


def _scope(store: HubStore, site: str | None, node: str | None) -> str:
    from hub.state.configuration import scope_of  # noqa: PLC0415

    if site is not None and node is not None:
        raise click.BadParameter("--site or --node, not both")
    return scope_of(site, store.nodes.get(node).id if node is not None else None)


@settings.command("set")
@common_options
@click.argument("key")
@click.argument("value")
@_site
@_node
@config_errors_exit
def settings_set(
    config_file: Path | None,
    data_dir: Path | None,
    key: str,
    value: str,
    *,
    site: str | None,
    node: str | None,
) -> None:
    """Set KEY to VALUE, fleet-wide unless --site or --node: chat_default, default,
    aliases.ALIAS, packages.model and packages.check_model take a model (name or
    name@version), objectives.CLASS.admit_s, first_token_s and complete_s seconds (and
    first_token_per_token_s, complete_per_token_s seconds a token); packages.max_attempts,
    item_max_tokens, topic_min_similarity, cache_max_mb, verify_samples and
    source_min_similarity a number."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        scope = _scope(store, site, node)
        serial = store.configuration.set(scope, key, value, by="cli")
    click.echo(f"{key} = {value} for {scope}; desired state serial {serial}")


@settings.command("unset")
@common_options
@click.argument("key")
@_site
@_node
@config_errors_exit
def settings_unset(
    config_file: Path | None, data_dir: Path | None, key: str, site: str | None, node: str | None
) -> None:
    """Unset KEY at one scope (the next less specific one's value, or the node's own,
    applies again)."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        scope = _scope(store, site, node)
        serial = store.configuration.set(scope, key, None, by="cli")
    click.echo(f"{key} unset for {scope}; desired state serial {serial}")


@settings.command("show")
@common_options
@click.option("--node", default=None, help="The settings this node applies, and whence.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@config_errors_exit
def settings_show(
    config_file: Path | None, data_dir: Path | None, node: str | None, as_json: bool
) -> None:
    """Every value the hub sets, by scope; with --node, what that node should apply (with
    what rollouts in flight gave it), where each value came from, and whether its last
    heartbeat says it applied them."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        if node is None:
            rows = [
                {"scope": s.scope, "key": s.key, "value": s.value}
                for s in store.configuration.all()
            ]
            if as_json:
                click.echo(json.dumps(rows))
            for r in [] if as_json else rows:
                click.echo(f"{r['scope']:<24} {r['key']:<28} {r['value']}")
            return
        view = configuration_view(store.nodes.get(node), store.configuration)
    if as_json:
        click.echo(json.dumps(view))
        return
    for key, entry in view["values"].items():
        click.echo(f"{key:<28} {entry['value']:<36} ({entry['from']})")
    state = "applied" if view["applied"] else "not yet applied"
    click.echo(f"{view['node']}: {state} ({view['digest']})")


@settings.command("diff")
@common_options
@click.argument("node")
@config_errors_exit
def settings_diff(config_file: Path | None, data_dir: Path | None, node: str) -> None:
    """What NODE applies otherwise than the fleet-wide values say: its site's and its own
    values, and changes rollouts in flight gave it."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        found = store.nodes.get(node)
        values, origins = store.configuration.effective(found, store.configuration.staged(found))
        fleet = {s.key: s.value for s in store.configuration.all() if s.scope == "fleet"}
    for key in sorted(set(values) | set(fleet)):
        if values.get(key) != fleet.get(key):
            was = fleet.get(key, "(unset)")
            click.echo(f"{key}: {was} -> {values.get(key, '(unset)')} ({origins.get(key)})")
