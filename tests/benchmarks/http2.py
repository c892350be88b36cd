"""HTTP/2 on the LAN API: the appliance's own h2 front (appliance/gateway/http2.py)
against plain HTTP/1.1 on the same TLS port, and against nginx in front of the app.

One appliance process (the real app, no model loaded, the embedding model off) serves
TLS on a port (ALPN h2 and http/1.1) and plain HTTP/1.1 on a unix socket; Debian's nginx
(one worker, `listen … ssl http2`, `proxy_buffering off`, kept upstream connections to
that socket) is the other way to offer h2. Three ways to reach the same app:

- ``http1``: HTTP/1.1 over TLS to the appliance;
- ``h2``: HTTP/2 over TLS to the appliance;
- ``http1-nginx``, ``h2-nginx``: HTTP/1.1 or HTTP/2 over TLS to nginx, HTTP/1.1 from
  nginx to the appliance's unix socket.

Three requests: ``healthz`` (the lightest route), ``models`` (`GET /v1/models` with an
API key) and ``sse`` (a server-sent event stream of 100 events, written with the
gateway's own sse module, each on a turn of the event loop of its own as a model's tokens
come, on a route the benchmark adds). For each: mean latency with one client at a time,
then throughput and the server side's CPU per request (the appliance process, plus
nginx's master and worker when it is in front) with 8 connections, one request at a time
each; h2load (`--h1` for HTTP/1.1) drives them all. Rounds repeat it all; medians.

Run: ``python -m tests.benchmarks.http2 [--seconds 6] [--rounds 3]``; needs h2load
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

from tests.benchmarks.serving import HOST, cpu_model, free_port, say, tree_cpu_seconds, tree_rss

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "http2.json"
EVENTS = 100
CONNECTIONS = 8
VARIANTS = ("http1", "h2", "http1-nginx", "h2-nginx")
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
    from appliance.gateway.server import ApplianceRunner, lan_site  # noqa: PLC0415
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
    await lan_site(runner, app, HOST, args.port, context).start()
    await web.UnixSite(runner, str(args.unix)).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    say("serving")
    await stop.wait()
    await runner.cleanup()


# -- the peers ----------------------------------------------------------------------------------


def make_certificate(work: Path) -> tuple[Path, Path]:
    cert, key = work / "cert.pem", work / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=bench", "-addext", f"subjectAltName=IP:{HOST}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def start_nginx(
    work: Path, cert: Path, key: Path, socket_path: Path
) -> tuple[subprocess.Popen[bytes], int]:
    nginx = shutil.which("nginx", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
    if nginx is None:
        raise RuntimeError("nginx is not installed: run `just setup-system`")
    port = free_port()
    user = "user root;" if os.geteuid() == 0 else ""  # the socket is the benchmark's
    temp = work / "nginx-temp"
    temp.mkdir(exist_ok=True)
    temps = "".join(
        f"  {kind}_temp_path {temp};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # nginx 1.22 (Debian 12) spells HTTP/2 `listen … http2`; 1.25+ has `http2 on;`.
    (work / "nginx.conf").write_text(
        f"{user}\ndaemon off;\nworker_processes 1;\npid {work}/nginx.pid;\n"
        f"error_log {work}/nginx-error.log;\nevents {{ worker_connections 1024; }}\n"
        f"http {{\n  access_log off;\n{temps}"
        f"  upstream app {{ server unix:{socket_path}; keepalive 32; }}\n"
        f"  server {{\n    listen {HOST}:{port} ssl http2;\n"
        f"    ssl_certificate {cert};\n    ssl_certificate_key {key};\n"
        "    http2_max_concurrent_streams 100;\n    client_max_body_size 1m;\n"
        "    location / {\n      proxy_pass http://app;\n      proxy_http_version 1.1;\n"
        '      proxy_set_header Connection "";\n      proxy_set_header Host $host;\n'
        "      proxy_set_header X-Forwarded-For $remote_addr;\n"
        "      proxy_buffering off;\n      proxy_request_buffering off;\n    }\n  }\n}\n"
    )
    process = subprocess.Popen([nginx, "-c", str(work / "nginx.conf"), "-p", str(work)])
    return process, port


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
    out = subprocess.run([*args, url], check=True, capture_output=True, text=True).stdout
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
    parser.add_argument("--seconds", type=int, default=6, help="load per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (medians are kept)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--unix", type=Path, help=argparse.SUPPRESS)
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
    data, socket_path, port = work / "data", work / "app.sock", free_port()
    api_key = subprocess.run(
        [sys.executable, "-m", "shared.cli", "appliance", "keys", "create", "--account", "bench",
         "--data-dir", str(data)],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.benchmarks.http2", "--serve", "--data", str(data),
         "--port", str(port), "--unix", str(socket_path), "--cert", str(cert), "--key", str(key)],
        stdout=subprocess.DEVNULL, stderr=(work / "serve.log").open("wb"),
    )  # fmt: skip
    nginx, nginx_port = start_nginx(work, cert, key, socket_path)
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        _wait_https(f"https://{HOST}:{port}/healthz", server)
        _wait_https(f"https://{HOST}:{nginx_port}/healthz", nginx)
        appliance, front = psutil.Process(server.pid), psutil.Process(nginx.pid)
        # Rounds, each every workload over every variant: the machine's other load
        # falls on all of them alike.
        for round_ in range(args.rounds):
            for workload, path in WORKLOADS.items():
                headers = [f"Authorization: Bearer {api_key}"] if path.startswith("/v1/") else []
                for variant in VARIANTS:
                    say(f"http2: round {round_ + 1}, {workload} over {variant}")
                    proxied = variant.endswith("-nginx")
                    url = f"https://{HOST}:{nginx_port if proxied else port}{path}"
                    processes = [appliance, front] if proxied else [appliance]
                    figures = measure(
                        url, headers, args.seconds, processes, h1=variant.startswith("http1")
                    )
                    runs.setdefault((workload, variant), []).append(figures)
        rss = {"appliance_mib": round(tree_rss(appliance) / 2**20, 1),
               "nginx_mib": round(tree_rss(front) / 2**20, 1)}  # fmt: skip
    finally:
        for process in (nginx, server):
            process.terminate()
            process.wait(timeout=30)
    results: dict[str, dict[str, Any]] = {}
    for (workload, variant), figures in runs.items():
        results.setdefault(workload, {})[variant] = _medians(figures)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
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
            say(f"{workload:8} {variant:9} {json.dumps(figures)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
