"""`kvl hub …`: serve the hub, and manage enrollment tokens and nodes."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import yaml

from hub.console.cli import admin
from hub.settings import EXAMPLE_HEADER, HubSettings
from shared.cli import common_options, config_errors_exit, settings_from
from shared.config import example_yaml

if TYPE_CHECKING:
    from hub.state.store import HubStore

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_duration(text: str) -> float:
    """`90s`, `30m`, `24h`, `7d`, `2w` (or a bare number of seconds) in seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is not a duration like 30m, 24h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


@click.group("hub")
def hub() -> None:
    """The hub of the fleet."""


def _settings(config_file: Path | None, data_dir: Path | None, **server: Any) -> HubSettings:
    return settings_from(HubSettings, config_file, data_dir, **server)


def _store(settings: HubSettings) -> HubStore:
    from hub.state.store import open_store  # noqa: PLC0415 - keep `kvl hub config` light
    from shared.sql import DatabaseError  # noqa: PLC0415

    try:
        return open_store(settings)
    except DatabaseError as err:  # PostgreSQL unreachable, or refusing us
        raise click.ClickException(f"{err} (database_url in the settings)") from err


@hub.command("config")
@common_options
@click.option("--example", is_flag=True, help="Print the commented example config instead.")
@config_errors_exit
def show_config(config_file: Path | None, data_dir: Path | None, example: bool) -> None:
    """Validate the hub configuration and print the effective settings."""
    if example:
        click.echo(example_yaml(HubSettings, EXAMPLE_HEADER), nl=False)
        return
    settings = _settings(config_file, data_dir)
    click.echo(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), nl=False)


@hub.command()
@common_options
@click.option("--host", default=None, help="Listen address (overrides server.host).")
@click.option("--port", type=int, default=None, help="Listen port (overrides server.port).")
@config_errors_exit
def serve(
    config_file: Path | None, data_dir: Path | None, host: str | None, port: int | None
) -> None:
    """Serve the hub API over HTTPS; prints the certificate fingerprint appliances pin."""
    import logging  # noqa: PLC0415

    from aiohttp import web  # noqa: PLC0415

    from hub.app import create_app, freeze_heap  # noqa: PLC0415
    from hub.identity import certificates, overlay_address, ssl_context  # noqa: PLC0415

    settings = _settings(config_file, data_dir, host=host, port=port)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    app = create_app(settings)
    app.on_startup.append(freeze_heap)  # after the store and the tasks have started
    _, server = certificates(settings)
    click.echo(
        f"kvl hub: serving https://{settings.server.host}:{settings.server.port} "
        f"(certificate {server.fingerprint}; data in {settings.data_dir})",
        err=True,
    )
    # Nodes reach the API through the tunnel too, at the hub's overlay address.
    hosts = [settings.server.host]
    if settings.overlay.interface is not None:
        hosts.append(str(overlay_address(settings).ip))
    web.run_app(
        app,
        host=hosts,
        port=settings.server.port,
        ssl_context=ssl_context(settings),
        print=None,
        access_log=None,
    )


@hub.group()
def tokens() -> None:
    """Enrollment tokens (only a hash is stored)."""


@tokens.command("create")
@common_options
@click.option("--site", required=True, help="The site the enrolled nodes belong to.")
@click.option("--uses", type=click.IntRange(1, 100_000), default=1, help="Enrollments (1).")
@click.option("--expires", default="24h", help="Lifetime: 30m, 24h, 7d … (24h).")
@config_errors_exit
def tokens_create(
    config_file: Path | None, data_dir: Path | None, site: str, uses: int, expires: str
) -> None:
    """Create a token; it is printed once, alone on stdout."""
    seconds = parse_duration(expires)
    store = _store(_settings(config_file, data_dir))
    try:
        new = store.create_token(site, uses=uses, expires_in_s=seconds)
    finally:
        store.close()
    click.echo(new.plaintext)


@hub.command()
@common_options
@click.option("--site", required=True, help="The site the node belongs to.")
@click.option("--name", required=True, help="The node's name.")
@click.option("--url", default=None, help="The hub API the node enrolls at (https://NAME:PORT).")
@click.option("--uses", type=click.IntRange(1, 100_000), default=1, help="Enrollments (1).")
@click.option("--expires", default="24h", help="Lifetime of its token: 30m, 24h, 7d … (24h).")
@click.option(
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the file here (mode 0600) instead of printing it.",
)
@config_errors_exit
def provision(
    config_file: Path | None,
    data_dir: Path | None,
    *,
    site: str,
    name: str,
    url: str | None,
    uses: int,
    expires: str,
    output: Path | None,
) -> None:
    """Make a provisioning file (kovenlab.json) for a node: a new enrollment token, the
    hub's URL and the fingerprint of its certificate, which the node pins."""
    from pydantic import ValidationError  # noqa: PLC0415

    from hub.identity import certificates  # noqa: PLC0415
    from shared.files import write_private  # noqa: PLC0415
    from shared.provisioning import Provisioning  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    url = url or f"https://{settings.server.names[0]}:{settings.server.port}"
    seconds = parse_duration(expires)
    _, server = certificates(settings)
    try:  # checked before a token is made for it
        document = Provisioning(
            hub_url=url,
            token="-",  # noqa: S106 - a placeholder, replaced below
            hub_fingerprint=server.fingerprint,
            name=name,
        )
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise click.BadParameter(problems) from err
    store = _store(settings)
    try:
        token = store.create_token(site, uses=uses, expires_in_s=seconds).plaintext
    finally:
        store.close()
    document = document.model_copy(update={"token": token})
    text = document.model_dump_json(indent=2) + "\n"
    if output is None:
        click.echo(text, nl=False)
        return
    write_private(output, text)  # it holds a token
    click.echo(f"wrote {output} (node {name}, site {site}, hub {url})", err=True)


@tokens.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def tokens_list(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List tokens: prefix, site, uses left, expiry, state."""
    store = _store(_settings(config_file, data_dir))
    try:
        rows = store.tokens()
    finally:
        store.close()
    now = time.time()
    for token in rows:
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(token.expires_at))
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "prefix": token.prefix,
                        "site": token.site,
                        "uses_left": token.uses_left,
                        "expires_at": expires,
                        "state": token.state(now),
                    }
                )
            )
        else:
            click.echo(
                f"{token.prefix}  {token.site:<20} {token.uses_left:>5} left  {expires}  "
                f"{token.state(now)}"
            )


@tokens.command("revoke")
@common_options
@click.argument("prefix")
@config_errors_exit
def tokens_revoke(config_file: Path | None, data_dir: Path | None, prefix: str) -> None:
    """Revoke a token by its prefix (or the whole token)."""
    from hub.state.store import NotFoundError  # noqa: PLC0415
    from shared.keys import ENROLLMENT_TOKEN, parse_prefix  # noqa: PLC0415

    prefix = parse_prefix(prefix, ENROLLMENT_TOKEN) or prefix
    store = _store(_settings(config_file, data_dir))
    try:
        token = store.revoke_token(prefix)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"revoked {token.prefix} (site {token.site})")


@hub.group()
def nodes() -> None:
    """The node registry."""


@nodes.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def nodes_list(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List nodes: name, site, status (online, stale, offline, revoked), address, last seen."""
    from hub.views import node_view  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    store = _store(settings)
    try:
        rows = store.nodes()
    finally:
        store.close()
    now = time.time()
    for node in rows:
        view = node_view(node, settings, now)
        if as_json:
            click.echo(json.dumps(view))
        else:
            seen = "never" if node.last_seen is None else f"{now - node.last_seen:.0f} s ago"
            click.echo(
                f"{node.name:<20} {node.site:<16} {view['status']:<8} "
                f"{node.overlay_address:<15} {seen}"
            )


@nodes.command("revoke")
@common_options
@click.argument("node")
@config_errors_exit
def nodes_revoke(config_file: Path | None, data_dir: Path | None, node: str) -> None:
    """Revoke a node (by id or name): its calls are refused from now on."""
    from hub.state.store import NotFoundError  # noqa: PLC0415

    store = _store(_settings(config_file, data_dir))
    try:
        revoked = store.revoke_node(node)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"revoked {revoked.name} ({revoked.id})")


@hub.group()
def accounts() -> None:
    """Accounts of the fleet: service class and quotas, pushed to every node."""


@accounts.command("set")
@common_options
@click.argument("name")
@click.option(
    "--class", "service_class", type=click.Choice(["S0", "S1", "S2", "S3", "S4"]), default="S1"
)
@click.option("--rpm", type=click.IntRange(0), default=None, help="Requests per minute.")
@click.option("--tokens-per-day", type=click.IntRange(0), default=None, help="Tokens per day.")
@click.option(
    "--budget-tokens",
    type=click.IntRange(0),
    default=None,
    help="A global budget across the fleet, spent by nodes through leases (unset: none).",
)
@click.option("--budget-period", default="1d", help="The budget's period: 1h, 1d, 7d … (1d).")
@config_errors_exit
def accounts_set(
    config_file: Path | None,
    data_dir: Path | None,
    name: str,
    *,
    service_class: str,
    rpm: int | None,
    tokens_per_day: int | None,
    budget_tokens: int | None,
    budget_period: str,
) -> None:
    """Create or change an account (unset quotas: the class's defaults; each node
    enforces them on its own, while a budget holds across the fleet)."""
    from hub.planning.quota import Budget  # noqa: PLC0415

    period_s = parse_duration(budget_period)
    budget = None if budget_tokens is None else Budget(budget_tokens, period_s)
    store = _store(_settings(config_file, data_dir))
    try:
        serial = store.set_account(
            name,
            service_class,
            requests_per_minute=rpm,
            tokens_per_day=tokens_per_day,
            budget=budget,
        )
    finally:
        store.close()
    click.echo(f"account {name} ({service_class}); desired state serial {serial}")


@accounts.command("list")
@common_options
@config_errors_exit
def accounts_list(config_file: Path | None, data_dir: Path | None) -> None:
    """List accounts: name, class, quotas."""
    store = _store(_settings(config_file, data_dir))
    try:
        rows = store.accounts()
    finally:
        store.close()
    for row in rows:
        budget = "-"
        if row["budget_tokens"] is not None:
            budget = f"{row['budget_tokens']} per {row['budget_period_s']:g} s"
        click.echo(
            f"{row['name']:<24} {row['service_class']}  rpm {row['requests_per_minute'] or '-'}  "
            f"tokens/day {row['tokens_per_day'] or '-'}  budget {budget}"
        )


@accounts.command("quota")
@common_options
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@config_errors_exit
def accounts_quota(
    config_file: Path | None, data_dir: Path | None, name: str, as_json: bool
) -> None:
    """An account's budget this period: consumed (in the ledger), leased per node, left."""
    from hub.views import quota_view  # noqa: PLC0415

    store = _store(_settings(config_file, data_dir))
    try:
        quota = store.quota(name, time.time())
        names = {n.id: n.name for n in store.nodes()}
    finally:
        store.close()
    if quota is None:
        raise click.ClickException(
            f"account {name!r} has no budget (kvl hub accounts set --budget-tokens)"
        )
    view = quota_view(quota, names)
    if as_json:
        click.echo(json.dumps(view))
        return
    click.echo(
        f"{name}: budget {view['budget_tokens']} per {view['period_s']:g} s, "
        f"consumed {view['consumed']}, leased {sum(view['leased'].values())}, "
        f"remaining {view['remaining']} (period ends {view['period_end']})"
    )
    for node, tokens in sorted(view["leased"].items()):
        click.echo(f"  {node:<24} leased {tokens}")


@hub.group("keys")
def hub_keys() -> None:
    """API keys of fleet accounts (only hashes go to the nodes)."""


@hub_keys.command("create")
@common_options
@click.option("--account", required=True, help="An account made with `kvl hub accounts set`.")
@click.option("--admin", is_flag=True, help="The key may use the appliances' /v1/admin routes.")
@config_errors_exit
def keys_create(config_file: Path | None, data_dir: Path | None, account: str, admin: bool) -> None:
    """Create a key; it is printed once, alone on stdout."""
    from hub.state.store import NotFoundError  # noqa: PLC0415

    store = _store(_settings(config_file, data_dir))
    try:
        new = store.create_key(account, admin=admin)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(new.plaintext)


@hub_keys.command("revoke")
@common_options
@click.argument("prefix")
@config_errors_exit
def keys_revoke(config_file: Path | None, data_dir: Path | None, prefix: str) -> None:
    """Revoke a key by its prefix (or the whole key) on every node."""
    from hub.state.store import NotFoundError  # noqa: PLC0415
    from shared.keys import parse_prefix  # noqa: PLC0415

    prefix = parse_prefix(prefix) or prefix
    store = _store(_settings(config_file, data_dir))
    try:
        serial = store.revoke_key(prefix)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"revoked {prefix}; desired state serial {serial}")


@hub.command()
@common_options
@click.option("--nodes", "count", type=click.IntRange(1, 1_000_000), required=True,
              help="Simulated appliances.")  # fmt: skip
@click.option("--url", "urls", multiple=True,
              help="A hub replica (https://NAME:PORT; default from settings); repeat it for "
                   "several, and the nodes are spread over them.")  # fmt: skip
@click.option("--interval", type=click.FloatRange(0.1, 3600), default=15.0,
              help="Seconds between a node's heartbeats (15).")  # fmt: skip
@click.option("--duration", type=click.FloatRange(1, 86_400), default=60.0,
              help="Seconds of heartbeats (60).")  # fmt: skip
@click.option("--events", type=click.IntRange(0, 5000), default=1,
              help="Usage events each node syncs once an interval, half an interval after "
                   "its heartbeat (1; 0: no sync).")  # fmt: skip
@click.option("--resend", type=click.FloatRange(0, 1), default=0.01,
              help="Share of syncs sent again to another replica, as after a lost "
                   "acknowledgement (0.01).")  # fmt: skip
@click.option("--connections", type=click.IntRange(1, 10_000), default=100,
              help="HTTPS connections the nodes share (100).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@config_errors_exit
def simulate(
    config_file: Path | None,
    data_dir: Path | None,
    *,
    count: int,
    urls: tuple[str, ...],
    interval: float,
    duration: float,
    events: int,
    resend: float,
    connections: int,
    as_json: bool,
) -> None:
    """Enroll simulated appliances with a running hub (one or several replicas), then
    heartbeat and sync from all of them; prints latencies. Run it beside the hub (it makes
    a token in the hub's database, with the hub's settings); the hub must take node calls
    from any address (server.require_overlay_source: false)."""
    import asyncio  # noqa: PLC0415

    from hub.identity import certificates  # noqa: PLC0415
    from hub.simulate import Simulator  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    targets = list(urls) or [f"https://{settings.server.names[0]}:{settings.server.port}"]
    _, server = certificates(settings)
    store = _store(settings)
    try:
        token = store.create_token("simulated", uses=count, expires_in_s=3600).plaintext
        # The account the simulated usage is for: a node may report only the fleet's.
        if "simulated" not in {a["name"] for a in store.accounts()}:
            store.set_account("simulated", "S1")
    finally:
        store.close()

    async def run() -> dict[str, Any]:
        async with Simulator(targets, server.fingerprint, connections=connections) as sim:
            started = time.perf_counter()
            nodes, enrolled = await sim.enroll(token, count)
            enroll_s = time.perf_counter() - started
            # On stderr even with --json: a benchmark watching it knows the load begins.
            click.echo(f"enrolled {len(nodes)} of {count} nodes in {enroll_s:.1f} s", err=True)
            cpu = time.process_time()
            load = await sim.run(
                nodes, interval_s=interval, duration_s=duration, events=events, resend=resend
            )
            cpu = time.process_time() - cpu
        measured = load.summary()
        calls = measured["heartbeats"]["calls"] + measured["sync"]["calls"]
        return {
            "nodes": count,
            "replicas": len(targets),
            "interval_s": interval,
            "duration_s": duration,
            "connections": connections,
            "enrollment": {**enrolled.summary(), "seconds": round(enroll_s, 2)},
            "send_lag_ms": measured["send_lag_ms"],
            "heartbeats": {**measured["heartbeats"], "per_s": round(count / interval, 1)},
            "sync": {**measured["sync"], "per_s": round(count / interval, 1) if events else 0},
            # The simulator's own CPU per call under the load: what offering it costs.
            "simulator_cpu_ms_per_call": round(cpu * 1000 / calls, 3) if calls else None,
        }

    report = asyncio.run(run())
    if as_json:
        click.echo(json.dumps(report))
        return
    for name in ("heartbeats", "sync"):
        calls = report[name]
        if not calls["calls"]:
            continue
        click.echo(
            f"{name}: {calls['ok']} ok, failed {calls['failed'] or 'none'}; "
            f"{calls['per_s']}/s; p50 {calls['p50_ms']} ms, p99 {calls['p99_ms']} ms, "
            f"max {calls['max_ms']} ms"
        )
    if events:
        sync = report["sync"]
        click.echo(
            f"events: {sync['events']} sent, {sync['resent']} resent, {sync['new']} new "
            "at the hub" + ("" if sync["new"] == sync["events"] else " (not each once!)")
        )


@hub.group("models")
def hub_models() -> None:
    """Model files the hub places on nodes (stored by sha256, fetched through the tunnel)."""


@hub_models.command("add")
@common_options
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--name", required=True, help="Model name (as clients ask for it).")
@click.option("--version", required=True, help="Its version: deployments name `name@version`.")
@click.option(
    "--memory-mib",
    type=click.IntRange(1),
    default=None,
    help="What one replica needs on a node (default: the file's size plus 512 MiB).",
)
@config_errors_exit
def models_add(
    config_file: Path | None,
    data_dir: Path | None,
    file: Path,
    *,
    name: str,
    version: str,
    memory_mib: int | None,
) -> None:
    """Register a GGUF file: copied into the hub's data directory under its sha256."""
    import hashlib  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from hub.state.store import ConflictError, ModelArtifact  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    digest = hashlib.sha256()
    with file.open("rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    size = file.stat().st_size
    settings.artifacts_dir.mkdir(parents=True, exist_ok=True)
    target = settings.artifacts_dir / sha256
    if not target.exists():
        partial = target.with_suffix(".part")
        shutil.copyfile(file, partial)
        partial.replace(target)
    model = ModelArtifact(name, version, sha256, size, "gguf", memory_mib or (size >> 20) + 512)
    store = _store(settings)
    try:
        store.add_model(model)
    except ConflictError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(
        f"model {model.ref}: sha256 {sha256}, {size >> 20} MiB, {model.memory_mib} MiB a replica"
    )


@hub_models.command("list")
@common_options
@config_errors_exit
def models_list(config_file: Path | None, data_dir: Path | None) -> None:
    """List the models: ref, sha256, size, memory a replica."""
    store = _store(_settings(config_file, data_dir))
    try:
        rows = store.models()
    finally:
        store.close()
    for m in rows:
        click.echo(
            f"{m.ref:<32} {m.sha256[:16]}  {m.size_bytes >> 20} MiB  {m.memory_mib} MiB/replica"
        )


@hub.group("packages")
def hub_packages() -> None:
    """Content packages across the fleet, and the archives the hub seeds to nodes."""


@hub_packages.command("add")
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

    settings = _settings(config_file, data_dir)
    store = _store(settings)
    try:
        record = add_bundle(store, settings.artifacts_dir, file.read_bytes())
        if seed:
            store.seed_package(record.id, record.version, site)
    except LayoutError as err:
        raise click.ClickException(f"{file}: not a package archive: {err}") from err
    finally:
        store.close()
    where = f" and seeded to {site or 'every node'}" if seed else ""
    click.echo(f"package {record.id}@{record.version} ({record.title}): kept{where}")


@hub_packages.command("list")
@common_options
@click.option("--query", "-q", default=None, help="Only ids, titles or topics with this.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@config_errors_exit
def packages_list(
    config_file: Path | None, data_dir: Path | None, *, query: str | None, as_json: bool
) -> None:
    """Packages the fleet reported or the hub holds: where each is, where it is seeded."""
    from hub.views import package_view  # noqa: PLC0415

    store = _store(_settings(config_file, data_dir))
    try:
        found = store.packages(query)
        names = {n.id: n.name for n in store.nodes()}
    finally:
        store.close()
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


@hub_packages.command("seed")
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
    from hub.state.store import NotFoundError  # noqa: PLC0415

    store = _store(_settings(config_file, data_dir))
    try:
        store.seed_package(package_id, version, site)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"seeding {package_id} to {site or 'every node'}")


@hub_packages.command("unseed")
@common_options
@click.argument("package_id")
@click.option("--version", default=None, help="The version (default: every version).")
@config_errors_exit
def packages_unseed(
    config_file: Path | None, data_dir: Path | None, package_id: str, *, version: str | None
) -> None:
    """Stop seeding a package: nodes unpin it, and their caches may evict it."""
    from hub.state.store import NotFoundError  # noqa: PLC0415

    store = _store(_settings(config_file, data_dir))
    try:
        store.unseed_package(package_id, version)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"no longer seeding {package_id}")


@hub.command()
@common_options
@click.argument("model")
@click.option("--replicas", type=click.IntRange(0, 10_000), default=1, help="Across the fleet (1).")
@click.option(
    "--class", "service_class", type=click.Choice(["S0", "S1", "S2", "S3", "S4"]), default="S1"
)
@click.option("--site", "sites", multiple=True, help="Only these sites (repeat).")
@click.option("--region", "regions", multiple=True, help="Only these regions (repeat).")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE a node must carry (repeat).")
@click.option("--gpu", is_flag=True, help="Needs a GPU.")
@click.option("--gpu-memory-mib", type=click.IntRange(0), default=0, help="GPU memory needed.")
@click.option("--tenant", default=None, help="S3: only nodes dedicated to this tenant.")
@config_errors_exit
def deploy(
    config_file: Path | None,
    data_dir: Path | None,
    model: str,
    *,
    replicas: int,
    service_class: str,
    sites: tuple[str, ...],
    regions: tuple[str, ...],
    labels: tuple[str, ...],
    gpu: bool,
    gpu_memory_mib: int,
    tenant: str | None,
) -> None:
    """Deploy MODEL (name@version) on the fleet; the placement reconciler picks the nodes.
    Prints the deployment's id."""
    import uuid  # noqa: PLC0415

    from hub.state.store import DeploymentRecord, NotFoundError  # noqa: PLC0415

    if service_class == "S3" and not tenant:
        raise click.BadParameter("an S3 (dedicated) deployment names its --tenant")
    pairs = {}
    for label in labels:
        key, sep, value = label.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{label!r} is not KEY=VALUE", param_hint="--label")
        pairs[key] = value
    record = DeploymentRecord(
        id=uuid.uuid4().hex[:12],
        model=model,
        replicas=replicas,
        service_class=service_class,
        isolation="I1",
        constraints={"sites": list(sites), "regions": list(regions), "labels": pairs,
                     "gpu": gpu, "gpu_memory_mib": gpu_memory_mib, "tenant": tenant},
    )  # fmt: skip
    store = _store(_settings(config_file, data_dir))
    try:
        store.deploy(record)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(record.id)


@hub.command()
@common_options
@click.argument("deployment")
@config_errors_exit
def undeploy(config_file: Path | None, data_dir: Path | None, deployment: str) -> None:
    """Remove a deployment: its replicas are unloaded from the nodes."""
    from hub.state.store import NotFoundError  # noqa: PLC0415

    store = _store(_settings(config_file, data_dir))
    try:
        serial = store.undeploy(deployment)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"undeployed {deployment}; desired state serial {serial}")


@hub.command("deployments")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def deployments_list(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List deployments: model, replicas wanted and where they run."""
    store = _store(_settings(config_file, data_dir))
    try:
        rows = store.deployments()
        placed = store.placements()
        names = {n.id: n.name for n in store.nodes()}
    finally:
        store.close()
    from hub.views import deployment_view  # noqa: PLC0415

    for d in rows:
        view = deployment_view(d, placed, names)
        nodes = view["nodes"]
        if as_json:
            click.echo(json.dumps(view))
        else:
            click.echo(
                f"{d.id:<14} {d.model:<28} {d.service_class} {len(nodes)}/{d.replicas}  "
                f"{', '.join(nodes) or '-'}"
            )


@nodes.command("drain")
@common_options
@click.argument("node")
@click.option("--undo", is_flag=True, help="Take the node back into placement.")
@config_errors_exit
def nodes_drain(config_file: Path | None, data_dir: Path | None, node: str, undo: bool) -> None:
    """Drain a node: its replicas move elsewhere and it gets no new ones (--undo ends it)."""
    from hub.state.store import NotFoundError  # noqa: PLC0415

    store = _store(_settings(config_file, data_dir))
    try:
        done = store.set_draining(node, draining=not undo)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"{done.name} {'drains' if done.draining else 'takes replicas again'}")


@hub.group()
def operators() -> None:
    """Operator tokens for the hub's admin API (/v1/admin) and its console."""


@operators.command("create")
@common_options
@click.option("--name", required=True, help="Who or what holds it.")
@config_errors_exit
def operators_create(config_file: Path | None, data_dir: Path | None, name: str) -> None:
    """Create an operator token; it is printed once, alone on stdout."""
    store = _store(_settings(config_file, data_dir))
    try:
        new = store.create_operator(name)
    finally:
        store.close()
    click.echo(new.plaintext)


@operators.command("revoke")
@common_options
@click.argument("prefix")
@config_errors_exit
def operators_revoke(config_file: Path | None, data_dir: Path | None, prefix: str) -> None:
    """Revoke an operator token by its prefix (or the whole token)."""
    from hub.state.store import NotFoundError  # noqa: PLC0415
    from shared.keys import OPERATOR_TOKEN, parse_prefix  # noqa: PLC0415

    prefix = parse_prefix(prefix, OPERATOR_TOKEN) or prefix
    store = _store(_settings(config_file, data_dir))
    try:
        store.revoke_operator(prefix)
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"revoked {prefix}")


hub.add_command(admin)  # `kvl hub admin …`: the console's users (hub/console/cli.py)
