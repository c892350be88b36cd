"""Memory benchmark: where the appliance's RSS goes, gateway and model worker apart.

What is measured
    * a real ``kvl appliance serve`` (fresh temporary data dir, the environment of
      tests/benchmarks/serving.py's ``appliance_env``: discovery and embeddings off,
      ``model.n_threads=2``, ``model.n_ctx=2048``, one slot), of this checkout or, with
      ``--baseline REF``, also of an earlier commit (its files from ``git archive``);
    * per process (the gateway, its model worker): VmRSS, RssAnon and RssFile from
      /proc/PID/status once ready and idle, then again after a few greedy completions,
      with VmHWM (the kernel's peak RSS) at the end;
    * the imports: in fresh interpreters, what building the app as ``kvl appliance serve``
      does (settings, ``create_app``; nothing served) and ``import appliance.serving.worker``
      cost in RSS, and which heavy top-level packages they leave in ``sys.modules``.

The model file is put in the data dir on first start (minutes); ``--models-from DIR`` copies
the GGUF files of DIR there first (default: /tmp/mem/data/models, when it exists).

Run: ``python -m tests.benchmarks.memory [--completions N] [--baseline REF] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from tests.benchmarks.serving import (
    MODEL,
    Server,
    appliance_env,
    checkout,
    create_key,
    say,
    stamp,
    start_appliance,
    stop,
    wait_ready,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "memory.json"
ROOT = Path(__file__).resolve().parents[2]
# Packages worth naming when they are loaded: each costs megabytes (llama_cpp's package
# module costs nothing until a name of one of its halves is used: see
# appliance/serving/llama_package.py).
HEAVY = (
    "aiohttp",
    "apscheduler",
    "cryptography",
    "diskcache",
    "google",
    "grpc",
    "jinja2",
    "jsonschema",
    "llama_cpp.llama_cpp",  # the C API
    "llama_cpp.llama",  # llama-cpp-python's high-level half (Llama)
    "numpy",
    "onnxruntime",
    "opentelemetry",
    "prometheus_client",
    "psutil",
    "pydantic",
    "segno",
    "sqlite3",
    "sqlite_utils",
    "wireguard_tools",
    "yaml",
    "zeroconf",
)
FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")

# Run in a fresh interpreter: RSS before and after `body`, and the heavy packages loaded.
_PROBE = """
import json, re, sys
def rss():
    s = open("/proc/self/status").read()
    return int(re.search(r"VmRSS:\\s+(\\d+)", s).group(1)) * 1024
before = rss()
{body}
after = rss()
heavy = {heavy!r}
loaded = sorted(h for h in heavy if h in sys.modules)
print(json.dumps({{"rss_mib": round(after / 2**20, 1),
                  "cost_mib": round((after - before) / 2**20, 1), "heavy": loaded}}))
"""
# As `kvl appliance serve` builds its app (appliance/cli.py), without serving it.
_APP = """
from appliance.settings import ApplianceSettings
from shared.cli import settings_from
from appliance.app import create_app
from appliance.gateway import server
app = create_app(settings_from(ApplianceSettings, None, {data_dir!r}))
"""


# The gateway's copy of the model's vocabulary: llama.cpp's C API loading the GGUF with
# `vocab_only`, as appliance/serving/engine.py's `LlamaVocabulary.load` does, in a fresh
# interpreter that already imported the C API (so only the vocabulary is counted).
_VOCABULARY = """
import json, re
import llama_cpp.llama_cpp as L
def rss():
    s = open("/proc/self/status").read()
    return int(re.search(r"VmRSS:\\s+(\\d+)", s).group(1)) * 1024
L.llama_backend_init()
before = rss()
params = L.llama_model_default_params()
params.vocab_only = True
model = L.llama_model_load_from_file({path!r}.encode(), params)
assert model, "llama.cpp could not read the vocabulary"
after = rss()
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
print(json.dumps({{"cost_mib": round((after - before) / 2**20, 1), "n_vocab": n_vocab}}))
"""


def status_mib(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM of one process, in MiB."""
    found: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            found[key] = round(int(value.split()[0]) / 1024, 1)
    return found


def worker_of(gateway: int) -> int:
    for child in psutil.Process(gateway).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "appliance.serving.worker" in " ".join(child.cmdline()):
                return child.pid
    raise RuntimeError("the gateway has no model worker")


def processes(gateway: int) -> dict[str, dict[str, float]]:
    return {"gateway": status_mib(gateway), "worker": status_mib(worker_of(gateway))}


def complete(server: Server, prompt: str, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    request = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={**server.headers, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        json.load(resp)


def probe(body: str, code: Path | None) -> dict[str, Any]:
    script = _PROBE.format(body=body, heavy=HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        capture_output=True,
        text=True,
        env=appliance_env(code),
        cwd=code,  # `python -c` imports from the current folder first
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def vocabulary(data_dir: Path) -> dict[str, Any]:
    """What the gateway's copy of the served model's vocabulary costs in RSS."""
    [gguf] = sorted((data_dir / "models").glob("*.gguf"))[:1]
    out = subprocess.run(
        [sys.executable, "-c", _VOCABULARY.format(path=str(gguf))],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["model"] = gguf.name
    return result


def measure(code: Path | None, work: Path, args: argparse.Namespace, name: str) -> dict[str, Any]:
    data_dir = work / f"data-{name}"
    models = data_dir / "models"
    models.mkdir(parents=True)
    if args.models_from is not None and args.models_from.is_dir():
        for gguf in args.models_from.glob("*.gguf"):
            shutil.copy2(gguf, models / gguf.name)
    imports = {
        "app": probe(_APP.format(data_dir=str(work / f"probe-{name}")), code),
        "worker": probe("import appliance.serving.worker", code),
    }
    key = create_key(data_dir, code)
    server = start_appliance(data_dir, key, work, code, name)
    try:
        wait_ready(server, timeout_s=args.ready_timeout)
        idle = processes(server.proc.pid)
        for i in range(args.completions):
            complete(server, f"Write a short note about the number {i}.", args.max_tokens)
        served = processes(server.proc.pid)
    finally:
        stop(server)
    return {"imports": imports, "idle": idle, "after_completions": served}


def total_peak(run: dict[str, Any]) -> float:
    after = run["after_completions"]
    return round(float(after["gateway"]["VmHWM"]) + float(after["worker"]["VmHWM"]), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Where the appliance's memory goes.")
    parser.add_argument("--completions", type=int, default=3, help="completions sent (3)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each (32)")
    parser.add_argument(
        "--models-from",
        type=Path,
        help="a folder of GGUF files to copy in (an earlier data dir's models/), instead of "
        "the appliance assembling its default model",
    )
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--baseline", help="also measure the appliance of this commit")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)

    result: dict[str, Any] = {
        **stamp(),
        "settings": {
            key: value for key, value in appliance_env().items() if key.startswith("KVL_")
        },
        "units": "MiB",
    }
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvl-mem-")))
        if args.baseline:
            sha, folder = stack.enter_context(checkout(args.baseline))
            say(f"measuring the appliance of {sha}")
            result["baseline"] = {"commit": sha, **measure(folder, work, args, "baseline")}
        say("measuring this appliance")
        result["appliance"] = measure(ROOT, work, args, "appliance")
        result["vocabulary"] = vocabulary(work / "data-appliance")
    result["peak_rss_mib"] = total_peak(result["appliance"])
    if "baseline" in result:
        result["baseline"]["peak_rss_mib"] = total_peak(result["baseline"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(json.dumps(result, indent=2))
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows (`python -m tests.benchmarks.tables` writes it)."""
    from tests.benchmarks.report import headline, table  # noqa: PLC0415 - docs only

    runs = [("baseline", result["baseline"])] if "baseline" in result else []
    runs.append(("appliance", result["appliance"]))
    labels = [
        f"before (`{run['commit']}`)" if name == "baseline" else f"after (`{result['commit']}`)"
        for name, run in runs
    ]

    def peak(run: dict[str, Any], process: str) -> str:
        figures = run["after_completions"][process]
        return f"{figures['VmHWM']:.0f} MiB ({figures['RssAnon']:.0f} anonymous)"

    def imports(run: dict[str, Any], which: str) -> str:
        return f"{run['imports'][which]['cost_mib']:.0f} MiB"

    rows = [
        ["gateway, peak RSS", *(peak(run, "gateway") for _, run in runs)],
        ["worker, peak RSS", *(peak(run, "worker") for _, run in runs)],
        ["both, peak RSS", *(f"**{total_peak(run):.0f} MiB**" for _, run in runs)],
        ["the gateway's imports", *(imports(run, "app") for _, run in runs)],
        ["the worker's imports", *(imports(run, "worker") for _, run in runs)],
    ]
    settings = result["settings"]
    lines = [
        headline(
            result,
            f"one slot, context {settings.get('KVL_MODEL__N_CTX')}, embeddings and discovery off",
        ),
        "",
        *table(["", *labels], rows),
    ]
    if "vocabulary" in result:
        vocab = result["vocabulary"]
        lines += [
            "",
            (
                f"Of the gateway's memory, its copy of the model's vocabulary (llama.cpp, "
                f"`vocab_only`; {vocab['n_vocab']:,} tokens of `{vocab['model']}`): "
                f"**{vocab['cost_mib']:.0f} MiB**."
            ),
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
