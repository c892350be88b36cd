"""Models benchmark (`just bench models`): a model brought to a node.

What is measured, on one machine in one run:

* **Pull throughput.** The hub's pull (`hub/models/pull.py`'s `pull`, what `kvl hub models
  pull` and the hub's pull jobs run: the listing, the redirect, the download written to its
  part file while its sha256 is computed, then the check and the inspection of the GGUF) of
  a ``--size-mib`` file, against `curl -sSL -o FILE` of the same resolve URL (which only
  writes the bytes) and against `curl` followed by `openssl dgst -sha256` (the same work:
  the bytes and their check, hashed by the fastest sha256 this machine has), alternated,
  ``--runs`` each. All fetch from one local stand-in of the Hugging Face Hub
  (tests/hfhub.py, in a process of its own: the public Hub cannot be reached from these
  machines), over loopback and then, where network namespaces can be made, over a veth link
  whose stand-in side is shaped with `tc` to the rates a site's uplink has (1, 2.5 and 5
  Gbit/s). Unshaped, the transfer runs at what the machine's cores can copy, and the pull's
  sha256 competes with the copying for them.
* **Pull to first token.** A hub and an appliance on loopback (in this process; the model
  worker is the appliance's own process) with the appliance enrolled: the embedded chat
  model's file pulled from the stand-in, deployed with a preset, placed, fetched by the
  node, loaded, and a chat answered: seconds from the pull's start to the chat's first
  token, and the steps.
* **The replica estimate against resident memory** of each embedded model's worker at the
  node defaults (4 slots of 4096 tokens), after one chat each.

Run: ``python -m tests.benchmarks.models [--size-mib 512] [--runs 3] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.benchmarks.report import headline, table
from tests.benchmarks.serving import free_port, say, stamp

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "models.json"
REPOSITORY = "bench/Bench-GGUF"
SMOL_REPOSITORY = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
SMOL_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"


# -- the stand-in, in a process of its own ----------------------------------------------------


def serve_stand_in(folder: Path, size_mib: int, port_file: Path, host: str) -> None:
    """`python -m tests.benchmarks.models --stand-in`: the stand-in with a file of
    `size_mib` and the embedded chat model's, on `host`, until killed."""
    from appliance.serving.catalog import CHAT_MODEL_NAME, EMBEDDED  # noqa: PLC0415
    from tests.hfhub import Repo, StandIn, tiny_gguf  # noqa: PLC0415

    smol = EMBEDDED[CHAT_MODEL_NAME].sources()[0].read_bytes()
    big = tiny_gguf("bench", size_mib << 20)
    stand_in = StandIn(
        {REPOSITORY: Repo({"bench-q8_0.gguf": big}), SMOL_REPOSITORY: Repo({SMOL_FILE: smol})},
        folder,
    )
    del big, smol

    async def main() -> None:
        async def factory(app: web.Application) -> TestServer:
            server = TestServer(app, host=host)
            await server.start_server()
            return server

        await stand_in.start(factory)  # type: ignore[arg-type]
        port_file.write_text(json.dumps({"hub": stand_in.hub_url}))  # noqa: ASYNC240 - once
        await asyncio.Event().wait()

    asyncio.run(main())


def start_stand_in(
    work: Path, size_mib: int, host: str = "127.0.0.1", inside: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """The stand-in's process (`inside`: the command prefix that runs it in a namespace)."""
    port_file = work / "stand-in.json"
    port_file.unlink(missing_ok=True)
    process = subprocess.Popen(
        [*(inside or []), sys.executable, "-m", "tests.benchmarks.models", "--stand-in",
         str(work / "blobs"), "--size-mib", str(size_mib), "--port-file", str(port_file),
         "--host", host],
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the stand-in did not start")
        time.sleep(0.2)
    return process, json.loads(port_file.read_text())["hub"]


# -- pull against curl ----------------------------------------------------------------------


def pull_once(hub_url: str, work: Path, run: int) -> float:
    """Seconds of one pull (in this process), into a fresh data directory."""
    from hub.models.pull import Naming, pull  # noqa: PLC0415
    from tests.hubs import settings_for  # noqa: PLC0415

    data = work / f"pull-{run}"
    settings = settings_for(data, models={"hf_endpoint": hub_url})
    started = time.perf_counter()
    asyncio.run(pull(f"hf://{REPOSITORY}/bench-q8_0.gguf", settings, Naming("bench", str(run))))
    took = time.perf_counter() - started
    shutil.rmtree(data)
    return took


def curl_once(hub_url: str, work: Path, *, check: bool = False) -> float:
    """Seconds of `curl -o` of the file (`check`: and then its sha256, by OpenSSL)."""
    target = work / "curl.gguf"
    started = time.perf_counter()
    subprocess.run(
        ["curl", "-sSL", "-o", str(target), f"{hub_url}/{REPOSITORY}/resolve/main/bench-q8_0.gguf"],
        check=True,
    )  # fmt: skip
    if check:
        subprocess.run(
            ["openssl", "dgst", "-sha256", str(target)], check=True, stdout=subprocess.DEVNULL
        )
    took = time.perf_counter() - started
    target.unlink()
    return took


def throughput(hub_url: str, work: Path, size_mib: int, runs: int) -> dict[str, Any]:
    """Pull, curl, and curl then sha256 of one file from `hub_url`, alternated."""
    times: dict[str, list[float]] = {"pull": [], "curl": [], "curl_sha256": []}
    for run in range(runs):
        times["curl"].append(curl_once(hub_url, work))
        times["pull"].append(pull_once(hub_url, work, run))
        times["curl_sha256"].append(curl_once(hub_url, work, check=True))
    median = {name: statistics.median(seconds) for name, seconds in times.items()}
    return {
        **{f"{name}_s": [round(x, 3) for x in seconds] for name, seconds in times.items()},
        **{f"{name}_mib_s": round(size_mib / median[name], 1) for name in times},
        "ratio": round(median["curl"] / median["pull"], 3),
        "ratio_same_work": round(median["curl_sha256"] / median["pull"], 3),
    }


LINK_RATES = (("1 Gbit/s", "1gbit"), ("2.5 Gbit/s", "2500mbit"), ("5 Gbit/s", "5gbit"))


def over_links(work: Path, size_mib: int, runs: int) -> list[dict[str, Any]]:
    """The stand-in in one namespace, the pulls and curls in another, one veth link between
    them shaped in turn to each of LINK_RATES (a token bucket on the stand-in's side: what
    it sends). Empty, said, where namespaces cannot be made."""
    from image import netns  # noqa: PLC0415
    from tests.netns import B_ADDR, linked_namespaces  # noqa: PLC0415

    tc = shutil.which("tc", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    why = netns.available() or (None if tc else "`tc` (iproute2) is not installed")
    if why is not None or tc is None:
        say(f"  no shaped links: {why}")
        return []
    links: list[dict[str, Any]] = []
    with linked_namespaces() as link:
        stand_in, hub_url = start_stand_in(work, size_mib, B_ADDR, netns.argv(link.b))
        try:
            for label, rate in LINK_RATES:
                subprocess.run(
                    [tc, "-n", link.b, "qdisc", "replace", "dev", link.veth_b, "root", "tbf",
                     "rate", rate, "burst", "4mb", "latency", "100ms"],
                    check=True,
                )  # fmt: skip
                measured = subprocess.run(
                    netns.argv(link.a, sys.executable, "-m", "tests.benchmarks.models",
                               "--measure", hub_url, "--size-mib", str(size_mib),
                               "--runs", str(runs)),
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                links.append({"link": label, **json.loads(measured.stdout)})
                say(f"  {label}: {links[-1]['ratio']}x curl")
        finally:
            stand_in.kill()
            stand_in.wait()
    return links


# -- pull to first token -------------------------------------------------------------------------


async def first_token(hub_url: str, work: Path) -> dict[str, Any]:
    """A hub and an enrolled appliance on loopback: pull, deploy, placed, first token."""
    from appliance.gateway.appkeys import REGISTRY  # noqa: PLC0415
    from appliance.serving.catalog import register_file  # noqa: PLC0415
    from appliance.state.store import Store  # noqa: PLC0415
    from hub.app import create_app as create_hub  # noqa: PLC0415
    from hub.identity import ssl_context  # noqa: PLC0415
    from hub.models.pull import pull  # noqa: PLC0415
    from hub.state.deployments import DeploymentRecord  # noqa: PLC0415
    from hub.state.store import open_store  # noqa: PLC0415
    from shared.protocol import ModelPreset  # noqa: PLC0415
    from tests.appliance.fleet_nodes import join  # noqa: PLC0415
    from tests.conftest import SCRIPT  # noqa: PLC0415
    from tests.hubs import settings_for  # noqa: PLC0415

    servers: list[TestServer] = []

    async def factory(app: web.Application, *, port: int | None = None, **kw: Any) -> TestServer:
        """As pytest-aiohttp's `aiohttp_server` (tests/appliance/fleet_nodes.py takes one)."""
        server = TestServer(app, host="127.0.0.1", port=port)
        await server.start_server(**kw)
        servers.append(server)
        return server

    hub = settings_for(work / "fleet", models={"hf_endpoint": hub_url},
                       fleet={"placement_every_s": 0.2})  # fmt: skip
    catalog = Store(work / "own.db")
    script = work / "own.json"
    script.write_text(json.dumps(SCRIPT))
    own = register_file(catalog, script, "own", "1")  # the node's own model: not measured
    catalog.close()
    hub_server = await factory(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    node = await join(factory, work / "fleet", own, hub, hub_server.port, name="node",
                      model={"n_threads": 2})  # fmt: skip
    try:
        started = time.perf_counter()
        model = await pull(f"hf://{SMOL_REPOSITORY}:Q4_1", hub)
        pulled = time.perf_counter()
        store = open_store(hub)
        store.deployments.add_model(model)
        preset = ModelPreset(n_ctx=2048, n_slots=2, aliases=["gpt-4o-mini"])
        chosen = preset.model_dump(exclude_defaults=True)
        store.deployments.add(DeploymentRecord("bench", model.ref, 1, "S1", "I1", {}, chosen))
        store.close()
        while model.ref not in {r.ref for r in node.app[REGISTRY].served()}:
            if time.perf_counter() - started > 600:
                raise RuntimeError("the model never served")
            await asyncio.sleep(0.05)
        placed = time.perf_counter()
        headers = {"Authorization": f"Bearer {node.key}"}
        body = {"model": "gpt-4o-mini", "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hello?"}]}  # fmt: skip
        async with (
            aiohttp.ClientSession(node.base_url, headers=headers) as http,
            http.post("/v1/chat/completions", json=body) as response,
        ):
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.startswith(b"data: {") and b'"content"' in line:
                    break
        token = time.perf_counter()
        return {
            "model": model.ref,
            "size_mib": round(model.size_bytes / 2**20, 1),
            "pull_s": round(pulled - started, 2),
            "placed_s": round(placed - pulled, 2),  # placed, fetched by the node, loaded
            "first_token_s": round(token - placed, 2),
            "total_s": round(token - started, 2),
        }
    finally:
        for server in reversed(servers):
            await server.close()


# -- the estimate against resident memory -------------------------------------------------------


async def fit(work: Path) -> dict[str, Any]:
    from appliance.app import create_app  # noqa: PLC0415
    from appliance.gateway.appkeys import REGISTRY  # noqa: PLC0415
    from appliance.serving.catalog import CHAT_MODEL_NAME, DEFAULT_MODEL_NAME  # noqa: PLC0415
    from appliance.state.store import Store  # noqa: PLC0415
    from shared.gguf import DEFAULT_N_CTX, DEFAULT_N_SLOTS  # noqa: PLC0415
    from tests.conftest import make_settings  # noqa: PLC0415

    settings = make_settings(
        work / "fit", model={"n_ctx": DEFAULT_N_CTX, "n_slots": DEFAULT_N_SLOTS, "n_threads": 2},
        embeddings={"enabled": False},
    )  # fmt: skip
    store = Store(settings.db_path)
    key = store.create_key("fit", admin=True).plaintext
    store.close()
    app = create_app(settings)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        await app[REGISTRY].wait_loaded()
        headers = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(str(server.make_url("")), headers=headers) as http:
            for model in (DEFAULT_MODEL_NAME, CHAT_MODEL_NAME):
                body = {"model": model, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
                async with http.post("/v1/chat/completions", json=body) as answer:
                    assert answer.status == 200, await answer.text()
            async with http.get("/v1/admin/models") as listed:
                data = (await listed.json())["data"]
        return {
            e["name"]: {
                "estimate_mib": round(e["memory_estimate_mib"]),
                "resident_mib": round(e["memory_resident_mib"]),
                "error": round(e["memory_estimate_mib"] / e["memory_resident_mib"] - 1, 3),
            }
            for e in data
            if e["name"] in {DEFAULT_MODEL_NAME, CHAT_MODEL_NAME} and e["memory_resident_mib"]
        }
    finally:
        await server.close()


# -- the run ------------------------------------------------------------------------------------


def measure(size_mib: int, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvl-bench-models-") as tmp:
        work = Path(tmp)
        stand_in, hub_url = start_stand_in(work, size_mib)
        try:
            say(f"pull against curl: {size_mib} MiB, {runs} runs each, over loopback")
            loopback = throughput(hub_url, work, size_mib, runs)
            say(f"  loopback: {loopback['ratio']}x curl")
            say("pull to first token: the embedded chat model, a hub and a node on loopback")
            token = asyncio.run(first_token(hub_url, work))
        finally:
            stand_in.kill()
            stand_in.wait()
        say("pull against curl over a veth link shaped to a site's uplink rates")
        links = over_links(work, size_mib, runs)
        say("the replica estimate against resident memory")
        memory = asyncio.run(fit(work))
    pulled = {"size_mib": size_mib, "runs": runs,
              "links": [{"link": "loopback (unshaped)", **loopback}, *links]}  # fmt: skip
    return {**stamp(), "pull": pulled, "first_token": token, "fit": memory}


def markdown(result: dict[str, Any]) -> str:
    p, t = result["pull"], result["first_token"]
    rows = [
        [link["link"], f"{link['curl_mib_s']} MiB/s", f"{link['curl_sha256_mib_s']} MiB/s",
         f"{link['pull_mib_s']} MiB/s", f"**{link['ratio']}x**", f"{link['ratio_same_work']}x"]
        for link in p["links"]
    ]  # fmt: skip
    fit_rows = [
        [f"`{name}`", f"{f['estimate_mib']} MiB", f"{f['resident_mib']} MiB",
         f"{f['error'] * 100:+.1f} %"]
        for name, f in sorted(result["fit"].items())
    ]  # fmt: skip
    pulled = (
        f"Pull of a {p['size_mib']} MiB file from the local stand-in of the Hugging Face Hub "
        f"(median of {p['runs']} runs each):"
    )
    token = (
        f"From `pull` to the first token of a chat on the node: **{t['total_s']} s** for "
        f"`{t['model']}` ({t['size_mib']} MiB): the pull {t['pull_s']} s, placed, fetched "
        f"and loaded {t['placed_s']} s, the first token {t['first_token_s']} s."
    )
    return "\n".join([
        headline(result), "", pulled, "",
        *table(["link", "curl -o", "curl + sha256", "pull", "pull against curl",
                "against curl + sha256"], rows),
        "", token, "", *table(["model", "estimate", "resident", "error"], fit_rows),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--stand-in", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--measure", metavar="HUB_URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stand_in is not None:
        serve_stand_in(args.stand_in, args.size_mib, args.port_file, args.host)
        return 0
    if args.measure is not None:  # one link's throughput, run inside its namespace
        with tempfile.TemporaryDirectory(prefix="kvl-bench-pull-") as tmp:
            measured = throughput(args.measure, Path(tmp), args.size_mib, args.runs)
        sys.stdout.write(json.dumps(measured) + "\n")
        return 0
    os.environ.setdefault("KVL_TESTS", "full")
    result = measure(args.size_mib, args.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    say(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
