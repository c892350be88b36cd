"""Chat quality: do the embedded models follow short instructions?

The twelve fixed instructions a node evaluates a placed model with
(appliance/serving/evaluation.py: a reply on topic and in the form asked for). Both embedded
models answer each one through a real appliance (`kvl appliance serve` on a fresh data dir:
`/v1/chat/completions`, one user message, greedy, at most :data:`MAX_TOKENS` tokens, one
request at a time): SmolLM2 135M Instruct with the chat template its GGUF carries, Gemma 3
270M (a base model) with Gemma's turn format. Beside the counts, each model's load time
through the admin API (the sha256 check, the worker's start and llama.cpp's load; the
median of ``--loads``) and its worker's resident memory after the instructions.

Greedy output depends on the CPU's kernels (with AVX-512 or without), so a count may move
by one or two across machines; tests/appliance/test_chat_quality.py allows for that.

Run: ``python -m tests.benchmarks.chat_quality [--loads 3] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from appliance.serving.catalog import CHAT_MODEL_NAME, DEFAULT_MODEL_NAME
from appliance.serving.evaluation import INSTRUCTIONS, MAX_TOKENS, judge, tally
from tests.benchmarks.report import headline, table
from tests.benchmarks.serving import HOST, free_port, say, stamp

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "chat-quality.json"
MODELS = (CHAT_MODEL_NAME, DEFAULT_MODEL_NAME)
N_THREADS = 2
N_CTX = 2048


# -- a real appliance --------------------------------------------------------------------


def _call(
    base: str, key: str, method: str, path: str, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def reply(base: str, key: str, model: str, prompt: str) -> str:
    """The model's greedy reply to one user message."""
    answer = _call(base, key, "POST", "/v1/chat/completions", {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    })  # fmt: skip
    return str(answer["choices"][0]["message"]["content"])


def run_instructions(base: str, key: str, model: str) -> list[dict[str, Any]]:
    return [judge(i, reply(base, key, model, i.prompt)) for i in INSTRUCTIONS]


def _load_s(base: str, key: str, model: str) -> float:
    started = time.perf_counter()
    _call(base, key, "POST", "/v1/admin/models", {"model": model})
    return time.perf_counter() - started


def _reload_s(base: str, key: str, model: str) -> float:
    """Unload the model (unpinned first) and time its load through the admin API."""
    _call(base, key, "POST", "/v1/admin/models", {"model": model, "pinned": False})
    _call(base, key, "DELETE", f"/v1/admin/models/{model}")
    return _load_s(base, key, model)


def _wait_ready(base: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the appliance exited with {process.returncode}; log: {log}")
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the appliance did not become ready; log: {log}")


def measure(work: Path, loads: int) -> dict[str, Any]:
    data = work / "data"
    kvl = [sys.executable, "-m", "shared.cli", "appliance"]
    key = subprocess.run(
        [*kvl, "keys", "create", "--account", "bench", "--admin", "--data-dir", str(data)],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    env = {
        **os.environ,
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_MODEL__N_THREADS": str(N_THREADS),
        "KVL_MODEL__N_CTX": str(N_CTX),
        "KVL_MODEL__N_SLOTS": "1",
    }
    port = free_port()
    base = f"http://{HOST}:{port}"
    log = work / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*kvl, "serve", "--data-dir", str(data), "--host", HOST, "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        _wait_ready(base, process, log)
        say(f"chat_quality: {CHAT_MODEL_NAME} on first use (copied out of its package)")
        first_use_s = _load_s(base, key, CHAT_MODEL_NAME)
        report: dict[str, Any] = {}
        for model in MODELS:
            times = [_reload_s(base, key, model) for _ in range(loads)]
            say(f"chat_quality: {model}: {len(INSTRUCTIONS)} instructions")
            results = run_instructions(base, key, model)
            listing = _call(base, key, "GET", "/v1/admin/models")["data"]
            entry = next(m for m in listing if m["name"] == model and m["state"] == "ready")
            report[model] = {
                "ref": entry["ref"],
                **tally(results),
                "load_s_median": round(statistics.median(times), 2),
                "load_s": [round(t, 2) for t in times],
                "file_mib": round(entry["size_bytes"] / 2**20, 1),
                "worker_resident_mib": entry["memory_resident_mib"],
                "results": results,
            }
        report[CHAT_MODEL_NAME]["first_use_s"] = round(first_use_s, 2)
        return report
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Instruction following of the embedded models.")
    parser.add_argument("--loads", type=int, default=3, help="timed loads of each model")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    # Load times move with other work on the machine: its load average says how much.
    loadavg_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvl-bench-chat-quality-") as tmp:
        models = measure(Path(tmp), args.loads)
    loadavg_after = os.getloadavg()
    result = {
        **stamp(),
        "loadavg_before": [round(x, 2) for x in loadavg_before],
        "loadavg_after": [round(x, 2) for x in loadavg_after],
        "settings": {
            "request": f"/v1/chat/completions, one user message, greedy, max {MAX_TOKENS} tokens",
            "threads": N_THREADS,
            "context": N_CTX,
            "instructions": {
                i.id: {"prompt": i.prompt, "passes_when": i.passes_when} for i in INSTRUCTIONS
            },
        },
        "models": models,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for model, figures in models.items():
        failed = [r["id"] for r in figures["results"] if not r["followed"]]
        say(
            f"  {model}: {figures['followed']}/{figures['total']} followed, "
            f"{figures['on_topic']} on topic; load "
            f"{figures['load_s_median']} s, worker {figures['worker_resident_mib']} MiB; "
            f"missed: {', '.join(failed) or 'none'}"
        )
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The figures of README.md's table of the embedded models, from a result (a test keeps
    them equal; `python -m tests.benchmarks.tables` writes them there)."""
    machine, settings = result.get("machine", {}), result["settings"]
    more = [f"{settings['threads']} threads, greedy"]
    if machine.get("avx512"):
        more.insert(0, "AVX-512")
    before, after = result.get("loadavg_before"), result.get("loadavg_after")
    if before and after:
        # Load times stretch with other work on the machine.
        more.append(f"load average {before[0]:.1f} before, {after[0]:.1f} after")
    rows = [
        [
            f"`{name}`",
            f"{m['followed']}/{m['total']}",
            f"{m['on_topic']}/{m['total']}",
            f"{m['load_s_median']:.2f} s",
            f"{m['worker_resident_mib']:.0f} MiB",
        ]
        for name, m in result["models"].items()
    ]
    header = ["model", "instructions followed", "on topic", "load", "worker memory"]
    return "\n".join([headline(result, *more), "", *table(header, rows)]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
