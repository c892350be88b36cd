"""Fleet heartbeats: how many simulated appliances one SQLite hub holds on these cores.

A real `kvl hub serve` (HTTPS on loopback, SQLite, no tunnel) in its own process, and
`kvl hub simulate` in another: for each fleet size, a fresh hub; the simulator enrolls
the nodes, then every node sends a heartbeat every 15 s at its own random phase (open
loop, latency from the scheduled time) for ``--duration-s`` seconds. The target: 10,000
nodes with heartbeat p99 under 100 ms. Issue 10 adds PostgreSQL and several replicas.

Run: ``python -m tests.benchmarks.fleet [--nodes 1000 10000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.benchmarks.serving import HOST, cpu_model, free_port, say
from tests.benchmarks.sync import wait_for_hub

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fleet.json"
TARGET = {"nodes": 10_000, "p99_ms": 100.0}
CONFIG = "overlay:\n  interface: null\nserver:\n  require_overlay_source: false\n"


def kvl(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


def one_fleet(nodes: int, interval_s: float, duration_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvl-bench-fleet-") as tmp:
        work = Path(tmp)
        config = work / "hub.yaml"
        config.write_text(CONFIG)
        port = free_port()
        common = ["--config", str(config), "--data-dir", str(work / "hub")]
        with (work / "hub.log").open("wb") as log:
            hub = subprocess.Popen(
                kvl("hub", "serve", *common, "--host", HOST, "--port", str(port)),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        url = f"https://{HOST}:{port}"
        try:
            wait_for_hub(url, hub)
            say(f"fleet: {nodes} nodes, a heartbeat each every {interval_s:g} s")
            simulated = subprocess.run(
                kvl("hub", "simulate", *common, "--url", url, "--nodes", str(nodes),
                    "--interval", str(interval_s), "--duration", str(duration_s), "--json"),
                capture_output=True,
                text=True,
                check=True,
            )  # fmt: skip
        finally:
            hub.terminate()
            hub.wait(timeout=60)
    report: dict[str, Any] = json.loads(simulated.stdout)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Heartbeats from simulated appliances.")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--interval-s", type=float, default=15.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    fleets = [one_fleet(n, args.interval_s, args.duration_s) for n in args.nodes]
    held = [
        f["nodes"]
        for f in fleets
        if not f["heartbeats"]["failed"]
        and f["heartbeats"]["p99_ms"] is not None
        and f["heartbeats"]["p99_ms"] < TARGET["p99_ms"]
    ]
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "logical_cpus": os.cpu_count()},
        "settings": {
            "hub": "one process, SQLite, HTTPS on loopback, no tunnel",
            "simulator": "one process, pooled HTTPS connections",
            "interval_s": args.interval_s,
            "duration_s": args.duration_s,
        },
        "fleets": fleets,
        "largest_held_p99_under_100ms": max(held, default=0),
        "target": TARGET,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
