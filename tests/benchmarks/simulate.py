"""A fleet simulator: many appliances, enrolled with a hub and heartbeating and syncing on
a schedule, from one process; benchmark tooling, not part of the hub. The fleet benchmark
(`tests/benchmarks/fleet.py`, `just bench fleet`) runs it as a command beside the hubs it
measures (``python -m tests.benchmarks.simulate --nodes N --url URL … --json``), and tests
of the hub drive :class:`Simulator` in-process.

Each simulated node enrolls as an appliance does (a WireGuard public key of its own and a
signing request, the hub verified by its CA) and then calls with its own certificate
(mutual TLS) over a connection of its own, kept alive, as an appliance's link does. It
sends a heartbeat every `interval_s` at a random phase
of its own, so a fleet of N sends N / interval_s heartbeats a second, evenly; with
`events`, half an interval after each heartbeat it syncs that many new usage events from
its outbox (`POST /v1/node/events`). Each heartbeat carries the node's objectives (protocol
4: three series of cumulative counters that grow with each beat, one of an account the
hub does not know), so the hub's flush counts deltas as under a real fleet. The load is
open loop: a call is sent at its time whether or not earlier ones were answered, and its
latency runs from that time, so a hub that falls behind shows it in the tail instead of
slowing the simulator down (no coordinated omission).

Given several hub replicas (their URLs), the nodes are spread over them, each node
calling one; a share of syncs (`resend`) is sent a second time to another replica, as a
node does when an acknowledgement was lost, and the hub must count those events once.

The simulator is not the appliance's client: it skips the tunnel (the hub must accept
node calls from any address, `server.require_overlay_source: false`). Without
certificates (`certificates=False`: nodes as they were before protocol 3, token only,
the hub's own certificate pinned) its nodes share a pool of HTTPS connections, as a proxy
in front of the hub would; that is how a hub of an earlier commit is measured.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import json
import random
import ssl
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import click
from wireguard_tools import WireguardKey

from hub.cli.common import hub_settings, opened_store
from shared import __version__, pki, protocol, tls
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from collections.abc import Coroutine, Sequence

VERSIONS = {"kvl": __version__}
Verification = ssl.SSLContext | aiohttp.Fingerprint
Caller = tuple[dict[str, str], Verification]  # a node's headers and TLS
_BEAT, _SYNC = 0, 1  # what a node's scheduled call is


@dataclass(frozen=True)
class SimulatedNode:
    node_id: str
    token: str
    url: str = ""  # the hub replica it calls
    tls: ssl.SSLContext | aiohttp.Fingerprint | None = None  # its own certificate


@dataclass
class Latencies:
    """Seconds per call, and the calls that failed (by status or exception name)."""

    seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.seconds)

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

        return {
            "calls": len(ordered) + sum(self.failures.values()),
            "ok": len(ordered),
            "failed": dict(self.failures),
            "p50_ms": quantile(0.50),
            "p90_ms": quantile(0.90),
            "p99_ms": quantile(0.99),
            "max_ms": round(ordered[-1] * 1000, 2) if ordered else None,
            "mean_ms": round(statistics.fmean(ordered) * 1000, 2) if ordered else None,
        }


@dataclass
class Load:
    """What a run of the fleet measured: heartbeats, syncs, and the events the hub said
    were new (each sent once, resends included, should be new exactly once)."""

    heartbeats: Latencies
    sync: Latencies
    events_sent: int = 0  # distinct events
    events_resent: int = 0
    events_new: int = 0  # by the hub's answers
    # How late the simulator itself sent each call (its own loop's lag, in the latencies
    # too): large, and the simulator, not the hub, was the bottleneck.
    lag: Latencies = field(default_factory=Latencies)

    def summary(self) -> dict[str, Any]:
        lag = self.lag.summary()
        return {
            "send_lag_ms": {"p50": lag["p50_ms"], "p99": lag["p99_ms"], "max": lag["max_ms"]},
            "heartbeats": self.heartbeats.summary(),
            "sync": {
                **self.sync.summary(),
                "events": self.events_sent,
                "resent": self.events_resent,
                "new": self.events_new,
            },
        }


def _capacity(rng: random.Random) -> dict[str, Any]:
    """What an appliance's heartbeat carries (see appliance/fleet/link.py)."""
    return {
        "cpu_percent": round(rng.uniform(2, 95), 1),
        "cpu_count": 16,
        "memory_total_mib": 65_536,
        "memory_available_mib": rng.randint(8_000, 60_000),
        "models": ["gemma-3-270m@1.0.0"],
        "queue_waiting": rng.randint(0, 4),
        "outbox_lag": 0,
        "outbox_alarm": False,
    }


# The objectives' series each simulated node reports: (class, account), the second an
# account no hub knows (counted as "(other)").
_SERIES = (("S1", "simulated"), ("S0", "simulated"), ("S2", "elsewhere"))


def _objectives(index: int, beat: int) -> dict[str, Any]:
    """What an appliance's heartbeat carries of its objectives (protocol 4): cumulative
    counters that grow with each beat, as a node serving steadily reports them."""
    series = []
    for k, (service_class, account) in enumerate(_SERIES):
        n = beat * (k + 1)
        ttft = [0] * (len(protocol.LATENCY_BOUNDS_S) + 1)
        ttft[3] = 9 * n
        series.append(
            {
                "service_class": service_class,
                "account": account,
                "requests": 12 * n,
                "admitted": 10 * n,
                "refused": {"admit": n, "quota": n},
                "met": {"admit": 10 * n, "first_token": 9 * n, "complete": 9 * n},
                "missed": {"admit": n, "first_token": 2 * n, "complete": n},
                "ttft": {"counts": ttft, "sum_s": 3.0 * n},
            }
        )
    return {"epoch": f"sim-{index}", "series": series, "worker_restarts": beat // 100}


class Simulator:
    """``trust``: the hub's CA certificate (PEM: nodes with certificates, strictly
    verified), or the fingerprint of the hub's own certificate (`sha256:…`: nodes
    without certificates, as before protocol 3). ``connections``: how many the nodes
    may hold at once (0: no limit; each node with a certificate keeps its own);
    ``reconnect``: none kept, a TLS handshake for every call (the cost of one)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        trust: bytes | str,
        *,
        connections: int = 100,
        reconnect: bool = False,
    ) -> None:
        self._urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        self._trust = trust if isinstance(trust, bytes) else None
        self._ssl: ssl.SSLContext | aiohttp.Fingerprint = (
            tls.client_context(trust, identity=tls.hub_identity(None))
            if isinstance(trust, bytes)
            else aiohttp.Fingerprint(pki.fingerprint_bytes(trust))
        )
        self._session = aiohttp.ClientSession(
            # `reconnect`: a new connection (a full handshake) for every call.
            connector=(
                aiohttp.TCPConnector(limit=connections, force_close=True)
                if reconnect
                else aiohttp.TCPConnector(limit=connections, keepalive_timeout=60)
            ),
            timeout=aiohttp.ClientTimeout(total=30),
        )
        self._files = tempfile.TemporaryDirectory(prefix="kvl-simulated-")
        # Nodes without certificates are nodes of protocol 2, the version before them,
        # and send no objectives (protocol 4).
        self._objectives = self.certificates
        self._headers = (
            protocol.HEADERS
            if self.certificates
            else {protocol.PROTOCOL_HEADER: str(protocol.OLDEST_NODE_PROTOCOL)}
        )

    @property
    def certificates(self) -> bool:
        return self._trust is not None

    def _node_tls(self, index: int, key_pem: bytes, cert_pem: str) -> ssl.SSLContext:
        """A node's client context: Python loads a certificate from files only."""
        assert self._trust is not None
        folder = Path(self._files.name)
        pki.write_issued(folder, f"n{index}", pki.Issued(cert_pem.encode(), key_pem))
        # As a node does: the hub's URI, not only a certificate of the fleet's CA.
        context = tls.client_context(
            self._trust,
            (folder / f"n{index}.crt", folder / f"n{index}.key"),
            identity=tls.hub_identity(None),
        )
        (folder / f"n{index}.crt").unlink()
        (folder / f"n{index}.key").unlink()
        return context

    async def close(self) -> None:
        await self._session.close()
        self._files.cleanup()

    async def __aenter__(self) -> Simulator:
        if self.certificates:
            await self._speak_the_hubs_version()
        # No cyclic garbage collection while the simulator runs: with ten thousand nodes'
        # TLS contexts and connections live, a full collection held this loop for a
        # quarter of a second or more, and the latencies blamed the hub for it. What the
        # calls make is freed by reference counting; the rest waits for the end.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return self

    async def _speak_the_hubs_version(self) -> None:
        """The nodes speak the newest protocol both they and the hub know: a hub of an
        earlier commit (a benchmark's baseline) refuses a node newer than itself, and
        what the simulated nodes send is the same in every version since certificates, but
        the objectives (protocol 4), which a node of an earlier version does not send."""
        async with self._session.get(f"{self._urls[0]}/healthz", ssl=self._ssl) as response:
            health = await response.json(content_type=None)
        version = min(protocol.PROTOCOL_VERSION, int(health.get("protocol", 0)))
        if version < 3:
            raise RuntimeError(f"the hub speaks protocol {version}: certificates need 3")
        self._headers = {protocol.PROTOCOL_HEADER: str(version)}
        self._objectives = version >= protocol.ADDED_IN[protocol.HeartbeatRequest]["objectives"]

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
        if self._gc_was_enabled:
            gc.enable()

    async def enroll(
        self, token: str, count: int, *, prefix: str = "sim", concurrency: int = 16
    ) -> tuple[list[SimulatedNode], Latencies]:
        """Enroll `count` nodes with one token (of at least that many uses)."""
        nodes: list[SimulatedNode] = []
        latencies = Latencies()
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int) -> None:
            url = self._urls[index % len(self._urls)]
            async with gate:
                # The key is made inside the gate: made up front for every node, the keys
                # would hold the loop while the first calls' clocks ran.
                name = f"{prefix}-{index:06d}"
                body = {
                    "token": token,
                    "name": name,
                    "wg_public_key": str(WireguardKey.generate().public_key()),
                    "labels": {"simulated": "true"},
                    "versions": VERSIONS,
                }
                key_pem = b""
                if self.certificates:
                    key_pem, csr = pki.new_request([name])
                    body["lan_csr"] = csr.decode()
                started = time.perf_counter()
                try:
                    async with self._session.post(
                        f"{url}/v1/enroll", json=body, ssl=self._ssl, headers=self._headers
                    ) as response:
                        answer = await response.json(content_type=None)
                        if response.status != 201:
                            latencies.fail(str(response.status))
                            return
                except (aiohttp.ClientError, TimeoutError) as err:
                    latencies.fail(type(err).__name__)
                    return
                latencies.seconds.append(time.perf_counter() - started)
                context = (
                    self._node_tls(index, key_pem, answer["lan_certificate"])
                    if self.certificates
                    else None
                )
                nodes.append(SimulatedNode(answer["node_id"], answer["node_token"], url, context))

        await asyncio.gather(*(one(i) for i in range(count)))
        return nodes, latencies

    async def connect(self, nodes: list[SimulatedNode], *, concurrency: int = 32) -> Latencies:
        """Each node's first heartbeat, before the load: with certificates, each node
        opens its connection (a full handshake) here, as an appliance does once, and the
        load then measures calls on kept connections (`reconnect` measures handshakes)."""
        latencies = Latencies()
        gate = asyncio.Semaphore(concurrency)
        body = {"versions": VERSIONS, "capacity": _capacity(random.Random(0))}

        async def one(node: SimulatedNode) -> None:
            caller = ({"Authorization": f"Bearer {node.token}", **self._headers},
                      node.tls or self._ssl)  # fmt: skip
            async with gate:
                started = time.perf_counter()
                await self._call(
                    f"{node.url or self._urls[0]}/v1/node/heartbeat", caller, body, started,
                    latencies,
                )  # fmt: skip

        await asyncio.gather(*(one(n) for n in nodes))
        return latencies

    async def heartbeats(
        self,
        nodes: list[SimulatedNode],
        *,
        interval_s: float,
        duration_s: float,
        seed: int = 0,
    ) -> Latencies:
        """Every node heartbeats every `interval_s` for `duration_s`, open loop."""
        load = await self.run(nodes, interval_s=interval_s, duration_s=duration_s, seed=seed)
        return load.heartbeats

    async def run(
        self,
        nodes: list[SimulatedNode],
        *,
        interval_s: float,
        duration_s: float,
        events: int = 0,
        resend: float = 0.0,
        seed: int = 0,
    ) -> Load:
        """Every node heartbeats every `interval_s` for `duration_s`, and with `events`
        syncs that many new usage events half an interval later; open loop. A `resend`
        share of syncs goes again to another replica (the same one if there is one)."""
        rng = random.Random(seed)
        load = Load(Latencies(), Latencies())
        start = time.perf_counter() + 0.5
        end = start + duration_s
        # One schedule for the whole fleet, not a sleeping coroutine per node: ten thousand
        # sleeps (their futures, timers and contexts) filled the oldest generation of the
        # garbage collector, and its full collections held this loop for a quarter of a
        # second, which the latencies then blamed on the hub.
        headers = [{"Authorization": f"Bearer {node.token}", **self._headers} for node in nodes]
        callers = [(h, node.tls or self._ssl) for h, node in zip(headers, nodes, strict=True)]
        urls = [node.url or self._urls[0] for node in nodes]
        others = [self._urls[(self._urls.index(url) + 1) % len(self._urls)] for url in urls]
        batches = [0] * len(nodes)
        beats = [0] * len(nodes)
        schedule = [(start + rng.uniform(0, interval_s), i, _BEAT) for i in range(len(nodes))]
        heapq.heapify(schedule)
        in_flight: set[asyncio.Task[None]] = set()

        def call(coroutine: Coroutine[None, None, None]) -> None:
            task = asyncio.create_task(coroutine)
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

        gc.collect()
        gc.freeze()  # the fleet's own state, kept out of the collections during the run
        try:
            while schedule:
                due, index, kind = heapq.heappop(schedule)
                if (wait := due - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                load.lag.seconds.append(time.perf_counter() - due)
                url = urls[index]
                if kind == _BEAT:
                    beats[index] += 1
                    body = {"versions": VERSIONS, "capacity": _capacity(rng)}
                    if self._objectives:
                        body["objectives"] = _objectives(index, beats[index])
                    call(self._beat(url, callers[index], body, due, load))
                    if events:
                        heapq.heappush(schedule, (due + interval_s / 2, index, _SYNC))
                    if due + interval_s < end:
                        heapq.heappush(schedule, (due + interval_s, index, _BEAT))
                    continue
                sent = _usage(index, batches[index], events, rng)
                batches[index] += 1
                load.events_sent += len(sent)
                call(self._sync(url, callers[index], sent, due, load))
                if rng.random() < resend:  # the acknowledgement was lost: again
                    load.events_resent += len(sent)
                    call(self._sync(others[index], callers[index], sent, due, load))
            await asyncio.gather(*list(in_flight))
        finally:
            gc.unfreeze()
        return load

    async def _beat(
        self,
        url: str,
        caller: Caller,
        body: dict[str, Any],
        due: float,
        load: Load,
    ) -> None:
        await self._call(f"{url}/v1/node/heartbeat", caller, body, due, load.heartbeats)

    async def _sync(
        self,
        url: str,
        caller: Caller,
        events: list[dict[str, Any]],
        due: float,
        load: Load,
    ) -> None:
        answer = await self._call(
            f"{url}/v1/node/events", caller, {"events": events}, due, load.sync
        )
        if answer is not None:
            load.events_new += int(answer["new"])

    async def _call(
        self,
        url: str,
        caller: Caller,
        body: dict[str, Any],
        due: float,
        latencies: Latencies,
    ) -> Any:
        """POST `body`; its JSON answer (None: it failed, counted in `latencies`)."""
        headers, context = caller
        try:
            async with self._session.post(url, json=body, headers=headers, ssl=context) as response:
                raw = await response.read()
                if response.status != 200:
                    latencies.fail(str(response.status))
                    return None
        except (aiohttp.ClientError, TimeoutError) as err:
            latencies.fail(type(err).__name__)
            return None
        latencies.seconds.append(time.perf_counter() - due)
        return json.loads(raw)


def _usage(node: int, batch: int, count: int, rng: random.Random) -> list[dict[str, Any]]:
    """A batch of usage events as an appliance's outbox holds them (unique ids)."""
    now = datetime.now(UTC).isoformat(timespec="microseconds")
    return [
        {
            "id": f"sim-{node:06d}-{batch:05d}-{i:03d}",
            "kind": "usage",
            "body": {"account": "simulated", "model": "gemma-3-270m@1.0.0",
                     "tokens_in": rng.randint(10, 500), "tokens_out": rng.randint(10, 500),
                     "created_at": now},
        }
        for i in range(count)
    ]  # fmt: skip


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
def main(
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


if __name__ == "__main__":
    main()
