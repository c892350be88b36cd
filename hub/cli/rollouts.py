"""`kvl hub releases …` and `kvl hub rollouts …`: image releases the hub holds, sites'
update windows, and staged rollouts of a release, of a deployment's new model or of a node
setting. The commands write the store; the serving hub's rollout loop moves each rollout
on."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hub.cli.common import hub_settings, opened_store, parse_duration
from hub.planning.rollout import STEPS
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from hub.settings import HubSettings
    from hub.state.rollouts import Rollout
    from hub.state.store import HubStore


def _checked(model: type[Any], values: dict[str, Any], hint: str | None = None) -> Any:
    """`values` as the operator API's request model reads them (the same bounds), or the
    command's error naming the first bad one."""
    from pydantic import ValidationError  # noqa: PLC0415

    try:
        return model.model_validate(values)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or hint
        raise click.BadParameter(f"{where}: {first['msg']}", param_hint=hint) from err


@click.group("releases")
def releases() -> None:
    """Image releases (RAUC bundles) the hub holds, and sites' update windows."""


@releases.command("add")
@common_options
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--version", required=True, help="The image version the bundle installs.")
@click.option("--notes", default="", help="Release notes.")
@config_errors_exit
def releases_add(
    config_file: Path | None, data_dir: Path | None, file: Path, *, version: str, notes: str
) -> None:
    """Keep a release bundle (copied under its sha256) to roll out."""
    from hub.api.requests import ReleaseQuery  # noqa: PLC0415
    from hub.releases import keep_file  # noqa: PLC0415

    q = _checked(ReleaseQuery, {"version": version, "notes": notes})
    settings = hub_settings(config_file, data_dir)
    sha256, size = keep_file(settings.artifacts_dir, file)
    with opened_store(settings) as store:
        release = store.rollouts.add_release(q.version, q.notes, sha256, size)
    click.echo(f"release {release.version}: {size} bytes, sha256 {sha256}")


@releases.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@config_errors_exit
def releases_list(config_file: Path | None, data_dir: Path | None, *, as_json: bool) -> None:
    """Releases, newest first, with how many nodes have each as their target."""
    from hub.rollouts import release_view  # noqa: PLC0415

    with opened_store(hub_settings(config_file, data_dir)) as store:
        found = store.rollouts.releases()
        given = store.rollouts.node_release_versions()
    for r in found:
        view = release_view(r, sum(1 for v in given.values() if v == r.version))
        if as_json:
            click.echo(json.dumps(view))
        else:
            click.echo(f"{r.version}  {r.size_bytes} bytes  on {view['nodes']} node(s)  {r.notes}")


@releases.command("show")
@common_options
@click.argument("version")
@config_errors_exit
def releases_show(config_file: Path | None, data_dir: Path | None, version: str) -> None:
    """One release, as JSON."""
    from hub.rollouts import release_view  # noqa: PLC0415

    with opened_store(hub_settings(config_file, data_dir)) as store:
        release = store.rollouts.release(version)
        given = store.rollouts.release_nodes(version)
    click.echo(json.dumps(release_view(release, len(given)), indent=1))


@releases.command("window")
@common_options
@click.argument("site")
@click.option("--from", "start", default=None, help="HH:MM, UTC: updates from then…")
@click.option("--to", "end", default=None, help="…up to then (HH:MM, UTC).")
@click.option("--any-time", is_flag=True, help="No window: the site updates at any time.")
@config_errors_exit
def releases_window(
    config_file: Path | None,
    data_dir: Path | None,
    site: str,
    *,
    start: str | None,
    end: str | None,
    any_time: bool,
) -> None:
    """When a site's nodes may fetch and install a release."""
    from hub.api.requests import WindowRequest  # noqa: PLC0415

    if any_time == (start is not None or end is not None):
        raise click.UsageError("give --from and --to, or --any-time")
    window = None if any_time else _checked(WindowRequest, {"start": start, "end": end}).window()
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.rollouts.set_update_window(site, window)
    when = "updates at any time" if window is None else f"{start}-{end} UTC"
    click.echo(f"site {site}: {when}")


_UNITS = {"": 1, "k": 1000, "M": 1000**2, "G": 1000**3}


def _rate(text: str) -> int:
    """`2M`, `500k`, `1000000`: bytes a second."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError as err:
        raise click.BadParameter(f"{text!r} is not a rate (500k, 2M, 1G)") from err
    return int(value)


@releases.command("bandwidth")
@common_options
@click.argument("site")
@click.option("--rate", default=None, help="Bytes a second, shared by the site's nodes: 500k, 2M.")
@click.option("--unlimited", is_flag=True, help="No limit: the site's nodes fetch at full speed.")
@config_errors_exit
def releases_bandwidth(
    config_file: Path | None,
    data_dir: Path | None,
    site: str,
    *,
    rate: str | None,
    unlimited: bool,
) -> None:
    """How fast a site's nodes may fetch the hub's files (models, packages, releases)."""
    from hub.api.requests import BandwidthRequest  # noqa: PLC0415

    if unlimited == (rate is not None):
        raise click.UsageError("give --rate or --unlimited")
    limit = None
    if rate is not None:
        limit = _checked(BandwidthRequest, {"bytes_per_s": _rate(rate)}).bytes_per_s
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.rollouts.set_bandwidth(site, limit)
    click.echo(f"site {site}: " + ("no limit" if limit is None else f"{limit} bytes a second"))


@click.group("rollouts")
def rollouts() -> None:
    """Staged rollouts: a canary, then waves, each gated on its nodes' health."""


@rollouts.command("start")
@common_options
@click.option("--release", default=None, help="Roll out this release to the fleet.")
@click.option("--deployment", default=None, help="Or: move this deployment…")
@click.option("--model", default=None, help="…to this model (name@version).")
@click.option("--setting", default=None, help="Or: KEY=VALUE, a node setting (kvl hub settings).")
@click.option("--for-site", default=None, help="The setting for this site's nodes only.")
@click.option("--for-node", default=None, help="The setting for this node only.")
@click.option("--canary", type=int, default=1, show_default=True, help="Nodes in the canary.")
@click.option("--canary-node", "canary_nodes", multiple=True, help="A canary node (repeat).")
@click.option("--waves", default=None, help="Cumulative shares in %, e.g. 25,50,100.")
@click.option("--sites", "sites", multiple=True, help="A wave's sites, comma-separated (repeat).")
@click.option("--soak", default="5m", show_default=True, help="Healthy this long to count.")
@click.option("--max-unavailable", type=int, default=1, show_default=True)
@click.option("--offline-after", default="5m", show_default=True, help="Unheard: halt.")
@click.option("--max-burn-rate", type=float, default=14.4, show_default=True)
@click.option("--no-burn-gate", is_flag=True, help="Do not gate on objectives.")
@click.option("--min-requests", type=int, default=20, show_default=True)
@click.option(
    "--min-score", type=int, default=None, help="A model's evaluation must follow this many."
)
@config_errors_exit
def rollouts_start(
    config_file: Path | None,
    data_dir: Path | None,
    *,
    release: str | None,
    deployment: str | None,
    model: str | None,
    setting: str | None,
    for_site: str | None,
    for_node: str | None,
    canary: int,
    canary_nodes: tuple[str, ...],
    waves: str | None,
    sites: tuple[str, ...],
    soak: str,
    max_unavailable: int,
    offline_after: str,
    max_burn_rate: float,
    no_burn_gate: bool,
    min_requests: int,
    min_score: int | None,
) -> None:
    """Start a rollout of a release, of a deployment's new model, or of a node setting."""
    from hub.api.requests import RolloutRequest  # noqa: PLC0415
    from hub.rollouts import begin  # noqa: PLC0415

    strategy: dict[str, Any] = {
        "canary": canary,
        "canary_nodes": list(canary_nodes),
        "sites": [[s.strip() for s in group.split(",") if s.strip()] for group in sites],
        "soak_s": 0 if soak.strip() in {"0", "0s"} else parse_duration(soak),
        "max_unavailable": max_unavailable,
        "offline_after_s": parse_duration(offline_after),
        "max_burn_rate": None if no_burn_gate else max_burn_rate,
        "min_requests": min_requests,
        "min_score": min_score,
    }
    if waves is not None:
        try:
            strategy["waves"] = [float(w) for w in waves.split(",")]
        except ValueError as err:
            raise click.BadParameter("shares like 25,50,100", param_hint="--waves") from err
    kind = "release" if release is not None else "settings" if setting is not None else "model"
    body: dict[str, Any] = {"kind": kind, "release": release, "deployment": deployment,
                            "model": model, "strategy": strategy}  # fmt: skip
    if setting is not None:
        key, sep, value = setting.partition("=")
        if not sep:
            raise click.BadParameter(f"{setting!r} is not KEY=VALUE", param_hint="--setting")
        body |= {"setting": key, "value": value, "site": for_site, "node": for_node}
    req = _checked(RolloutRequest, body)
    settings = hub_settings(config_file, data_dir)
    with opened_store(settings) as store:
        rollout = begin(store, req.kind, req.target(), req.strategy.strategy(), "cli")
        _show(store, settings, rollout, as_json=False)


def _show(store: HubStore, settings: HubSettings, rollout: Rollout, *, as_json: bool) -> None:
    from hub.rollouts import rollout_view  # noqa: PLC0415

    nodes = {n.id: n for n in store.nodes.all()}
    view = rollout_view(rollout, nodes, settings, time.time())
    if as_json:
        click.echo(json.dumps(view))
        return
    t = view["target"]
    target = t.get("release") or (
        f"{t['key']}={t['value']} at {t['scope']}"
        if view["kind"] == "settings"
        else f"{t.get('model')} to {t.get('deployment')}"
    )
    click.echo(f"rollout {view['id']} ({view['kind']} {target}): {view['phase']}")
    if view["reason"]:
        click.echo(f"  {view['reason']}")
    for wave in view["waves"]:
        click.echo(f"  {wave['name']}: {wave['updated']}/{len(wave['nodes'])} updated")
        for n in wave["nodes"]:
            note = f" ({n['note']})" if n["note"] else ""
            click.echo(f"    {n['name']}  {n['state']}  {n['status']}{note}")


@rollouts.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@config_errors_exit
def rollouts_list(config_file: Path | None, data_dir: Path | None, *, as_json: bool) -> None:
    """Rollouts, newest first, with each wave's nodes."""
    settings = hub_settings(config_file, data_dir)
    with opened_store(settings) as store:
        for rollout in store.rollouts.all():
            _show(store, settings, rollout, as_json=as_json)


@rollouts.command("show")
@common_options
@click.argument("rollout_id")
@click.option("--json", "as_json", is_flag=True, help="As JSON.")
@config_errors_exit
def rollouts_show(
    config_file: Path | None, data_dir: Path | None, rollout_id: str, *, as_json: bool
) -> None:
    """One rollout, with each wave's nodes and what they report."""
    settings = hub_settings(config_file, data_dir)
    with opened_store(settings) as store:
        _show(store, settings, store.rollouts.get(rollout_id), as_json=as_json)


def _step(action: str) -> click.Command:
    @common_options
    @click.argument("rollout_id")
    @config_errors_exit
    def command(config_file: Path | None, data_dir: Path | None, rollout_id: str) -> None:
        from hub.rollouts import take_step  # noqa: PLC0415

        settings = hub_settings(config_file, data_dir)
        with opened_store(settings) as store:
            rollout = take_step(store, settings, rollout_id, action, by="cli", now=time.time())
            _show(store, settings, rollout, as_json=False)

    command.__doc__ = {
        "pause": "Pause a rollout: no node more is reached until it is resumed.",
        "resume": "Resume a paused or halted rollout.",
        "abort": "Abort a rollout: the nodes it reached get what they had before.",
        "finish": (
            "Finish a rolling-back rollout now: the nodes that never reported what they had "
            "before are recorded as never confirmed."
        ),
    }[action]
    return click.command(action)(command)


for _action in STEPS:
    rollouts.add_command(_step(_action))
