"""HTTP/2 on the LAN API: nginx in front of the app (appliance/gateway/front.py), as the
appliance runs it, against plain HTTP/1.1 served by the app itself on a TLS port.

One appliance process (the real app, no model loaded, the embedding model off) serves its
own TLS port (HTTP/1.1, as with `server.http2: false`) and, behind a `Front` (Debian's
nginx, started by it as `kvl appliance serve` does), a second one. Three ways in:

- ``http1``: HTTP/1.1 over TLS to the app itself;
- ``http1-front``, ``h2-front``: HTTP/1.1 or HTTP/2 over TLS to nginx, which passes each
  request to the app over HTTP/1.1 on its private unix socket.

Three requests: ``healthz`` (the lightest route), ``models`` (`GET /v1/models` with an
API key) and ``sse`` (a server-sent event stream of 100 events, written with the
gateway's own sse module, each on a turn of the event loop of its own as a model's tokens
come, on a route the benchmark adds). For each: mean latency with one client at a time,
then throughput and the server side's CPU per request (the appliance process and its
children: nginx's master and worker) with 8 connections, one request at a time each;
h2load (`--h1` for HTTP/1.1) drives them all. Rounds repeat it all; medians.

HTTP/2 served in the appliance's own process (the `h2` library, each stream a request to
the app) was measured by this benchmark at commit a1e517e and cost two to three times the
CPU of this front per request (docs/benchmarks.md, "HTTP/2").

Run: ``python -m tests.benchmarks.http2 [--seconds 4] [--rounds 2]``; needs h2load
(Debian's nghttp2-client) and nginx (`just setup-system`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from aiohttp import web

from tests.benchmarks.report import TIMES, headline, table
from tests.benchmarks.serving import HOST, commit, cpu_model, free_port, say, tree_cpu_seconds

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "http2.json"
EVENTS = 100
CONNECTIONS = 8
VARIANTS = ("http1", "http1-front", "h2-front")
WORKLOADS = {"healthz": "/healthz", "models": "/v1/models", "sse": "/bench/events"}


# -- the server process -------------------------------------------------------------------------


async def _events(request: web.Request) -> web.StreamResponse:
    """100 events shaped like a chat completion's chunks, through the gateway's sse module."""
    from appliance.gateway import sse  # noqa: PLC0415 - the serving process only

    response = await sse.open_stream(request)
    for i in range(EVENTS):
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "model": "bench",
            "choices": [{"index": 0, "delta": {"content": f" word{i}"}, "finish_reason": None}],
        }
        await sse.send(response, chunk)
        await asyncio.sleep(0)  # each token comes on a turn of the loop of its own
    await sse.send_done(response)
    await response.write_eof()
    return response


async def _serve(args: argparse.Namespace) -> None:
    from appliance.app import create_app  # noqa: PLC0415
    from appliance.gateway.front import Front, nginx_binary, trust_forwarded  # noqa: PLC0415
    from appliance.gateway.server import ApplianceRunner, ListenerRunner  # noqa: PLC0415
    from appliance.settings import ApplianceSettings  # noqa: PLC0415

    settings = ApplianceSettings.model_validate(
        {
            "data_dir": args.data,
            "model": {"default": "absent-model"},
            "embeddings": {"enabled": False},
            "discovery": {"enabled": False},
            "classes": {"auth_failures_per_minute": 1_000_000},
        }
    )
    app = create_app(settings)
    app.router.add_get("/bench/events", _events)
    runner = ApplianceRunner(app, access_log=None)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.cert, args.key)
    await web.TCPSite(runner, HOST, args.port, ssl_context=context).start()
    # The front's own server: only its requests take their client from X-Forwarded-For.
    behind = ListenerRunner(app)
    await behind.setup()
    binary = nginx_binary()
    if binary is None or behind.server is None:
        raise RuntimeError("nginx is not installed: run `just setup-system`")
    trust_forwarded(behind.server)
    front = Front(
        binary,
        host=HOST,
        port=args.front_port,
        certificate=(args.cert, args.key),
        max_streams=settings.server.http2_max_streams,
        max_body_bytes=settings.server.max_body_bytes,
    )
    await web.UnixSite(behind, str(front.upstream)).start()
    await front.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    say("serving")
    await stop.wait()
    await front.stop()
    await behind.cleanup()
    await runner.cleanup()


def make_certificate(work: Path) -> tuple[Path, Path]:
    cert, key = work / "cert.pem", work / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=bench", "-addext", f"subjectAltName=IP:{HOST}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _wait_https(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    context = ssl._create_unverified_context()  # noqa: S323 - our own throwaway certificate
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, context=context, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


# -- the load -----------------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(number) * _UNITS[unit]


def _h2load(
    url: str, headers: list[str], connections: int, seconds: int, *, h1: bool
) -> dict[str, float]:
    args = ["h2load", f"-c{connections}", "-m1", f"-D{seconds}", *(["--h1"] if h1 else [])]
    for header in headers:
        args += ["-H", header]
    timeout = seconds + 60
    for attempt in (1, 2):
        try:
            # h2load 1.52 at times keeps sending past its -D over HTTP/1.1 through nginx
            # (seen once: ten minutes, the server busy all along); such a run is discarded.
            done = subprocess.run(
                [*args, url], check=True, capture_output=True, text=True, timeout=timeout
            )
            break
        except subprocess.TimeoutExpired:
            say(f"http2: h2load ran past {timeout} s of a {seconds} s run (attempt {attempt})")
    else:
        raise RuntimeError(f"h2load did not stop after {seconds} s, twice: {url}")
    out = done.stdout
    if f"Application protocol: {'http/1.1' if h1 else 'h2'}" not in out:
        raise RuntimeError(f"h2load did not speak {'http/1.1' if h1 else 'h2'}:\n{out}")
    counts = re.search(
        r"(\d+) done, \d+ succeeded, (\d+) failed, (\d+) errored, (\d+) timeout", out
    )
    if counts is None or any(int(n) for n in counts.groups()[1:]):
        raise RuntimeError(f"h2load saw errors:\n{out}")
    mean = _ms(re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    return {"requests": int(counts.group(1)), "mean_ms": mean}


def measure(
    url: str, headers: list[str], seconds: int, processes: list[psutil.Process], *, h1: bool
) -> dict[str, float]:
    latency = _h2load(url, headers, 1, max(1, seconds // 2), h1=h1)
    before = sum(tree_cpu_seconds(p) for p in processes)
    started = time.perf_counter()
    load = _h2load(url, headers, CONNECTIONS, seconds, h1=h1)
    elapsed = time.perf_counter() - started
    cpu = sum(tree_cpu_seconds(p) for p in processes) - before
    return {
        "latency_ms_one_client": latency["mean_ms"],
        "requests_per_s": load["requests"] / elapsed,
        "mean_ms_8_connections": load["mean_ms"],
        "server_cpu_us_per_request": cpu / load["requests"] * 1e6,
    }


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: round(statistics.median(run[name] for run in runs), 3) for name in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=int, default=4, help="load per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (medians are kept)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--front-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cert", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--key", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args))
        return 0
    if shutil.which("h2load") is None:
        raise SystemExit("h2load is not installed: run `just setup-system` (nghttp2-client)")
    with tempfile.TemporaryDirectory(prefix="kvl-http2-") as tmp:
        return _run(Path(tmp), args)


def _run(work: Path, args: argparse.Namespace) -> int:
    cert, key = make_certificate(work)
    data, port, front_port = work / "data", free_port(), free_port()
    api_key = subprocess.run(
        [sys.executable, "-m", "shared.cli", "appliance", "keys", "create", "--account", "bench",
         "--data-dir", str(data)],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    with (work / "serve.log").open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.benchmarks.http2", "--serve", "--data", str(data),
             "--port", str(port), "--front-port", str(front_port), "--cert", str(cert),
             "--key", str(key)],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        _wait_https(f"https://{HOST}:{port}/healthz", server)
        _wait_https(f"https://{HOST}:{front_port}/healthz", server)
        # The appliance and its children (nginx): the server side, whichever way in.
        appliance = [psutil.Process(server.pid)]
        # Rounds, each every workload over every variant: the machine's other load
        # falls on all of them alike.
        for round_ in range(args.rounds):
            for workload, path in WORKLOADS.items():
                headers = [f"Authorization: Bearer {api_key}"] if path.startswith("/v1/") else []
                for variant in VARIANTS:
                    say(f"http2: round {round_ + 1}, {workload} over {variant}")
                    target = front_port if variant.endswith("-front") else port
                    figures = measure(
                        f"https://{HOST}:{target}{path}",
                        headers,
                        args.seconds,
                        appliance,
                        h1=variant.startswith("http1"),
                    )
                    runs.setdefault((workload, variant), []).append(figures)
        nginx = appliance[0].children(recursive=True)
        rss = {
            "appliance_mib": round(appliance[0].memory_info().rss / 2**20, 1),
            "nginx_mib": round(sum(p.memory_info().rss for p in nginx) / 2**20, 1),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
    results: dict[str, dict[str, Any]] = {}
    for (workload, variant), each in runs.items():
        results.setdefault(workload, {})[variant] = _medians(each)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "loadavg_after": os.getloadavg(),
        "connections": CONNECTIONS,
        "events_per_stream": EVENTS,
        "rss_after": rss,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for workload, variants in results.items():
        for variant, figures in variants.items():
            say(f"{workload:8} {variant:12} {json.dumps(figures)}")
    return 0


# The columns of docs/benchmarks.md's table: (label, which result, its variant).
COLUMNS = (
    ("HTTP/1.1, the app", "front", "http1"),
    ("h2 in the app's process", "in_process", "h2"),
    ("h2, nginx in front", "front", "h2-front"),
    ("HTTP/1.1, nginx in front", "front", "http1-front"),
)


def markdown(result: dict[str, Any], in_process: dict[str, Any] | None = None) -> str:
    """The table docs/benchmarks.md shows, from a result and, for the column of HTTP/2
    served in the app's process (a design measured and not kept, so no longer run), the
    result of the commit that had it: each column says which run it comes from."""
    sources = {"front": result, "in_process": in_process or {}}
    columns = [c for c in COLUMNS if _has(sources[c[1]], c[2])]
    workloads = list(result["results"])

    def cell(workload: str, source: str, variant: str, key: str, fmt: str) -> str:
        figures = sources[source]["results"].get(workload, {}).get(variant)
        return format(figures[key], fmt) if figures else "—"

    def cost(workload: str, source: str, variant: str) -> str:
        figures = sources[source]["results"].get(workload, {}).get(variant)
        if not figures:
            return "—"
        cpu, latency = figures["server_cpu_us_per_request"], figures["latency_ms_one_client"]
        text = f"{cpu:,.0f} / {_latency(latency)}"
        return f"**{text}**" if variant == "h2-front" else text

    label = {
        "healthz": "`GET /healthz`",
        "models": "`GET /v1/models` (API key)",
        "sse": f"SSE, {result['events_per_stream']} events",
    }
    lines = [headline(result, *_conditions(result))]
    if in_process and any(source == "in_process" for _, source, _ in columns):
        # The in-process design is not run any more: its column is the run of the commit
        # that had it, and says so.
        lines.append(
            "The column of h2 in the app's process is the run of `http2-in-process.json`. "
            + headline(in_process, *_conditions(in_process))
        )
    lines += [
        "",
        *table(
            ["CPU per request (µs) / latency (ms)", *(c[0] for c in columns)],
            [[label.get(w, w), *(cost(w, c[1], c[2]) for c in columns)] for w in workloads],
        ),
        "",
        *table(
            [f"requests/s, {result['connections']} connections", *(c[0] for c in columns)],
            [
                [label.get(w, w), *(cell(w, c[1], c[2], "requests_per_s", ",.0f") for c in columns)]
                for w in workloads
            ],
        ),
        "",
        _cpu_sentence(sources, workloads),
    ]
    return "\n".join(lines) + "\n"


def _conditions(result: dict[str, Any]) -> list[str]:
    """How a run was made, and the machine's load: this suite ran beside other work."""
    more = [f"{result['rounds']} rounds of {result['seconds']} s, medians"]
    if result.get("loadavg_after"):
        more.append(f"load average at the end {result['loadavg_after'][0]:.1f}")
    return more


def _has(source: dict[str, Any], variant: str) -> bool:
    return any(variant in figures for figures in source.get("results", {}).values())


def _cpu(figures: dict[str, float]) -> float:
    return figures["server_cpu_us_per_request"]


def _latency(value: float) -> str:
    """Two decimals under 2 ms, one above: the precision h2load's means carry here."""
    return f"{value:.2f}" if value < 2 else f"{value:.1f}"


SHORT = {"healthz": "`/healthz`", "models": "`/v1/models`", "sse": "SSE"}


def _cpu_sentence(sources: dict[str, dict[str, Any]], workloads: list[str]) -> str:
    """CPU per request against HTTP/1.1 served by the app, each against the HTTP/1.1 of its
    own run; and what each process held at the end."""
    parts = []
    for name, source, variant in COLUMNS:
        if variant == "http1" or not _has(sources[source], variant):
            continue
        results = sources[source]["results"]
        ratios = [
            f"{SHORT.get(w, w)} {_cpu(results[w][variant]) / _cpu(results[w]['http1']):.2f}{TIMES}"
            for w in workloads
            if variant in results.get(w, {}) and "http1" in results.get(w, {})
        ]
        parts.append(f"{name}: {', '.join(ratios)}")
    rss = sources["front"]["rss_after"]
    return (
        "CPU per request against HTTP/1.1 served by the app (in the same run): "
        + "; ".join(parts)
        + f". Resident at the end: the appliance {rss['appliance_mib']} MiB, nginx's master "
        f"and worker {rss['nginx_mib']} MiB."
    )


if __name__ == "__main__":
    raise SystemExit(main())
