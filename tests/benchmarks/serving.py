"""Serving benchmark: the appliance against llama.cpp's own ``llama-server``, same model, same box.

What is compared
    * the appliance: a real ``kvl appliance serve`` process (fresh temporary data dir, discovery
      off, ``model.n_threads=2``, ``model.n_ctx=2048``), which runs llama.cpp through
      llama-cpp-python with its own per-token loop (appliance/serving/engine.py) behind an
      aiohttp gateway;
    * ``llama-server`` built from the llama.cpp sources vendored in the *same* llama-cpp-python
      sdist (see tests/benchmarks/llama_server.py), serving the *same* GGUF file (the one the
      appliance assembled into its data dir) with ``-t 2 -c 2048 -np 1``.  By default its
      context is aligned with the appliance's defaults (flash attention on, window-size SWA
      cache, no host-RAM prompt cache, no web UI) so that the difference measured is the
      serving layer, not a llama.cpp setting; ``--llama-server-defaults`` drops that.

How
    * The servers run one after the other, never at the same time (the box may have two
      cores): start, wait for readiness, one warm-up request, the measured requests, stop.
      ``--rounds N`` repeats that, alternating which server goes first, to even out drift.
    * Every measured request is ``POST /v1/completions`` with ``stream: true``, one of the fixed
      PROMPTS, ``temperature: 0`` (greedy) and the same ``max_tokens`` (default 128); EOS may end
      a reply early, so rates are compared, not token counts.  ``--runs`` passes over the
      prompts (default 5), each pass in the same prompt order.
    * Per request, on the client: TTFT = request sent (on a fresh loopback connection, since
      llama-server closes the connection after a stream) → first SSE chunk with text; decode
      rate = (text chunks - 1) / (last text chunk - first text chunk), i.e. the steady
      token rate a streaming client sees (both servers send one chunk per token); when the
      reply ran to ``max_tokens`` the rate from ``usage.completion_tokens`` is kept as well.
    * Per server: medians over all measured requests; peak RSS of the server process and its
      children (psutil, sampled every 20 ms, plus the kernel's VmHWM of the main process);
      CPU seconds the server spent per generated token (measured requests only; inflated
      when other processes compete for the cores, because ggml's OpenMP threads spin).
    * Ratios are appliance / llama-server: decode tok/s (target >= 0.95), TTFT and peak RSS
      (lower is better for both).

Other work on the machine skews the absolute figures and, less so, the ratios; the load
average around each phase is recorded so a noisy run can be recognised.

With ``--baseline REF`` the appliance of an earlier commit (its files from ``git archive``,
run by this interpreter) is measured too, in the same run and the same rounds, so a
change's cost on the serving path is a ratio to before (``ratios_to_baseline``).

Run: ``python -m tests.benchmarks.serving [--runs N] [--max-tokens N] [--baseline REF]
[--out PATH]``.  The
first run builds llama-server (about 13 minutes on two cores); later runs reuse the cached binary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import psutil

from appliance.serving.catalog import sha256_file
from tests.benchmarks.llama_server import build_llama_server, gpu_names, on_gpu
from tests.benchmarks.report import TIMES, headline, table, target

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

HOST = "127.0.0.1"
MODEL = "gemma-3-270m"
N_THREADS = 2
N_CTX = 2048
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "serving.json"
DECODE_TARGET = 0.95

PROMPTS: tuple[str, ...] = (
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n",
    "Q: Why is the sky blue? Explain it to a ten-year-old.\nA:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a list of ten practical tips for growing tomatoes on a balcony:\n1.",
)
WARMUP_PROMPT = "Hello, my name is"

# Aligns llama-server's context with the appliance's (flash attention on; a sliding-window
# cache of window size, llama-server's default too, since the appliance frees each
# sequence's cells when it ends) and no host-RAM prompt cache, which the appliance does not
# have either.  --no-webui only saves memory.
ALIGNED_LLAMA_SERVER_ARGS: tuple[str, ...] = (
    "--flash-attn",
    "on",
    "--cache-ram",
    "0",
    "--no-webui",
)


@dataclass
class Sample:
    """One measured request."""

    run: int
    prompt: int
    ttft_ms: float
    decode_tok_s: float | None
    usage_decode_tok_s: float | None
    server_decode_tok_s: float | None
    text_chunks: int
    completion_tokens: int | None
    finish_reason: str | None
    total_ms: float
    text: str


@dataclass
class Phase:
    """One server started, measured and stopped."""

    samples: list[Sample] = field(default_factory=list)
    peak_rss_bytes: int = 0
    vm_hwm_bytes: int | None = None
    cpu_seconds: float = 0.0
    startup_s: float = 0.0
    loadavg_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loadavg_after: tuple[float, float, float] = (0.0, 0.0, 0.0)


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# -- processes ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in _tree(proc):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_info().rss
    return total


def tree_cpu_seconds(proc: psutil.Process) -> float:
    total = 0.0
    for p in _tree(proc):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def vm_hwm(pid: int) -> int | None:
    """The kernel's peak RSS of one process (Linux), in bytes."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


class RssSampler:
    """Samples the RSS of a process tree on a thread; keeps the peak."""

    def __init__(self, proc: psutil.Process, interval_s: float = 0.02) -> None:
        self._proc = proc
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.peak = 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self._proc))
            self._stop.wait(self._interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Server:
    name: str
    base_url: str
    ready_path: str
    headers: dict[str, str]
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def wait_ready(server: Server, timeout_s: float) -> float:
    """Poll the readiness URL until 200; returns the seconds it took."""
    started = time.monotonic()
    url = server.base_url + server.ready_path
    while time.monotonic() - started < timeout_s:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}"
            )
        with contextlib.suppress(OSError), urllib_open(url) as status:
            if status == 200:
                return time.monotonic() - started
        time.sleep(0.1)
    raise TimeoutError(f"{server.name} not ready after {timeout_s} s:\n{server.log_tail()}")


@contextlib.contextmanager
def urllib_open(url: str) -> Iterator[int]:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            yield int(resp.status)
    except urllib.error.HTTPError as err:
        yield err.code


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def commit(ref: str = "HEAD") -> str:
    """The commit `ref` names (with `+changes` when it is HEAD and the tree differs)."""
    root = Path(__file__).resolve().parents[2]
    sha = subprocess.run(["git", "rev-parse", "--short=12", ref], cwd=root, check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    if ref == "HEAD":
        # The results the suites write are outputs, not changes to the code measured: a
        # suite run after another is still of the commit.
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":!tests/benchmarks/results", ":!docs/benchmarks.md", ":!README.md"]  # fmt: skip
        dirty = subprocess.run(status, cwd=root, check=True, capture_output=True, text=True).stdout
        if dirty.strip():
            sha += "+changes"
    return sha


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[tuple[str, Path]]:
    """The files of commit `ref` in a temporary folder: (its short sha, the folder)."""
    root = Path(__file__).resolve().parents[2]
    sha = commit(ref)
    with tempfile.TemporaryDirectory(prefix="kvl-bench-baseline-") as tmp:
        archive = subprocess.run(["git", "archive", sha], cwd=root, check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield sha, Path(tmp)


def kvl_executable() -> list[str]:
    script = Path(sys.executable).parent / "kvl"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from shared.cli import main; main()"]


def appliance_env(code: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    env.update(
        {
            "KVL_DISCOVERY__ENABLED": "false",
            # llama-server serves no embeddings: the ONNX model (in the gateway process)
            # stays out of the comparison; tests/benchmarks/embeddings.py measures it.
            "KVL_EMBEDDINGS__ENABLED": "false",
            "KVL_MODEL__N_THREADS": str(N_THREADS),
            "KVL_MODEL__N_CTX": str(N_CTX),
            "KVL_MODEL__N_SLOTS": "1",  # one sequence, as llama-server's -np 1
        }
    )
    if on_gpu():
        env["KVL_MODEL__N_GPU_LAYERS"] = "-1"  # every layer, as llama-server's -ngl below
    return env


def create_key(data_dir: Path, code: Path | None = None) -> str:
    command = [*kvl_executable(), "appliance", "keys", "create", "--account", "bench"]
    command += ["--data-dir", str(data_dir)]
    out = subprocess.run(
        command,
        check=True,
        capture_output=True,
        text=True,
        env=appliance_env(code),
    )
    return out.stdout.strip()


def start_appliance(
    data_dir: Path, key: str, log_dir: Path, code: Path | None = None, name: str = "appliance"
) -> Server:
    """`code`: a checkout whose appliance runs instead of this one's (its folder first on
    PYTHONPATH, for the gateway and its model workers alike)."""
    port = free_port()
    log_path = log_dir / f"{name}.log"
    command = [*kvl_executable(), "appliance", "serve", "--data-dir", str(data_dir)]
    command += ["--host", HOST, "--port", str(port)]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=appliance_env(code),
            # The model worker runs as `python -m`, whose first import path is the current
            # folder: in this checkout's, the baseline's workers would run today's code.
            cwd=code,
        )
    return Server(
        name=name,
        base_url=f"http://{HOST}:{port}",
        ready_path="/readyz",
        headers={"Authorization": f"Bearer {key}"},
        proc=proc,
        log_path=log_path,
    )


def gpu_args() -> list[str]:
    """llama-server's arguments for every layer on the GPU, under `just bench-gpu`."""
    return ["-ngl", "999"] if on_gpu() else []


def start_llama_server(
    binary: Path, model: Path, log_dir: Path, extra_args: Sequence[str]
) -> Server:
    port = free_port()
    log_path = log_dir / "llama-server.log"
    args = [str(binary), "-m", str(model), "--host", HOST, "--port", str(port)]
    args += ["-t", str(N_THREADS), "-c", str(N_CTX), "-np", "1", *gpu_args(), *extra_args]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return Server(
        name="llama-server",
        base_url=f"http://{HOST}:{port}",
        ready_path="/health",
        headers={},
        proc=proc,
        log_path=log_path,
    )


# -- requests -----------------------------------------------------------------------------------


@dataclass
class Streamed:
    """What one streamed completion looked like from the client.  Times are seconds after
    sending the request."""

    chunk_times: list[float]
    text: str
    completion_tokens: int | None
    finish_reason: str | None
    total_s: float
    server_decode_tok_s: float | None  # llama-server's own timings.predicted_per_second


async def stream_completion(
    session: aiohttp.ClientSession, server: Server, prompt: str, max_tokens: int
) -> Streamed:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times: list[float] = []
    parts: list[str] = []
    completion_tokens: int | None = None
    finish: str | None = None
    server_rate: float | None = None
    started = time.perf_counter()
    async with session.post(
        server.base_url + "/v1/completions", json=body, headers=server.headers
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            now = time.perf_counter() - started
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk: dict[str, Any] = json.loads(payload)
            usage = chunk.get("usage")
            if isinstance(usage, dict) and "completion_tokens" in usage:
                completion_tokens = int(usage["completion_tokens"])
            timings = chunk.get("timings")
            if isinstance(timings, dict) and "predicted_per_second" in timings:
                server_rate = float(timings["predicted_per_second"])
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or ""
                if text:
                    times.append(now)
                    parts.append(text)
                if choice.get("finish_reason"):
                    finish = str(choice["finish_reason"])
    total = time.perf_counter() - started
    if not times:
        raise RuntimeError(f"{server.name} streamed no text for {prompt!r}")
    return Streamed(times, "".join(parts), completion_tokens, finish, total, server_rate)


def make_sample(run: int, prompt: int, result: Streamed, max_tokens: int) -> Sample:
    times = result.chunk_times
    span = times[-1] - times[0]
    decode = (len(times) - 1) / span if len(times) > 1 and span > 0 else None
    usage_decode = None
    if result.completion_tokens == max_tokens and span > 0:
        usage_decode = (max_tokens - 1) / span
    return Sample(
        run=run,
        prompt=prompt,
        ttft_ms=times[0] * 1000,
        decode_tok_s=decode,
        usage_decode_tok_s=usage_decode,
        server_decode_tok_s=result.server_decode_tok_s,
        text_chunks=len(times),
        completion_tokens=result.completion_tokens,
        finish_reason=result.finish_reason,
        total_ms=result.total_s * 1000,
        text=result.text,
    )


async def measure(server: Server, runs: int, max_tokens: int, phase: Phase) -> None:
    """One warm-up request, then ``runs`` passes over PROMPTS; CPU time counts from the
    end of the warm-up."""
    proc = psutil.Process(server.proc.pid)
    timeout = aiohttp.ClientTimeout(total=600)
    # A fresh connection per request: llama-server closes a connection after a stream, and
    # both servers should pay the same (loopback) connect inside TTFT.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await stream_completion(session, server, WARMUP_PROMPT, 16)
        cpu_before = tree_cpu_seconds(proc)
        for run in range(runs):
            for i, prompt in enumerate(PROMPTS):
                result = await stream_completion(session, server, prompt, max_tokens)
                phase.samples.append(make_sample(run, i, result, max_tokens))
        phase.cpu_seconds = tree_cpu_seconds(proc) - cpu_before


def run_phase(server: Server, runs: int, max_tokens: int) -> Phase:
    phase = Phase(loadavg_before=os.getloadavg())
    proc = psutil.Process(server.proc.pid)
    try:
        with RssSampler(proc) as sampler:
            phase.startup_s = wait_ready(server, timeout_s=600)
            asyncio.run(measure(server, runs, max_tokens, phase))
            phase.vm_hwm_bytes = vm_hwm(proc.pid)
        phase.peak_rss_bytes = sampler.peak
    finally:
        stop(server)
    phase.loadavg_after = os.getloadavg()
    return phase


# -- report -------------------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def summarize(phases: list[Phase]) -> dict[str, Any]:
    samples = [s for p in phases for s in p.samples]
    tokens = sum(s.completion_tokens or s.text_chunks for s in samples)
    cpu = sum(p.cpu_seconds for p in phases)
    hwm = [p.vm_hwm_bytes for p in phases if p.vm_hwm_bytes is not None]
    per_prompt = {}
    for i, prompt in enumerate(PROMPTS):
        mine = [s for s in samples if s.prompt == i]
        per_prompt[str(i)] = {
            "prompt": prompt,
            "decode_tok_s": _round(_median([s.decode_tok_s for s in mine])),
            "ttft_ms": _round(_median([s.ttft_ms for s in mine])),
            "completion_tokens": _median([s.completion_tokens for s in mine]),
            "finish_reason": mine[0].finish_reason if mine else None,
            "first_output": mine[0].text if mine else None,
        }
    return {
        "requests": len(samples),
        "decode_tok_s_median": _round(_median([s.decode_tok_s for s in samples])),
        "usage_decode_tok_s_median": _round(_median([s.usage_decode_tok_s for s in samples])),
        "server_reported_decode_tok_s_median": _round(
            _median([s.server_decode_tok_s for s in samples])
        ),
        "ttft_ms_median": _round(_median([s.ttft_ms for s in samples])),
        "total_ms_median": _round(_median([s.total_ms for s in samples])),
        "completion_tokens_median": _median([s.completion_tokens for s in samples]),
        "peak_rss_mib": round(max(p.peak_rss_bytes for p in phases) / 2**20, 1),
        "vm_hwm_mib": round(max(hwm) / 2**20, 1) if hwm else None,
        "cpu_ms_per_token": round(1000 * cpu / tokens, 2) if tokens else None,
        "phases": [
            {
                "decode_tok_s_median": _round(_median([s.decode_tok_s for s in p.samples])),
                "ttft_ms_median": _round(_median([s.ttft_ms for s in p.samples])),
                "startup_s": round(p.startup_s, 2),
                "cpu_s": round(p.cpu_seconds, 2),
                "loadavg_before": [round(x, 2) for x in p.loadavg_before],
                "loadavg_after": [round(x, 2) for x in p.loadavg_after],
            }
            for p in phases
        ],
        "per_prompt": per_prompt,
        "samples": [
            {
                k: (round(v, 3) if isinstance(v, float) else v)
                for k, v in asdict(s).items()
                if k != "text"
            }
            for s in samples
        ],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def stamp(**machine: Any) -> dict[str, Any]:
    """What a result opens with: when it was measured, of which commit, on what machine
    (`machine` adds a suite's own facts: its GPUs, its accelerator). The load average says
    whether the machine was quiet; AVX-512 or not changes llama.cpp's kernels."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "avx512": avx512(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            **machine,
        },
    }


def avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def llama_server_version(binary: Path) -> str:
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, check=False, timeout=30
    )
    return " ".join((out.stdout + out.stderr).split())[:300]


def same_outputs(a: list[Sample], b: list[Sample]) -> dict[str, bool]:
    first_a = {s.prompt: s.text for s in a if s.run == 0}
    first_b = {s.prompt: s.text for s in b if s.run == 0}
    return {str(i): first_a.get(i) == first_b.get(i) for i in range(len(PROMPTS))}


def human_summary(result: dict[str, Any]) -> str:
    app, ref, ratios = result["appliance"], result["llama_server"], result["ratios"]
    verdict = (
        "meets" if ratios["decode_tok_s"] and ratios["decode_tok_s"] >= DECODE_TARGET else "MISSES"
    )
    rows = [
        ("decode tok/s (median)", "decode_tok_s_median", "decode_tok_s"),
        ("TTFT ms (median)", "ttft_ms_median", "ttft_ms"),
        ("peak RSS MiB", "peak_rss_mib", "peak_rss"),
        ("CPU ms / token", "cpu_ms_per_token", "cpu_ms_per_token"),
    ]
    settings, machine = result["settings"], result["machine"]
    lines = [
        (
            f"serving benchmark: {settings['requests_per_server']} requests per server, "
            f"max_tokens {settings['max_tokens']}, {machine['cpu']} "
            f"({machine['logical_cpus']} CPUs)"
        ),
        f"{'':24}{'appliance':>12}{'llama-server':>14}{'ratio':>8}",
    ]
    for label, key, ratio_key in rows:
        lines.append(f"{label:24}{app[key]!s:>12}{ref[key]!s:>14}{ratios[ratio_key]!s:>8}")
    for label, figures in (("appliance", app), ("llama-server", ref)):
        phases = ", ".join(
            f"{p['decode_tok_s_median']} (load {p['loadavg_before'][0]}->{p['loadavg_after'][0]})"
            for p in figures["phases"]
        )
        lines.append(f"  {label} decode tok/s per phase: {phases}")
    if "ratios_to_baseline" in result:
        lines.append(
            f"against the appliance of {result['baseline']['commit']}: "
            + ", ".join(f"{k} {v}" for k, v in result["ratios_to_baseline"].items())
        )
    lines.append(
        f"decode ratio {ratios['decode_tok_s']} {verdict} the {DECODE_TARGET} target; "
        f"identical greedy outputs: {sum(result['identical_outputs'].values())}/{len(PROMPTS)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the appliance against llama-server.")
    parser.add_argument("--runs", type=int, default=5, help="passes over the prompts (5)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request")
    parser.add_argument("--rounds", type=int, default=1, help="start/measure/stop cycles (1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    parser.add_argument(
        "--llama-server-defaults",
        action="store_true",
        help="run llama-server with its own defaults (flash attention auto, SWA cache "
        "trimmed, RAM prompt cache) instead of aligning it with the appliance's context",
    )
    parser.add_argument(
        "--baseline",
        help="also measure the appliance of this commit (before a change), in the same run",
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 2 or args.rounds < 1:
        parser.error("--runs and --rounds must be >= 1, --max-tokens >= 2")

    build = build_llama_server()
    extra = () if args.llama_server_defaults else ALIGNED_LLAMA_SERVER_ARGS
    app_phases: list[Phase] = []
    ref_phases: list[Phase] = []
    base_phases: list[Phase] = []
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvl-bench-")))
        baseline = stack.enter_context(checkout(args.baseline)) if args.baseline else None
        data_dir = work / "data"
        key = create_key(data_dir)
        base_dir = work / "data-baseline"
        base_key = create_key(base_dir, baseline[1]) if baseline else ""
        model: Path | None = None
        names = ("appliance", "baseline", "llama-server") if baseline else (
            "appliance", "llama-server")  # fmt: skip
        for round_ in range(args.rounds):
            # Round 0 starts with the appliance: its first start assembles the model file
            # llama-server then serves.  Later rounds alternate the order to even out drift.
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                if name == "appliance":
                    app_phases.append(_appliance_phase(data_dir, key, work, args))
                    model = model or _model_file(data_dir)
                elif name == "baseline":
                    assert baseline is not None
                    say(f"measuring the appliance of {baseline[0]} ({args.runs} x "
                        f"{len(PROMPTS)} requests)")  # fmt: skip
                    server = start_appliance(base_dir, base_key, work, baseline[1], "baseline")
                    base_phases.append(run_phase(server, args.runs, args.max_tokens))
                else:
                    assert model is not None
                    say(f"measuring llama-server ({args.runs} x {len(PROMPTS)} requests)")
                    server = start_llama_server(build.binary, model, work, extra)
                    ref_phases.append(run_phase(server, args.runs, args.max_tokens))
        assert model is not None
        model_sha = sha256_file(model)
        model_name = model.name
        model_bytes = model.stat().st_size

    app = summarize(app_phases)
    ref = summarize(ref_phases)
    result: dict[str, Any] = {
        **stamp(gpus=gpu_names()),
        "model": {"file": model_name, "sha256": model_sha, "bytes": model_bytes},
        "settings": {
            "runs": args.runs,
            "rounds": args.rounds,
            "prompts": list(PROMPTS),
            "requests_per_server": args.runs * args.rounds * len(PROMPTS),
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "endpoint": "/v1/completions (stream)",
            "n_threads": N_THREADS,
            "n_ctx": N_CTX,
            "appliance_env": {
                "KVL_DISCOVERY__ENABLED": "false",
                "KVL_EMBEDDINGS__ENABLED": "false",
                "KVL_MODEL__N_THREADS": str(N_THREADS),
                "KVL_MODEL__N_CTX": str(N_CTX),
                "KVL_MODEL__N_SLOTS": "1",  # one sequence, as llama-server's -np 1
            },
            "llama_server_args": ["-t", str(N_THREADS), "-c", str(N_CTX), "-np", "1", *extra],
        },
        "llama_server_build": {
            "version": llama_server_version(build.binary),
            **build.info,
        },
        "appliance": app,
        "llama_server": ref,
        "ratios": {
            "decode_tok_s": _ratio(app["decode_tok_s_median"], ref["decode_tok_s_median"]),
            "decode_tok_s_target": DECODE_TARGET,
            "usage_decode_tok_s": _ratio(
                app["usage_decode_tok_s_median"], ref["usage_decode_tok_s_median"]
            ),
            "ttft_ms": _ratio(app["ttft_ms_median"], ref["ttft_ms_median"]),
            "peak_rss": _ratio(app["peak_rss_mib"], ref["peak_rss_mib"]),
            "cpu_ms_per_token": _ratio(app["cpu_ms_per_token"], ref["cpu_ms_per_token"]),
        },
        "identical_outputs": same_outputs(
            [s for p in app_phases for s in p.samples], [s for p in ref_phases for s in p.samples]
        ),
    }
    if baseline is not None:
        before = summarize(base_phases)
        result["baseline"] = {"commit": baseline[0], "appliance": before}
        result["ratios_to_baseline"] = {
            key: _ratio(app[key], before[key])
            for key in ("decode_tok_s_median", "ttft_ms_median", "total_ms_median",
                        "cpu_ms_per_token", "peak_rss_mib")
        }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(human_summary(result))
    say(f"written to {args.out}")
    return 0


def _appliance_phase(data_dir: Path, key: str, work: Path, args: argparse.Namespace) -> Phase:
    say(f"measuring the appliance ({args.runs} x {len(PROMPTS)} requests)")
    server = start_appliance(data_dir, key, work)
    runs: int = args.runs
    max_tokens: int = args.max_tokens
    return run_phase(server, runs, max_tokens)


def _model_file(data_dir: Path) -> Path:
    found = sorted((data_dir / "models").glob("*.gguf"))
    if len(found) != 1:
        raise RuntimeError(f"expected one model in {data_dir / 'models'}, found {found}")
    return found[0]


def markdown(result: dict[str, Any]) -> str:
    """The single-stream table docs/benchmarks.md shows, from a result (a test keeps them
    equal; `python -m tests.benchmarks.tables` writes it there)."""
    app, ref, ratios = result["appliance"], result["llama_server"], result["ratios"]
    settings = result["settings"]
    lines = [
        headline(
            result,
            f"{settings['n_threads']} threads, context {settings['n_ctx']}",
            (
                f"{len(settings['prompts'])} prompts {TIMES} {settings['runs']} runs {TIMES} "
                f"{settings['rounds']} rounds of {settings['max_tokens']} tokens, medians"
            ),
        ),
        "",
        *table(
            ["", "appliance", "llama-server", "ratio"],
            [
                [
                    "decode tokens/s, single stream",
                    f"{app['decode_tok_s_median']:.1f}",
                    f"{ref['decode_tok_s_median']:.1f}",
                    target(ratios["decode_tok_s"], ratios.get("decode_tok_s_target")),
                ],
                [
                    "time to first token",
                    f"{app['ttft_ms_median']:.1f} ms",
                    f"{ref['ttft_ms_median']:.1f} ms",
                    target(ratios["ttft_ms"], None),
                ],
                [
                    "peak RSS (gateway + worker)",
                    f"{app['peak_rss_mib']:.0f} MiB",
                    f"{ref['peak_rss_mib']:.0f} MiB",
                    target(ratios["peak_rss"], None),
                ],
                [
                    "CPU per token",
                    f"{app['cpu_ms_per_token']:.1f} ms",
                    f"{ref['cpu_ms_per_token']:.1f} ms",
                    target(ratios["cpu_ms_per_token"], None),
                ],
            ],
        ),
    ]
    if "baseline" in result:
        lines += ["", *_baseline_table(result)]
    return "\n".join(lines) + "\n"


def _baseline_table(result: dict[str, Any]) -> list[str]:
    """`--baseline REF`: today's appliance against the one of REF, in the same run."""
    now, before = result["appliance"], result["baseline"]["appliance"]
    rows = [
        ("decode tokens/s", "decode_tok_s_median", "", 1),
        ("time to first token", "ttft_ms_median", " ms", 1),
        ("CPU per token", "cpu_ms_per_token", " ms", 1),
        ("peak RSS (gateway + worker)", "peak_rss_mib", " MiB", 0),
    ]
    return table(
        ["", f"appliance of `{result['baseline']['commit']}`", "today's", "today / before"],
        [
            [
                label,
                f"{before[key]:.{digits}f}{unit}",
                f"{now[key]:.{digits}f}{unit}",
                target(result["ratios_to_baseline"].get(key), None),
            ]
            for label, key, unit, digits in rows
        ],
    )


if __name__ == "__main__":
    raise SystemExit(main())
