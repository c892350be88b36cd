"""A site's link carries each model file once (part of `just bench image`).

Two network namespaces on one veth link: the hub's (a real `kvl hub serve`), and the site's,
where two real appliances (`kvl appliance serve`, enrolled with the hub) share one LAN. The
hub's end of the link is shaped with `tc` (tbf) to a site's WAN rate. The embedded chat
model's file is registered on the hub and deployed with two replicas: one on each node.
Measured twice in one run, with the nodes sharing files (each reports its LAN address:
protocol 10) and without (they report none, as nodes before it did): the bytes the WAN
link carried (its veth's counter, headers included), against the file's size, and the
seconds from the deployment to both nodes serving the model.

Run (as root): ``python -m tests.benchmarks.site_fetch [--rate-mbit 40]``, or with the rest
of `python -m tests.benchmarks.image`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from appliance.serving.catalog import CHAT_MODEL_NAME, EMBEDDED
from hub.identity import certificates
from hub.settings import HubSettings
from hub.state.store import open_store
from image import netns
from tests.benchmarks.report import headline
from tests.benchmarks.serving import say, stamp
from tests.conftest import SCRIPTED, kvl, write_script
from tests.netns import A_ADDR, B_ADDR, Link, linked_namespaces, spawn, stop

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "site-fetch.json"
DEFAULT_RATE_MBIT = 40
NODES = ("lab-1", "lab-2")


def _in(link: Link, ns: str, *command: str) -> str:
    done = subprocess.run(
        netns.argv(ns, *command), capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout


def _tx_bytes(link: Link) -> int:
    """Bytes the hub's end of the link has sent: what the site's WAN carried to it."""
    return int(_in(link, link.a, "cat", f"/sys/class/net/{link.veth_a}/statistics/tx_bytes"))


def _serving(hub: HubSettings, model: str) -> set[str]:
    store = open_store(hub)
    try:
        return {n.name for n in store.nodes.all() if model in n.capacity.models}
    finally:
        store.close()


def once(work: Path, model_file: Path, *, share: bool, rate_mbit: int) -> dict[str, Any]:
    """Both nodes placed the model, sharing or not; the link's bytes and the time."""
    work.mkdir(parents=True)
    with linked_namespaces() as link:
        tc = shutil.which("tc", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
        if tc is None:
            raise RuntimeError("`tc` (iproute2) is not installed")
        _in(link, link.a, tc, "qdisc", "replace", "dev", link.veth_a, "root", "tbf",
                     "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "100ms")  # fmt: skip
        hub_dir = work / "hub"
        # No tunnels: two nodes' wireguard-go in one namespace would route the one overlay
        # twice. The nodes call the hub at its URL, across the shaped link all the same.
        hub = HubSettings.model_validate({
            "data_dir": hub_dir,
            "server": {"names": [A_ADDR], "require_overlay_source": False},
            "overlay": {"endpoint": f"{A_ADDR}:51820", "interface": f"kvh{link.suffix}"},
            "fleet": {"placement_every_s": 0.5},
        })  # fmt: skip
        fingerprint = certificates(hub)[0].fingerprint
        store = open_store(hub)
        tokens = {
            name: store.tokens.create("school", uses=1, expires_in_s=600).plaintext
            for name in NODES
        }
        store.close()
        hub_env = {
            "KVL_HUB_SERVER__NAMES": json.dumps([A_ADDR]),
            "KVL_HUB_SERVER__REQUIRE_OVERLAY_SOURCE": "false",
            "KVL_HUB_OVERLAY__ENDPOINT": f"{A_ADDR}:51820",
            "KVL_HUB_OVERLAY__INTERFACE": f"kvh{link.suffix}",
            "KVL_HUB_FLEET__PLACEMENT_EVERY_S": "0.5",
        }
        serve_hub = ["hub", "serve", "--data-dir", str(hub_dir), "--host", A_ADDR]
        processes = [spawn(link, link.a, serve_hub, hub_env, work / "hub.log")]
        try:
            for index, name in enumerate(NODES):
                node = _node(link, work, name, tokens[name], fingerprint=fingerprint,
                             port=8080 + index, share=share)  # fmt: skip
                processes.append(node)
            deadline = time.monotonic() + 120
            while len(_enrolled(hub)) < len(NODES):
                if time.monotonic() > deadline:
                    raise RuntimeError("the nodes did not enroll within 120 s")
                time.sleep(0.5)
            ref = "chat@1"
            kvl("hub", "models", "add", str(model_file), "--name", "chat", "--version", "1",
                "--data-dir", str(hub_dir))  # fmt: skip
            before = _tx_bytes(link)
            started = time.monotonic()
            kvl("hub", "deploy", ref, "--replicas", str(len(NODES)), "--data-dir", str(hub_dir))
            deadline = started + 900
            while _serving(hub, ref) != set(NODES):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not served on both within 900 s: {_serving(hub, ref)}")
                time.sleep(0.25)
            seconds = time.monotonic() - started
            carried = _tx_bytes(link) - before
        finally:
            for process in reversed(processes):
                stop(process)
    size = model_file.stat().st_size
    return {
        "wan_bytes": carried,
        "file_bytes": size,
        "wan_per_file": round(carried / size, 3),
        "both_serving_s": round(seconds, 1),
    }


def _enrolled(hub: HubSettings) -> list[str]:
    store = open_store(hub)
    try:
        return [n.name for n in store.nodes.all() if n.last_seen is not None]
    finally:
        store.close()


def _node(
    link: Link, work: Path, name: str, token: str, *, fingerprint: str, port: int, share: bool
) -> Any:
    folder = work / name
    provisioning = work / f"{name}.json"
    provisioning.write_text(json.dumps({
        "hub_url": f"https://{A_ADDR}:8443", "token": token, "hub_fingerprint": fingerprint,
        "name": name,
    }))  # fmt: skip
    script = write_script(work / f"{name}-own.json")
    kvl("appliance", "models", "add", str(script), "--name", SCRIPTED, "--version", "1",
        "--data-dir", str(folder))  # fmt: skip
    env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_MODEL__DEFAULT": SCRIPTED,
        "KVL_MODEL__CHAT_DEFAULT": SCRIPTED,
        "KVL_MODEL__N_CTX": "512",
        "KVL_MODEL__N_SLOTS": "1",
        "KVL_MODEL__N_THREADS": "1",
        "KVL_FLEET__PROVISIONING_FILE": str(provisioning),
        "KVL_FLEET__TUNNEL": "false",  # the hub at its URL, across the shaped link
        "KVL_FLEET__HEARTBEAT_S": "1",
        "KVL_FLEET__EVALUATE_PLACED": "false",
        # Without sharing, no address for the site: the hub names no peers (protocol 9's way).
        "KVL_FLEET__PEER_ADDRESSES": json.dumps([B_ADDR] if share else []),
    }
    serve = ["appliance", "serve", "--data-dir", str(folder), "--host", B_ADDR,
             "--port", str(port)]  # fmt: skip
    return spawn(link, link.b, serve, env, work / f"{name}.log")


def measure(work: Path, rate_mbit: int = DEFAULT_RATE_MBIT) -> dict[str, Any] | None:
    """Sharing and not, on one link rate; None where namespaces cannot be made."""
    why = netns.available()
    if why is not None:
        say(f"site fetch: skipped, {why}")
        return None
    model_file = EMBEDDED[CHAT_MODEL_NAME].sources()[0]
    results = {}
    for share in (True, False):
        say(f"site fetch: two nodes, {'sharing' if share else 'each from the hub'}")
        results["shared" if share else "each_from_hub"] = once(
            work / ("shared" if share else "apart"), model_file, share=share, rate_mbit=rate_mbit
        )
        say(f"site fetch: {results}")
    return {"rate_mbit": rate_mbit, "nodes": len(NODES), "model": CHAT_MODEL_NAME, **results}


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows, from a result (a test keeps them equal)."""
    shared, apart = result["shared"], result["each_from_hub"]
    rate, mib = result["rate_mbit"], shared["file_bytes"] / 2**20
    title = f"a {rate} Mbit/s link, the {result['model']} file ({mib:.0f} MiB)"
    lines = [
        headline(result, title),
        "",
        (
            "| two nodes of one site, the model placed on both | sharing (protocol 10) | "
            "each from the hub | target |"
        ),
        "|---|---|---|---|",
        (
            f"| bytes the site's link carried, per file | {shared['wan_per_file']} | "
            f"{apart['wan_per_file']} | **≤ 1.05** |"
        ),
        (
            f"| deployment to both nodes serving it | {shared['both_serving_s']} s | "
            f"{apart['both_serving_s']} s | |"
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A site's link carries each model file once.")
    parser.add_argument("--rate-mbit", type=int, default=DEFAULT_RATE_MBIT)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvl-bench-site-") as tmp:
        measured = measure(Path(tmp), args.rate_mbit)
    if measured is None:
        return 0
    result = {**stamp(), **measured}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
