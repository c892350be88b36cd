"""Burst offload: what the two extra hops cost, against a direct call to the same node.

A real hub and two real appliances (A and B), each its own process on loopback (no
tunnel: the hops are HTTPS to the hub and HTTP to the node). A has one batch slot and no
queue, and a long streamed request holds that slot for the whole run, so every other
request to A is shed and offloaded; B serves them. Each round sends the same request
once straight to B and once to A (offloaded to B), one after the other, so both see the
same load (A's held generation runs throughout). Latency is the whole non-streamed
request, client side.

Run: ``python -m tests.benchmarks.offload [--rounds 40]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from hub.identity import certificates
from hub.settings import HubSettings
from hub.state.store import open_store
from tests.benchmarks.concurrency import _percentile
from tests.benchmarks.report import headline, table
from tests.benchmarks.serving import HOST, free_port, say, stamp
from tests.benchmarks.sync import wait_for_hub
from tests.hubs import settings_for

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "offload.json"
MODEL = "gemma-3-270m"
HUB_CONFIG = "overlay:\n  interface: null\nserver:\n  require_overlay_source: false\n"


def kvl(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


def node_env(provisioning: Path) -> dict[str, str]:
    return {
        **os.environ,
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_MODEL__N_THREADS": "1",
        "KVL_MODEL__N_CTX": "4096",
        "KVL_MODEL__N_SLOTS": "1",
        "KVL_MODEL__MAX_QUEUE": "0",
        "KVL_FLEET__PROVISIONING_FILE": str(provisioning),
        "KVL_FLEET__TUNNEL": "false",
        "KVL_FLEET__LAN_TLS": "false",
        "KVL_FLEET__HEARTBEAT_S": "1",
    }


def start_node(
    work: Path, hub: HubSettings, hub_url: str, name: str
) -> tuple[subprocess.Popen[bytes], str, str]:
    store = open_store(hub)
    token = store.tokens.create("bench", uses=1, expires_in_s=600).plaintext
    # A fleet key: offloaded requests run as their client's key on the node that serves
    # them, which knows only the fleet's keys (from its desired state).
    store.accounts.put("bench", "S1")
    key = store.accounts.create_key("bench").plaintext
    store.close()
    provisioning = work / f"{name}.json"
    provisioning.write_text(json.dumps({
        "hub_url": hub_url, "token": token, "name": name,
        "hub_fingerprint": certificates(hub)[0].fingerprint,
    }))  # fmt: skip
    data = work / name
    env = node_env(provisioning)
    port = free_port()
    with (work / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(
            kvl("appliance", "serve", "--data-dir", str(data), "--host", HOST, "--port", str(port)),
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    return process, f"http://{HOST}:{port}", key


def in_fleet(hub: HubSettings, nodes: dict[str, tuple[str, str]]) -> bool:
    """Every node heard from, serving, and holding its key (from its desired state)."""
    store = open_store(hub)
    try:
        ready = {n.name for n in store.nodes.all()
                 if n.capacity.models and n.fleet_url and n.capacity.offload}  # fmt: skip
    finally:
        store.close()
    if not nodes.keys() <= ready:
        return False
    for url, key in nodes.values():
        request = urllib.request.Request(
            f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status != 200:
                    return False
        except OSError:
            return False
    return True


async def hold(session: aiohttp.ClientSession, base: str, key: str, stop: asyncio.Event) -> None:
    """Keep A's only slot busy until `stop`."""
    while not stop.is_set():
        async with session.post(
            f"{base}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 3000, "stream": True},
        ) as response:
            async for _ in response.content:
                if stop.is_set():
                    return


async def timed(session: aiohttp.ClientSession, base: str, key: str) -> tuple[float, str]:
    started = time.perf_counter()
    async with session.post(
        f"{base}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
    ) as response:
        body = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{base}: {response.status} {body}")
        return time.perf_counter() - started, response.headers.get("X-Kvl-Served-By", "")


async def measure(a: tuple[str, str], b: tuple[str, str], rounds: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        stop = asyncio.Event()
        holder = asyncio.create_task(hold(session, *a, stop))
        await asyncio.sleep(2)  # the held request is generating
        direct, offloaded, added = [], [], []
        served_by: set[str] = set()
        for _ in range(rounds):
            d, _ = await timed(session, *b)
            o, by = await timed(session, *a)
            served_by.add(by)
            direct.append(d)
            offloaded.append(o)
            added.append(o - d)
        stop.set()
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)

    def ms(values: list[float], q: float) -> float:
        return round(_percentile(sorted(values), q) * 1000, 1)

    return {
        "rounds": rounds,
        "served_by": sorted(served_by),
        "direct_ms": {"p50": ms(direct, 0.5), "p99": ms(direct, 0.99)},
        "offloaded_ms": {"p50": ms(offloaded, 0.5), "p99": ms(offloaded, 0.99)},
        "added_ms": {"p50": ms(added, 0.5), "p99": ms(added, 0.99)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Offload latency over a direct call.")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvl-bench-offload-") as tmp:
        work = Path(tmp)
        (work / "hub.yaml").write_text(HUB_CONFIG)
        port = free_port()
        hub = settings_for(work, port=port)  # the store and the CA: `kvl hub serve` reads hub.yaml
        url = f"https://{HOST}:{port}"
        try:
            with (work / "hub.log").open("wb") as log:
                processes.append(subprocess.Popen(
                    kvl("hub", "serve", "--config", str(work / "hub.yaml"), "--data-dir",
                        str(hub.data_dir), "--host", HOST, "--port", str(port)),
                    stdout=log, stderr=subprocess.STDOUT,
                ))  # fmt: skip
            wait_for_hub(url, processes[0])
            say("offload: starting two appliances (the first start assembles the model)")
            a_proc, a_url, a_key = start_node(work, hub, url, "node-a")
            b_proc, b_url, b_key = start_node(work, hub, url, "node-b")
            processes += [a_proc, b_proc]
            deadline = time.monotonic() + 600
            while not in_fleet(hub, {"node-a": (a_url, a_key), "node-b": (b_url, b_key)}):
                if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                    raise RuntimeError(f"the nodes did not report in; logs in {work}")
                time.sleep(0.5)
            say(f"offload: {args.rounds} rounds, direct to B and offloaded through A")
            figures = asyncio.run(measure((a_url, a_key), (b_url, b_key), args.rounds))
        finally:
            for process in reversed(processes):
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
    result = {
        **stamp(),
        "settings": {
            "request": "/v1/completions, 16 tokens, greedy, not streamed",
            "nodes": "two appliances, 1 thread each, one slot; A's held by a long request",
            "hops": "A -> hub (HTTPS, pinned) -> B (HTTP), no tunnel",
        },
        **figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(json.dumps(result, indent=2))
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows, from a result (a test keeps them equal;
    `python -m tests.benchmarks.tables` writes it there)."""
    rows = [
        ("direct to B", result["direct_ms"], False),
        ("through A and the hub to B", result["offloaded_ms"], False),
        ("added by the two hops (per round)", result["added_ms"], True),
    ]
    served = ", ".join(f"`{node}`" for node in result["served_by"])
    return "\n".join([
        headline(result, f"{result['rounds']} rounds"),
        "",
        *table(
            ["", "p50", "p99"],
            [
                [label, f"**{ms['p50']:.1f} ms**" if bold else f"{ms['p50']:.0f} ms",
                 f"{ms['p99']:.0f} ms"]
                for label, ms, bold in rows
            ],
        ),
        "",
        f"The offloaded requests were served by {served} (`X-Kvl-Served-By`).",
    ]) + "\n"  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
