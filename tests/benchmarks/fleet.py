"""Fleet heartbeats and sync: how many simulated appliances the hub holds on these cores,
on SQLite and on PostgreSQL, as one process and as two replicas.

For each combination of store, replicas and fleet size: a fresh hub (a new SQLite file, or
a new database on a throwaway PostgreSQL cluster started once for the run from Debian's
binaries, durable commits as SQLite's), each replica a real `kvl hub serve` (HTTPS on
loopback, no tunnel) on its own port, and the simulator (`tests/benchmarks/simulate.py`)
in another process. It enrolls the nodes across the replicas; then every node sends a
heartbeat every 15 s at its own random phase and, half an interval later, syncs one usage
event (open loop, latency from the scheduled time), 1 % of syncs sent again to the other
replica, for ``--duration-s`` seconds. A combination holds when no call failed, every event was new
at the hub exactly once, and heartbeat and sync p99 stay under 100 ms.

The sizes run from the smallest up; once one is not held, the larger ones of that store
and replica count are not run (``--every-size`` runs them all the same), and the result
says so. Each fleet also records the CPU each call cost under the load: in the hub, in
PostgreSQL, and in the simulator, which shares the cores.

With ``--baseline REF`` the same load also runs against hubs of an earlier commit (its
files from ``git archive``, run by this interpreter, driven by today's simulator) at the
``--baseline-nodes`` sizes, so the hub's CPU per call before and after a change is
measured in one run on one machine.

Run: ``python -m tests.benchmarks.fleet [--nodes 1000 10000 20000 50000] [--stores sqlite
postgres] [--replicas 1 2] [--every-size] [--baseline REF [--baseline-nodes 10000]]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from tests.benchmarks.report import headline, span, table
from tests.benchmarks.serving import HOST, checkout, commit, free_port, say, stamp
from tests.benchmarks.sync import wait_for_hub
from tests.postgres import cluster

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.postgres import Cluster

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fleet.json"
TARGET = {"p99_ms": 100.0}
CONFIG = "overlay:\n  interface: null\nserver:\n  require_overlay_source: false\n"


def kvl(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


Hub = tuple[str, "subprocess.Popen[bytes]"]  # a replica's URL and process


@contextlib.contextmanager
def replicas(
    work: Path, common: list[str], count: int, env: dict[str, str], code: Path | None = None
) -> Iterator[list[Hub]]:
    """`count` hub processes on one store, ready; their URLs. The first makes the data
    directory's certificate authority and keys, which the others then share. `code`: a
    checkout whose hub runs instead of this one's."""
    if code is not None:
        env = {**env, "PYTHONPATH": str(code)}
    started: list[Hub] = []
    try:
        for index in range(count):
            port = free_port()
            with (work / f"hub-{index}.log").open("wb") as log:
                process = subprocess.Popen(
                    kvl("hub", "serve", *common, "--host", HOST, "--port", str(port)),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=code,
                )
            url = f"https://{HOST}:{port}"
            started.append((url, process))
            wait_for_hub(url, process)
        yield started
    finally:
        for _, process in started:
            process.terminate()
        for _, process in started:
            process.wait(timeout=60)


def one_fleet(
    nodes: int,
    store: str,
    count: int,
    postgres: Cluster | None,
    *,
    interval_s: float,
    duration_s: float,
    baseline: tuple[str, Path] | None = None,
    mode: str = "mtls",
) -> dict[str, Any]:
    """One fleet. `mode`: "mtls" (nodes with certificates, a connection each, kept
    alive, as appliances keep theirs), "handshakes" (the same, a new connection and full
    handshake for every call), "token" (no certificates, shared connections: a hub of an
    earlier commit)."""
    simulate_mode = {
        "mtls": [], "handshakes": ["--reconnect"], "token": ["--no-certificates"],
    }[mode]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvl-bench-fleet-") as tmp:
        work = Path(tmp)
        config = work / "hub.yaml"
        config.write_text(CONFIG)
        env = dict(os.environ)
        env.pop("KVL_HUB_DATABASE_URL", None)
        if store == "postgres":
            assert postgres is not None  # main() starts it for postgres runs
            env["KVL_HUB_DATABASE_URL"] = postgres.create()
        common = ["--config", str(config), "--data-dir", str(work / "hub")]
        # Other work on these cores shows in the figures: the load at the start says so.
        load_before = round(os.getloadavg()[0], 2)
        code = None if baseline is None else baseline[1]
        with replicas(work, common, count, env, code) as hubs:
            said = f" (hub of {baseline[0]})" if baseline else ""
            say(f"fleet: {nodes} nodes on {store}, {count} replica(s){said}")
            urls = [arg for url, _ in hubs for arg in ("--url", url)]
            processes = [psutil.Process(p.pid) for _, p in hubs]
            cpu_before = sum(sum(p.cpu_times()[:2]) for p in processes)
            database_before = database_cpu(postgres) if store == "postgres" else 0.0
            started = time.perf_counter()
            # Today's simulator, whichever commit's hub it loads (tests/benchmarks/simulate.py).
            simulator = subprocess.Popen(
                [sys.executable, "-m", "tests.benchmarks.simulate", *common, *urls,
                 "--nodes", str(nodes), "--interval", str(interval_s),
                 "--duration", str(duration_s), "--events", "1", "--resend", "0.01", "--json",
                 *simulate_mode],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
            )  # fmt: skip
            watched = psutil.Process(simulator.pid)
            # The hub's (and PostgreSQL's) CPU at the moment the load begins: the simulator
            # says on stderr when it has enrolled the fleet.
            at_load: dict[str, float] = {}
            err_lines: list[str] = []

            def watch_stderr() -> None:
                assert simulator.stderr is not None
                for line in simulator.stderr:
                    err_lines.append(line)
                    if line.startswith("enrolled") and not at_load:
                        at_load["hub"] = sum(sum(p.cpu_times()[:2]) for p in processes)
                        at_load["database"] = database_cpu(postgres)
                        at_load["time"] = time.perf_counter()

            watcher = threading.Thread(target=watch_stderr, daemon=True)
            watcher.start()
            simulator_cpu = 0.0
            while simulator.poll() is None:
                with contextlib.suppress(psutil.Error):
                    simulator_cpu = sum(watched.cpu_times()[:2])
                time.sleep(0.5)
            assert simulator.stdout is not None
            out = simulator.stdout.read()
            watcher.join(timeout=10)
            err = "".join(err_lines)
            wall = time.perf_counter() - started
            hub_total = sum(sum(p.cpu_times()[:2]) for p in processes)
            hub_cpu = hub_total - cpu_before
            database_total = database_cpu(postgres)
            database = database_total - database_before if store == "postgres" else 0.0
        if simulator.returncode != 0:
            say(err)
            raise RuntimeError(f"the simulator exited with {simulator.returncode}")
    report: dict[str, Any] = json.loads(out)
    report["store"] = store
    report["mode"] = mode
    report["hub_commit"] = commit() if baseline is None else baseline[0]
    report["wall_s"] = round(wall, 1)  # the simulator's run: enrollment, then the load
    report["load_average_before"] = load_before
    # The hub processes' CPU over the whole run (enrollment included), in cores.
    report["hub_cpu_cores"] = round(hub_cpu / wall, 2)
    report["simulator_cpu_cores"] = round(simulator_cpu / wall, 2)
    report["database_cpu_cores"] = round(database / wall, 2)  # PostgreSQL's server processes
    # Under the load alone (after enrollment): CPU per call of the hub processes, and of
    # PostgreSQL's; with the simulator's own, what each call costs on these cores.
    calls = report["heartbeats"]["calls"] + report["sync"]["calls"]
    if at_load and calls:
        report["hub_cpu_ms_per_call"] = round((hub_total - at_load["hub"]) * 1000 / calls, 3)
        report["database_cpu_ms_per_call"] = (
            round((database_total - at_load["database"]) * 1000 / calls, 3)
            if store == "postgres"
            else 0.0
        )
    report["held"] = held(report)
    beats, sync = report["heartbeats"], report["sync"]
    say(
        f"  heartbeats p50/p99 {beats['p50_ms']}/{beats['p99_ms']} ms, sync "
        f"{sync['p50_ms']}/{sync['p99_ms']} ms, failed {beats['failed'] or sync['failed'] or 0}, "
        f"events {sync['new']}/{sync['events']} new, CPU hub {report['hub_cpu_cores']}, "
        f"simulator {report['simulator_cpu_cores']}, "
        f"database {report['database_cpu_cores']} cores; simulator's own lag p99 "
        f"{report['send_lag_ms']['p99']} ms: "
        f"{'held' if report['held'] else 'NOT held'}"
    )
    return report


def database_cpu(postgres: Cluster | None) -> float:
    """CPU seconds of the PostgreSQL cluster's processes so far (the postmaster and its
    backends; those that already exited are not counted)."""
    if postgres is None:
        return 0.0
    postmaster = psutil.Process(int((postgres.data / "postmaster.pid").read_text().split()[0]))
    total = 0.0
    for process in [postmaster, *postmaster.children()]:
        with contextlib.suppress(psutil.Error):
            total += sum(process.cpu_times()[:2])
    return total


def compare(fleets: list[dict[str, Any]], baselines: list[dict[str, Any]]) -> dict[str, Any]:
    """Hub CPU per call today and with the baseline's hub, for each fleet run both ways."""
    out: dict[str, Any] = {}
    for before in baselines:
        same = [f for f in fleets if (f["store"], f["replicas"], f["nodes"]) ==
                (before["store"], before["replicas"], before["nodes"])]  # fmt: skip
        if not same or "hub_cpu_ms_per_call" not in before or "hub_cpu_ms_per_call" not in same[0]:
            continue
        now, then = same[0]["hub_cpu_ms_per_call"], before["hub_cpu_ms_per_call"]
        name = (f"{before['store']}, {before['replicas']} replica"
                f"{'s' if before['replicas'] > 1 else ''}, {before['nodes']} nodes")  # fmt: skip
        out[name] = {
            "baseline": then,
            "today": now,
            "ratio": round(now / then, 3) if then else None,
        }
    return out


def baseline_markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows of a run with `--baseline`: each fleet run both
    ways, today's hub against the baseline's, the same load from the same simulator."""
    lines = [
        headline(result),
        "",
        (
            f"| {result['fleets'][0]['nodes']:,} nodes | heartbeat p50 / p99, before "
            f"(`{result['baseline'][0]['hub_commit']}`) | "
            f"after (`{result['fleets'][0]['hub_commit']}`) | "
            "sync p50 / p99, before | after | "
            "hub CPU ms per call, before | after | after / before | held, before | after |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for before in result["baseline"]:
        (now,) = [f for f in result["fleets"] if (f["store"], f["replicas"], f["nodes"]) ==
                  (before["store"], before["replicas"], before["nodes"])]  # fmt: skip
        store = "SQLite" if now["store"] == "sqlite" else "PostgreSQL"
        replicas = f"{now['replicas']} replica{'s' if now['replicas'] > 1 else ''}"
        ratio = now["hub_cpu_ms_per_call"] / before["hub_cpu_ms_per_call"]

        def latency(fleet: dict[str, Any], calls: str) -> str:
            return f"{fleet[calls]['p50_ms']} / {fleet[calls]['p99_ms']} ms"

        def held(fleet: dict[str, Any]) -> str:
            return "**yes**" if fleet["held"] else "no"

        lines.append(
            f"| {store}, {replicas} "
            f"| {latency(before, 'heartbeats')} | {latency(now, 'heartbeats')} "
            f"| {latency(before, 'sync')} | {latency(now, 'sync')} "
            f"| {before['hub_cpu_ms_per_call']:.3f} | {now['hub_cpu_ms_per_call']:.3f} "
            f"| {ratio:.2f} | {held(before)} | {held(now)} |"
        )
    for before in result["baseline"]:
        lines += ["", _simulator_sentence(before, _same(result["fleets"], before))]
    return "\n".join(lines) + "\n"


def _simulator_sentence(before: dict[str, Any], now: dict[str, Any]) -> str:
    """What the simulator saw of each hub: whether the load it offered was the load sent."""

    def both(figure: Any) -> str:
        return f"{figure(before)} / {figure(now)}"

    return (
        f"{_where(now)}, before / after: enrollment p99 "
        f"{both(lambda f: f['enrollment']['p99_ms'])} ms, first heartbeat p99 "
        f"{both(lambda f: f['first_heartbeat']['p99_ms'])} ms; the simulator's send lag p50 "
        f"{both(lambda f: f['send_lag_ms']['p50'])} ms, its CPU per call "
        f"{both(lambda f: f['simulator_cpu_ms_per_call'])} ms."
    )


MODES = {"mtls": "mutual TLS", "token": "token only", "handshakes": "a handshake each call"}


def markdown(result: dict[str, Any]) -> str:
    """The tables docs/benchmarks.md shows of a fleet run: every fleet, and with
    `--baseline` the hub's CPU per call against the baseline's (a test keeps them equal;
    `python -m tests.benchmarks.tables` writes them there)."""
    settings = result["settings"]
    lines = [
        headline(
            result,
            f"{settings['interval_s']:g}-s heartbeats, {settings['duration_s']:g} s of load",
        ),
        "",
        *table(
            [
                "store", "replicas", "nodes", "calls/s", "heartbeat p50 / p99", "sync p50 / p99",
                "simulator's lag p99", "first heartbeat (its handshake) p50 / p99",
                "CPU ms per call: hub (+ PostgreSQL) / simulator", "held",
            ],
            [_fleet_row(fleet) for fleet in result["fleets"]],
        ),
        "",
        _held_sentence(result),
    ]  # fmt: skip
    if result.get("baseline"):
        lines += ["", *_cpu_against(result["fleets"], result["baseline"], result.get("commit"))]
    return "\n".join(lines) + "\n"


def handshakes_markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows of a `--handshakes` run: the hub's CPU per call
    on kept connections against a new connection and handshake for every call."""
    rows = []
    extra = []
    for each in result["handshakes"]:
        kept = _same(result["fleets"], each)
        failed = _failed(each)
        calls = each["heartbeats"]["calls"] + each["sync"]["calls"]
        extra.append(each["hub_cpu_ms_per_call"] - kept["hub_cpu_ms_per_call"])
        rows.append([
            _where(each),
            f"{kept['hub_cpu_ms_per_call']:.3f}",
            f"{each['hub_cpu_ms_per_call']:.3f}",
            f"{each['hub_cpu_ms_per_call'] / kept['hub_cpu_ms_per_call']:.2f}",
            f"{failed:,} of {calls:,} calls failed" if failed else "none failed",
            _yes(each["held"]),
        ])  # fmt: skip
    nodes = result["handshakes"][0]["nodes"]
    lines = [
        headline(result),
        "",
        *table(
            [
                f"{nodes:,} nodes",
                "hub CPU ms per call, kept connections",
                "a handshake each call",
                "ratio",
                "a handshake each call: calls",
                "held",
            ],
            rows,
        ),
        "",
        (
            f"A handshake costs the hub about {span(extra)} ms of CPU more than a call on a "
            "kept connection."
        ),
    ]
    return "\n".join(lines) + "\n"


def _fleet_row(fleet: dict[str, Any]) -> list[str]:
    beats, sync, first = fleet["heartbeats"], fleet["sync"], fleet["first_heartbeat"]
    hub = f"{fleet['hub_cpu_ms_per_call']}"
    if fleet["store"] == "postgres":
        hub += f" + {fleet['database_cpu_ms_per_call']}"
    return [
        _store(fleet),
        str(fleet["replicas"]),
        f"{fleet['nodes']:,}",
        f"{beats['per_s'] + sync['per_s']:,.0f}",
        f"{beats['p50_ms']} / {beats['p99_ms']} ms",
        f"{sync['p50_ms']} / {sync['p99_ms']} ms",
        f"{fleet['send_lag_ms']['p99']} ms",
        f"{first['p50_ms']} / {first['p99_ms']} ms",
        f"{hub} / {fleet['simulator_cpu_ms_per_call']}",
        _yes(fleet["held"]),
    ]


def _held_sentence(result: dict[str, Any]) -> str:
    """The largest fleet each store and number of replicas held, and what was not run."""
    target = result.get("target", TARGET)["p99_ms"]
    largest = result.get("largest_held_p99_under_100ms", {})
    # The result names a combination as "sqlite, 2 replicas".
    names = {"sqlite": "SQLite", "postgres": "PostgreSQL"}
    held = "; ".join(
        f"{names.get(where.split(',')[0], where.split(',')[0])},{where.partition(',')[2]}: "
        + (f"{nodes:,} nodes" if nodes else "none of the sizes run")
        for where, nodes in largest.items()
    )
    sentence = (
        f"Largest fleet held (no call failed, every event new at the hub exactly once, "
        f"heartbeat and sync p99 under {target:g} ms): {held or 'none'}."
    )
    not_run = result.get("not_run", {})
    if not_run:
        sentence += " Not run: " + "; ".join(f"{k} ({v})" for k, v in not_run.items()) + "."
    return sentence


def _cpu_against(
    fleets: list[dict[str, Any]], baselines: list[dict[str, Any]], commit: str | None
) -> list[str]:
    """Hub CPU per call, today's hub against the baseline's, run by run."""
    first = baselines[0]
    now_mode = MODES.get(fleets[0].get("mode", "mtls"), fleets[0].get("mode", ""))
    rows = []
    ratios = []
    p99s = []
    for before in baselines:
        now = _same(fleets, before)
        ratios.append(now["hub_cpu_ms_per_call"] / before["hub_cpu_ms_per_call"])
        p99s += [now["heartbeats"]["p99_ms"], now["sync"]["p99_ms"]]
        rows.append([
            _where(before),
            f"{before['hub_cpu_ms_per_call']:.3f}",
            f"{now['hub_cpu_ms_per_call']:.3f}",
            f"{ratios[-1]:.2f}",
            # Both hubs' tails and whether each held, on the same machine in the same
            # run: what the figures of an earlier day's run cannot say.
            f"{before['heartbeats']['p99_ms']} / {now['heartbeats']['p99_ms']} ms",
            f"{before['sync']['p99_ms']} / {now['sync']['p99_ms']} ms",
            f"{_yes(before['held'])} / {_yes(now['held'])}",
        ])  # fmt: skip
    header = [
        f"{first['nodes']:,} nodes",
        (
            f"hub CPU ms per call, before (`{first['hub_commit']}`, "
            f"{MODES.get(first.get('mode', ''), first.get('mode', ''))})"
        ),
        f"after (`{commit}`, {now_mode})" if commit else f"after ({now_mode})",
        "after / before",
        "heartbeat p99, before / after",
        "sync p99, before / after",
        "held, before / after",
    ]
    return [
        *table(header, rows),
        "",
        (
            f"Hub CPU per call after / before: {span(ratios)}; today's heartbeat and sync "
            f"p99s between {min(p99s)} and {max(p99s)} ms."
        ),
    ]


def _same(fleets: list[dict[str, Any]], other: dict[str, Any]) -> dict[str, Any]:
    """The run of `fleets` with the store, replicas and nodes of `other`."""
    key = (other["store"], other["replicas"], other["nodes"])
    (match,) = [f for f in fleets
                if (f["store"], f["replicas"], f["nodes"]) == key
                and f.get("mode") != "handshakes"]  # fmt: skip
    return match


def _store(fleet: dict[str, Any]) -> str:
    return "SQLite" if fleet["store"] == "sqlite" else "PostgreSQL"


def _where(fleet: dict[str, Any]) -> str:
    return f"{_store(fleet)}, {fleet['replicas']} replica{'s' if fleet['replicas'] > 1 else ''}"


def _yes(held: bool) -> str:
    return "**yes**" if held else "no"


def _failed(fleet: dict[str, Any]) -> int:
    return sum(
        count for calls in ("heartbeats", "sync") for count in fleet[calls]["failed"].values()
    )


def held(report: dict[str, Any]) -> bool:
    beats, sync = report["heartbeats"], report["sync"]
    return (
        not beats["failed"]
        and not sync["failed"]
        and sync["new"] == sync["events"]
        and all(
            calls["p99_ms"] is not None and calls["p99_ms"] < TARGET["p99_ms"]
            for calls in (beats, sync)
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Heartbeats and sync from simulated appliances.")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10_000, 20_000, 50_000])
    parser.add_argument("--stores", nargs="+", choices=["sqlite", "postgres"],
                        default=["sqlite", "postgres"])  # fmt: skip
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--interval-s", type=float, default=15.0)
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument(
        "--every-size",
        action="store_true",
        help="run the larger fleets of a combination even once a smaller one was not held",
    )
    parser.add_argument(
        "--baseline", help="also run hubs of this commit (before a change), same load"
    )
    parser.add_argument("--baseline-nodes", type=int, nargs="+", default=[10_000])
    parser.add_argument(
        "--baseline-token", action="store_true",
        help="the baseline's nodes have no certificates (a hub before protocol 3)",
    )  # fmt: skip
    parser.add_argument(
        "--handshakes", action="store_true",
        help="also run the --baseline-nodes sizes with a full TLS handshake for every call",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    fleets: list[dict[str, Any]] = []
    baselines: list[dict[str, Any]] = []
    handshakes: list[dict[str, Any]] = []
    not_run: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        postgres = stack.enter_context(cluster(durable=True)) if "postgres" in args.stores else None
        baseline = stack.enter_context(checkout(args.baseline)) if args.baseline else None
        for store in args.stores:
            for count in args.replicas:
                missed: int | None = None
                for nodes in sorted(args.nodes):
                    if missed is not None:
                        name = f"{store}, {count} replica{'s' if count > 1 else ''}, {nodes} nodes"
                        not_run[name] = f"{missed} nodes were not held"
                        continue
                    fleet = one_fleet(
                        nodes, store, count, postgres,
                        interval_s=args.interval_s, duration_s=args.duration_s,
                    )  # fmt: skip
                    fleets.append(fleet)
                    if baseline is not None and nodes in args.baseline_nodes:
                        before = one_fleet(
                            nodes, store, count, postgres,
                            interval_s=args.interval_s, duration_s=args.duration_s,
                            baseline=baseline, mode="token" if args.baseline_token else "mtls",
                        )  # fmt: skip
                        baselines.append(before)
                    if args.handshakes and nodes in args.baseline_nodes:
                        handshakes.append(one_fleet(
                            nodes, store, count, postgres,
                            interval_s=args.interval_s, duration_s=args.duration_s,
                            mode="handshakes",
                        ))  # fmt: skip
                    if not fleet["held"] and not args.every_size:
                        missed = nodes
    largest = {
        f"{store}, {count} replica{'s' if count > 1 else ''}": max(
            (f["nodes"] for f in fleets
             if f["store"] == store and f["replicas"] == count and f["held"]),
            default=0,
        )
        for store in args.stores
        for count in args.replicas
    }  # fmt: skip
    result = {
        **stamp(),
        "settings": {
            "hub": "kvl hub serve per replica, HTTPS on loopback, no tunnel; SQLite WAL with "
            "synchronous=FULL, or PostgreSQL (Debian's server, fsync and synchronous_commit "
            "on) over its unix socket",
            "simulator": "one process; each node enrolls with a signing request and calls "
            "with its own certificate (mutual TLS) over its own kept-alive connection (a "
            "baseline without certificates: 100 shared connections); nodes spread over the "
            "replicas; one usage event synced per node and interval, 1 % resent to another "
            "replica",
            "interval_s": args.interval_s,
            "duration_s": args.duration_s,
        },
        "fleets": fleets,
        "baseline": baselines,
        "hub_cpu_ms_per_call_vs_baseline": compare(fleets, baselines),
        "handshakes": handshakes,
        "hub_cpu_ms_per_call_with_a_handshake_each": compare(handshakes, fleets),
        "largest_held_p99_under_100ms": largest,
        "not_run": not_run,
        "target": TARGET,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(json.dumps(largest, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
