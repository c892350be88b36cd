"""`kvl hub config`, `kvl hub serve` and `kvl hub simulate`: the hub's settings, the hub
itself, and a simulated fleet to load it with."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import click
import yaml

from hub.cli.common import hub_settings, opened_store
from hub.settings import EXAMPLE_HEADER, HubSettings
from shared.cli import common_options, config_errors_exit
from shared.config import example_yaml

if TYPE_CHECKING:
    from pathlib import Path


@click.command("config")
@common_options
@click.option("--example", is_flag=True, help="Print the commented example config instead.")
@config_errors_exit
def show_config(config_file: Path | None, data_dir: Path | None, example: bool) -> None:
    """Validate the hub configuration and print the effective settings."""
    if example:
        click.echo(example_yaml(HubSettings, EXAMPLE_HEADER), nl=False)
        return
    settings = hub_settings(config_file, data_dir)
    click.echo(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), nl=False)


@click.command("serve")
@common_options
@click.option("--host", default=None, help="Listen address (overrides server.host).")
@click.option("--port", type=int, default=None, help="Listen port (overrides server.port).")
@config_errors_exit
def serve(
    config_file: Path | None, data_dir: Path | None, host: str | None, port: int | None
) -> None:
    """Serve the hub API over HTTPS; prints the fingerprint of the hub's CA, which
    provisioning files pin."""
    import logging  # noqa: PLC0415

    from aiohttp import web  # noqa: PLC0415

    from hub.app import create_app, freeze_heap, freezing  # noqa: PLC0415
    from hub.appkeys import TLS  # noqa: PLC0415
    from hub.identity import overlay_address  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir, host=host, port=port)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    app = create_app(settings)
    app.on_startup.append(freeze_heap)  # after the store and the tasks have started
    app.cleanup_ctx.append(freezing)
    hub_tls = app[TLS]
    click.echo(
        f"kvl hub: serving https://{settings.server.host}:{settings.server.port} "
        f"(CA {hub_tls.phase.signing.fingerprint}; data in {settings.data_dir})",
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
        ssl_context=hub_tls.server.outer,  # its certificate and trust follow pki/
        print=None,
        access_log=None,
    )


@click.command("simulate")
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
@click.option("--connections", type=click.IntRange(0, 1_000_000), default=None,
              help="HTTPS connections the nodes may hold at once (0: no limit). Default: "
                   "each node its own (with certificates), 100 shared (without).")  # fmt: skip
@click.option("--reconnect", is_flag=True,
              help="A new connection, so a full TLS handshake, for every call.")  # fmt: skip
@click.option("--certificates/--no-certificates", default=True,
              help="Nodes enroll with a signing request and call with their certificates "
                   "(mutual TLS, protocol 3); without, token only, as before (a hub of an "
                   "earlier commit).")  # fmt: skip
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
    connections: int | None,
    certificates: bool,
    reconnect: bool,
    as_json: bool,
) -> None:
    """Enroll simulated appliances with a running hub (one or several replicas), then
    heartbeat and sync from all of them; prints latencies. Run it beside the hub (it makes
    a token in the hub's database, with the hub's settings); the hub must take node calls
    from any address (server.require_overlay_source: false)."""
    import asyncio  # noqa: PLC0415

    from hub.simulate import Simulator  # noqa: PLC0415
    from shared import pki  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir)
    targets = list(urls) or [f"https://{settings.server.names[0]}:{settings.server.port}"]
    # As the running hub made them (read, never issued again here: a hub of an earlier
    # commit keeps serving the certificate it loaded).
    ca, served = (
        pki.read_issued(settings.pki_dir, "ca"),
        pki.read_issued(settings.pki_dir, "server"),
    )
    if ca is None or served is None:
        raise click.ClickException(f"no hub has made its CA in {settings.pki_dir} yet")
    trust: bytes | str = ca.cert_pem if certificates else served.fingerprint
    if connections is None:
        connections = 0 if certificates else 100
    with opened_store(settings) as store:
        token = store.tokens.create("simulated", uses=count, expires_in_s=3600).plaintext
        # The account the simulated usage is for: a node may report only the fleet's.
        if "simulated" not in {a["name"] for a in store.accounts.all()}:
            store.accounts.put("simulated", "S1")

    async def run() -> dict[str, Any]:
        async with Simulator(targets, trust, connections=connections, reconnect=reconnect) as sim:
            started = time.perf_counter()
            nodes, enrolled = await sim.enroll(token, count)
            enroll_s = time.perf_counter() - started
            connected = await sim.connect(nodes)  # each node's connection, opened once
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
            "certificates": certificates,
            "reconnect": reconnect,
            "enrollment": {**enrolled.summary(), "seconds": round(enroll_s, 2)},
            "first_heartbeat": connected.summary(),  # with certificates: the handshakes
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
