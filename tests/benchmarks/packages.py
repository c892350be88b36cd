"""Content packages: time to a validated package (or its refusal), first-pass validity,
and cached downloads against nginx.

A real `kvl appliance serve` on loopback with the default model (2 threads; writer and
checker) and the embedding model (1 thread, for the on_topic check):
1. time to a validated 10-item package with narration (`"wait": true`, mixed item
   types), from request to answer, or to its refusal (the checks it failed: a small model's
   keys are seldom all confirmed by its own answers; tests/benchmarks/quality.py measures
   whether they are right);
2. first-pass validity over 20 generations: 20 topics, one 3-item package each without
   narration; the share that passed every check at the first attempt (the rest needed
   items made again, or were refused; none may be delivered unvalidated);
3. cached download throughput: the largest file of a narrated 10-item package (a WAV; the
   package made by a scripted writer, the appliance restarted with it as `packages.model`:
   what is measured is serving a cached file, whatever wrote it) fetched over and over by 16
   connections of h2load (C, HTTP/1.1) for `--seconds`, from the appliance (authenticated,
   the blob's digest checked, ETag) and from nginx (Debian's, `sendfile on`, one worker)
   serving the very same blob file; bytes per second, as a ratio, and each server's CPU
   time per request: the app straight (plain HTTP), then the appliance restarted with TLS
   and `server.http2` (its front: nginx sends the file once the app decided, the decision
   kept a second) against that nginx over TLS too, with the same self-signed certificate
   (both pay TLS). The target (≥ 0.8) is on the front's row; the appliance's CPU is its
   process tree's, its nginx included;
4. the two voices' cost: the scripted writer's narrated 10-item package (its items cost
   nothing) read by espeak-ng, then again from an appliance restarted with
   `packages.voice: neural` (a new version: another voice reads it).

Run: ``python -m tests.benchmarks.packages``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from tests.benchmarks.report import TIMES, headline, table
from tests.benchmarks.serving import (
    HOST,
    free_port,
    say,
    stamp,
    tree_cpu_seconds,
)
from tests.packages import package_script

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "packages.json"
PACKAGE_WRITER = "scripted-packages"  # the downloads' package's writer
TOPICS = [
    "the solar system", "photosynthesis", "fractions", "the water cycle", "volcanoes",
    "the human heart", "magnets", "the Roman Empire", "rainforests", "electric circuits",
    "the moon", "dinosaurs", "the alphabet", "weather", "plants", "the ocean", "bees",
    "recycling", "the seasons", "light and shadow",
]  # fmt: skip
CLIENTS = 16
TEN = {"topic": "the solar system", "level": "beginner",
       "spec": {"items": 10, "item_types": ["single_choice", "true_false", "multiple_choice",
                "short_answer"], "narration": True}}  # fmt: skip


def kvl(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


async def ask(
    session: aiohttp.ClientSession, base: str, key: str, body: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    async with session.post(
        f"{base}/v1/packages", json={**body, "wait": True},
        headers={"Authorization": f"Bearer {key}"},
    ) as response:  # fmt: skip
        answer = await response.json()
        if response.status != 200:
            return time.perf_counter() - started, {"error": answer}
        return time.perf_counter() - started, answer


def h2load(
    url: str, headers: dict[str, str], seconds: float, server: psutil.Process
) -> dict[str, float]:
    """CLIENTS connections of h2load (HTTP/1.1, one request at a time each) fetching `url`
    back to back for `seconds`: bytes/s, requests/s, and the server's CPU per request (its
    process tree's user + system time over the run). A client in C, so what is measured is
    the server, not the client's own cost."""
    argv = ["h2load", "--h1", f"-c{CLIENTS}", "-m1", f"-D{max(1, round(seconds))}"]
    for name, value in headers.items():
        argv += ["-H", f"{name}: {value}"]
    cpu_before = tree_cpu_seconds(server)
    out = subprocess.run([*argv, url], check=True, capture_output=True, text=True).stdout
    cpu = tree_cpu_seconds(server) - cpu_before
    counts = re.search(r"(\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", out)
    finished = re.search(r"finished in ([\d.]+)s", out)
    traffic = re.search(r"traffic: \S+ \((\d+)\) total", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if counts is None or finished is None or traffic is None or codes is None:
        raise RuntimeError(f"h2load said what this cannot read:\n{out}")
    done = int(counts.group(1))
    # h2load may count one answer more among the status codes than it counts done (one
    # that came as its -D ran out): every answer a 2xx is what matters.
    others = sum(int(codes.group(i)) for i in (2, 3, 4))
    if (
        done == 0
        or others
        or int(codes.group(1)) < done
        or int(counts.group(3))
        or int(counts.group(4))
    ):
        raise RuntimeError(f"{url}: not every answer was a 200:\n{out}")
    elapsed = float(finished.group(1))
    return {
        "mib_per_s": round(int(traffic.group(1)) / elapsed / 2**20, 1),
        "requests_per_s": round(done / elapsed, 1),
        "server_cpu_us_per_request": round(cpu / done * 1e6, 1),
    }


def start_nginx(
    work: Path, root: Path, tls: tuple[Path, Path] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """Debian's nginx serving `root` as files: sendfile, one worker; over TLS with `tls`
    (certificate, key), as the appliance's front listens."""
    nginx = shutil.which("nginx", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
    if nginx is None:
        raise RuntimeError("nginx is not installed: run `just setup`")
    port = free_port()
    user = "user root;" if os.geteuid() == 0 else ""  # the blobs are owner-only files
    if tls is None:
        listen = f"listen {HOST}:{port};"
    else:
        listen = (
            f"listen {HOST}:{port} ssl http2; ssl_certificate {tls[0]}; "
            f"ssl_certificate_key {tls[1]}; ssl_protocols TLSv1.2 TLSv1.3;"
        )
    conf = work / "nginx.conf"
    temp = work / "nginx-temp"
    temps = "".join(
        f"  {kind}_temp_path {temp};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf.write_text(
        f"{user}\ndaemon off;\nworker_processes 1;\npid {work}/nginx.pid;\n"
        f"error_log {work}/nginx-error.log;\nevents {{ worker_connections 1024; }}\n"
        "http {\n  access_log off;\n  sendfile on;\n  tcp_nopush on;\n"
        f"{temps}  server {{ {listen} root {root}; }}\n}}\n"
    )
    temp.mkdir(exist_ok=True)
    process = subprocess.Popen([nginx, "-c", str(conf), "-p", str(work)])
    # Returned once it listens, so no run measures nginx's start.
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"nginx did not start; see {work}/nginx-error.log") from None
            time.sleep(0.05)
        else:
            return process, port


async def generation(base: str, key: str) -> dict[str, Any]:
    """The real model's packages: the 10-item one, and first-pass validity over 20."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        say("packages: a 10-item package with narration")
        seconds_ten, package = await ask(session, base, key, TEN)
        hit_s = None
        if "error" not in package:
            hit_s, _ = await ask(session, base, key, TEN)
        say("packages: 20 generations for first-pass validity")
        attempts, failed, times = [], 0, []
        for topic in TOPICS:
            spent, answer = await ask(session, base, key, {"topic": topic, "spec": {
                "items": 3, "item_types": ["single_choice", "true_false"],
                "narration": False}})  # fmt: skip
            times.append(spent)
            if "error" in answer:
                failed += 1
            else:
                attempts.append(answer["manifest"]["validation"]["attempts"])
    first_pass = sum(1 for a in attempts if a == 1)
    return {
        "ten_items_with_narration": _outcome(seconds_ten, package)
        | {"cache_hit_s": None if hit_s is None else round(hit_s, 3)},
        "first_pass_validity": {
            "generations": len(TOPICS),
            "first_pass": first_pass,
            "rate": round(first_pass / len(TOPICS), 2),
            "valid_after_retries": len(attempts),
            "failed_after_retries": failed,
            "median_s": round(sorted(times)[len(times) // 2], 1),
        },
    }


def _outcome(seconds: float, package: dict[str, Any]) -> dict[str, Any]:
    """A package's time and what came of it: its attempts, files and bytes, or the
    refusal (the checks it failed)."""
    if "error" in package:
        # (`ask` keeps the answer's whole body: {"error": {"message": …, "code": …}})
        message = str(package["error"].get("error", {}).get("message", ""))
        failed = sorted(set(re.findall(r"(?:^|; |: )([a-z_]+) \(", message)))
        return {"seconds": round(seconds, 1), "refused": True, "failed_checks": failed}
    manifest = package["manifest"]
    return {
        "seconds": round(seconds, 1),
        "attempts": manifest["validation"]["attempts"],
        "files": len(manifest["files"]),
        "bytes": sum(f["size"] for f in manifest["files"]),
    }


async def measure(
    base: str, key: str, seconds: float, work: Path, blobs: Path, *, appliance: psutil.Process
) -> dict[str, Any]:
    """Downloads of the largest file of the scripted writer's narrated 10-item package (a
    narration WAV), from the appliance and from nginx."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        say("packages: the narrated 10-item package to download, from the scripted writer")
        scripted_s, package = await ask(session, base, key, TEN)
    if "error" in package:
        raise RuntimeError(f"the scripted writer's package failed: {package['error']}")
    manifest = package["manifest"]
    largest = max(manifest["files"], key=lambda f: f["size"])
    url = f"{base}/v1/packages/{package['id']}/files/{largest['path']}"
    say(f"packages: downloads of {largest['path']} ({largest['size']} bytes), appliance")
    ours = await asyncio.to_thread(
        h2load, url, {"Authorization": f"Bearer {key}"}, seconds, appliance
    )
    nginx, port = start_nginx(work, blobs)
    try:
        say("packages: the same blob from nginx")
        peer = await asyncio.to_thread(
            h2load, f"http://{HOST}:{port}/{largest['sha256']}", {}, seconds,
            psutil.Process(nginx.pid),
        )  # fmt: skip
    finally:
        nginx.terminate()
        nginx.wait(timeout=30)
    return {
        "file": {"package": package["id"], "path": largest["path"], "sha256": largest["sha256"]},
        # the same package's making when the writer costs nothing: the narration's cost
        "ten_items_scripted_writer": _outcome(scripted_s, package) | {"voice": _voice(package)},
        "download": {
            "file_bytes": largest["size"],
            "clients": CLIENTS,
            "seconds": seconds,
            "client": "h2load --h1, one request at a time per connection",
            "appliance": ours,
            "nginx": peer,
            "ratio": round(ours["mib_per_s"] / peer["mib_per_s"], 2),
            "target_ratio": None,  # the front's row has it
        },
    }


def _unchecked() -> ssl.SSLContext:
    """A client context for the bench's own self-signed certificate (not checked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def answered(base: str, route: str) -> float:
    """How many requests of `route` the appliance at `base` answered (its metrics)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30, context=_unchecked()) as got:
        text = got.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvl_http_requests_total{") and f'route="{route}"' in line
    )


def certificate(work: Path) -> tuple[Path, Path]:
    """A self-signed certificate for loopback (h2load does not check it), as
    server.crt and server.key in `work`: the front's and the peer nginx's."""
    from shared import pki  # noqa: PLC0415

    ca = pki.new_ca("bench CA")
    leaf = pki.issue_with_key(
        ca, common_name=HOST, names=[HOST], uri="spiffe://bench/appliance",
        lifetime=datetime.timedelta(days=1),
    )  # fmt: skip
    pki.write_issued(work, "server", leaf)
    return work / "server.crt", work / "server.key"


def front_download(
    data: Path, env: dict[str, str], work: Path, key: str, file: dict[str, Any], *,
    size: int, seconds: float,
) -> dict[str, Any]:  # fmt: skip
    """The same downloads through the appliance's TLS front (TLS on, `server.http2`)
    against nginx serving the same blob over TLS with the same certificate."""
    cert, private = certificate(work)
    tls_env = {**env, "KVL_SERVER__TLS_CERT_FILE": str(cert),
               "KVL_SERVER__TLS_KEY_FILE": str(private), "KVL_SERVER__HTTP2": "true"}  # fmt: skip
    process, base = serve(data, tls_env, work / "appliance.log", tls=True)
    try:
        say(f"packages: downloads of {file['path']} through the TLS front")
        url = f"{base}/v1/packages/{file['package']}/files/{file['path']}"
        ours = h2load(url, {"Authorization": f"Bearer {key}"}, seconds, psutil.Process(process.pid))
        sent_by_app = answered(base, "/v1/packages/{id}/files/{path}")
    finally:
        stop(process)
    if sent_by_app:  # what was measured would be the app's path, not the front's
        raise RuntimeError(f"the app sent {sent_by_app:.0f} files itself: see the log")
    nginx, port = start_nginx(work, data / "packages" / "blobs" / "sha256", (cert, private))
    try:
        say("packages: the same blob from nginx over TLS")
        peer = h2load(
            f"https://{HOST}:{port}/{file['sha256']}", {}, seconds, psutil.Process(nginx.pid)
        )
    finally:
        nginx.terminate()
        nginx.wait(timeout=30)
    return {
        "file_bytes": size,
        "clients": CLIENTS,
        "seconds": seconds,
        "client": "h2load --h1 over TLS, one request at a time per connection",
        "appliance": ours,
        "nginx": peer,
        "ratio": round(ours["mib_per_s"] / peer["mib_per_s"], 2),
        "target_ratio": 0.8,
    }


def serve(
    data: Path, env: dict[str, str], log: Path, *, tls: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    """`kvl appliance serve` on a free port, once it answers /readyz (over HTTPS with
    `tls`: the certificate is the bench's own, not checked)."""
    context = _unchecked() if tls else None
    port = free_port()
    with log.open("ab") as out:
        process = subprocess.Popen(
            kvl("appliance", "serve", "--data-dir", str(data), "--host", HOST, "--port",
                str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    base = f"{'https' if tls else 'http'}://{HOST}:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=2, context=context) as ready:
                if ready.status == 200:
                    return process, base
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the appliance did not start; see {log}")
        time.sleep(0.5)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=60)


async def neural(base: str, key: str) -> dict[str, Any]:
    """The scripted writer's 10-item package read by the neural voice (a new version)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        say("packages: the 10-item package, narrated by the neural voice")
        spent, package = await ask(session, base, key, TEN)
    if "error" in package:
        raise RuntimeError(f"the neural voice's package failed: {package['error']}")
    manifest = package["manifest"]
    return _outcome(spent, package) | {
        "voice": _voice(package),
        "audio_bytes": sum(f["size"] for f in manifest["files"] if f["path"].endswith(".wav")),
    }


def _voice(package: dict[str, Any]) -> dict[str, Any] | None:
    voice: dict[str, Any] | None = package.get("manifest", {}).get("lineage", {}).get("voice")
    return voice


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Content packages: generation and downloads.")
    parser.add_argument("--seconds", type=float, default=10.0, help="per download run (10)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvl-bench-packages-") as tmp:
        work = Path(tmp)
        # Under root the front's workers (nobody) must go through it to the blobs; 711
        # lets them, without listing it (front.py opens nothing above the data directory).
        work.chmod(0o711)
        data = work / "data"
        env = {**os.environ, "KVL_DISCOVERY__ENABLED": "false", "KVL_EMBEDDINGS__THREADS": "1",
               "KVL_MODEL__N_THREADS": "2"}  # fmt: skip
        key = subprocess.run(
            kvl("appliance", "keys", "create", "--account", "bench", "--data-dir", str(data)),
            check=True, capture_output=True, text=True, env=env,
        ).stdout.strip()  # fmt: skip
        started = stamp()  # the code measured: the commit as the run starts
        # Downloads of a package the scripted writer makes (what is measured is serving a
        # cached file; the real model's packages may well be refused).
        script = package_script(work / "package-script.json")
        subprocess.run(
            kvl("appliance", "models", "add", str(script), "--name", PACKAGE_WRITER,
                "--version", "1", "--data-dir", str(data)),
            check=True, capture_output=True, env=env,
        )  # fmt: skip
        scripted = {**env, "KVL_PACKAGES__MODEL": PACKAGE_WRITER}
        process, base = serve(data, scripted, work / "appliance.log")
        try:
            blobs = data / "packages" / "blobs" / "sha256"
            figures = asyncio.run(
                measure(base, key, args.seconds, work, blobs, appliance=psutil.Process(process.pid))
            )
        finally:
            stop(process)
        file = figures.pop("file")
        figures["download_front"] = front_download(
            data, scripted, work, key, file, size=figures["download"]["file_bytes"],
            seconds=args.seconds,
        )  # fmt: skip
        process, base = serve(data, env, work / "appliance.log")
        try:
            figures |= asyncio.run(generation(base, key))
        finally:
            stop(process)
        # The neural voice reads the scripted writer's package: the two voices' cost alone.
        process, base = serve(
            data, {**scripted, "KVL_PACKAGES__VOICE": "neural"}, work / "appliance.log"
        )
        try:
            figures["ten_items_neural_voice"] = asyncio.run(neural(base, key))
        finally:
            stop(process)
    result = {
        **started,
        "settings": {"model": "gemma-3-270m Q4_K_M, 2 threads", "narration": "espeak-ng"},
        **figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(json.dumps(result, indent=2))
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows, from a result (a test keeps them equal;
    `python -m tests.benchmarks.tables` writes it there)."""
    ten, valid, download = (
        result["ten_items_with_narration"],
        result["first_pass_validity"],
        result["download"],
    )
    narration = result["settings"]["narration"]
    if ten.get("refused"):
        made = f"a 10-item package with narration, {narration}: refused"
    else:
        made = (
            f"a validated 10-item package with narration, {narration} ({ten['files']} files, "
            f"{ten['bytes'] / 1e6:.1f} MB)"
        )
    rows = [[made, _attempts(ten), "—"]]
    scripted = result.get("ten_items_scripted_writer")
    # results from before answer verification had the checks of form and on_topic only
    judged = "every check, answers verified" if scripted else "on_topic judged"
    if scripted:  # the voices' cost alone: a writer that costs nothing
        rows.append([
            (f"the voice's cost: a scripted writer's 10-item package, narrated by {narration} "
             f"({scripted['files']} files, {scripted['bytes'] / 1e6:.1f} MB)"),
            _attempts(scripted), "—",
        ])  # fmt: skip
    neural = result.get("ten_items_neural_voice")
    if neural:
        voice = neural.get("voice")
        by = f" ({voice['engine']}, `{voice['voice']}`)" if voice else ""
        rows.append([f"the same, narrated by the neural voice{by}", _attempts(neural), "—"])
    if ten.get("cache_hit_s") is not None:
        rows.append(
            ["the same request again (cache hit)", f"{ten['cache_hit_s'] * 1000:.0f} ms", "—"]
        )
    rows += [
        [
            f"first-pass validity over {valid['generations']} generations ({judged})",
            (
                f"{valid['first_pass']} of {valid['generations']} (**{valid['rate']:.2f}**); "
                f"{valid['valid_after_retries']} valid after retries, "
                f"{valid['failed_after_retries']} refused; median {valid['median_s']} s"
            ),
            "—",
        ],
    ]
    front = result.get("download_front")
    if front is None:  # results before the front sent files: one row, the target on it
        rows.append(_download_row(download))
        cpu = _download_cpu(download)
    else:
        rows.append(_download_row(download, "the app straight, plain HTTP"))
        rows.append(_download_row(front, "through the TLS front, nginx sending the file"))
        cpu = " ".join(
            filter(None, [_download_cpu(download), _download_cpu(front, "through the front")])
        )
    lines = [headline(result, result["settings"]["model"]), "", *table(
        ["", "figure", "target"], rows
    )]  # fmt: skip
    if cpu:
        lines += ["", cpu]
    return "\n".join(lines) + "\n"


def _attempts(figures: dict[str, Any]) -> str:
    if figures.get("refused"):
        failed = ", ".join(f"`{name}`" for name in figures["failed_checks"])
        return f"{figures['seconds']} s to the refusal (failed: {failed})"
    n = figures["attempts"]
    return f"{figures['seconds']} s ({n} attempt{'s' if n != 1 else ''})"


def _download_row(download: dict[str, Any], how: str | None = None) -> list[str]:
    # Results before h2load drove both servers do not name their client: a Python one.
    client = download.get("client", "client not recorded: a Python one, before h2load")
    target = download.get("target_ratio")
    return [
        (
            f"cached download{f' ({how})' if how else ''}, "
            f"{download['file_bytes'] / 1000:.0f} KB file, "
            f"{download['clients']} clients ({client}): appliance / nginx"
        ),
        (
            f"{download['appliance']['mib_per_s']:,.0f} / {download['nginx']['mib_per_s']:,.0f} "
            f"MiB/s: **{download['ratio']:.2f}{TIMES}**"
        ),
        "— (the front's row has it)" if target is None else f"≥ {target}{TIMES}",
    ]


def _download_cpu(download: dict[str, Any], how: str | None = None) -> str:
    """Each server's CPU per download, where the result has it (h2load's runs)."""
    ours = download["appliance"].get("server_cpu_us_per_request")
    theirs = download["nginx"].get("server_cpu_us_per_request")
    if ours is None or theirs is None:
        return ""
    return (
        f"CPU per download{f' {how}' if how else ''}: the appliance {ours:,.0f} µs, "
        f"nginx {theirs:,.0f} µs ({ours / theirs:.1f}{TIMES})."
    )


if __name__ == "__main__":
    raise SystemExit(main())
