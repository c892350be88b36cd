"""What the richer API costs: tool calls, several choices and logprobs against llama-server
doing the same, and the transports (HTTP/2, gRPC) against HTTP/1.1, in one run.

What is compared
    * tool calls: chat completions with one function tool (`get_weather`, a city and a unit)
      and `tool_choice: required`, non-streamed, greedy, one at a time; llama-server runs
      with `--jinja` (its tool-call support) and gets the same request. Figures: latency
      p50, completion tokens per second, and the share of answers whose call parses and
      fits the function's schema (the appliance constrains it by grammar: every one);
    * several choices: `n: 4` on the appliance (one request, the prompt computed once and
      shared); llama-server answers one choice per request, so it gets what its clients
      must send instead, four concurrent requests with the same prompt (`-np 4`, prompt
      cache on, its default); the wall time and aggregate tokens per second of each
      group;
    * logprobs: `logprobs: true, top_logprobs: 5` on chat, both servers; the decode rate
      against the same requests without logprobs;
    * transports (when the appliance offers them): the same chat stream over HTTP/1.1,
      HTTP/2 (TLS, ALPN h2) and gRPC, one stream and eight at once; tokens per second and
      the appliance's CPU seconds per request.

Both servers serve the same GGUF file (the embedded default, Gemma 3 270M) with two threads;
they never run at the same time. Ratios are appliance / llama-server.

Run: ``python -m tests.benchmarks.api [--requests N] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import ssl
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import httpx
import jsonschema
import psutil

from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2 as pb
from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2_grpc as pb_grpc
from shared import pki
from tests.benchmarks import serving as base
from tests.benchmarks.llama_server import build_llama_server
from tests.benchmarks.report import headline

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "api.json"
STREAMS = (1, 8)  # the transports: one stream, and eight at once
TRANSPORT_TOKENS = 64

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
QUESTIONS: tuple[str, ...] = (
    "What is the weather in Paris?",
    "Is it cold in Oslo right now, in fahrenheit?",
    "Tell me the weather for Nairobi.",
    "How warm is it in Lima today?",
    "Weather in Tokyo please, celsius.",
)
CHOICE_PROMPT = "Write one sentence about the sea."


@dataclass
class Context:
    work: Path
    data_dir: Path
    headers: dict[str, str]
    binary: Path
    model: Path | None = None


def start(name: str, ctx: Context, *, slots: int = 1) -> base.Server:
    port = base.free_port()
    log_path = ctx.work / f"{name}-{slots}.log"
    if name == "appliance":
        command = [*base.kvl_executable(), "appliance", "serve", "--data-dir", str(ctx.data_dir)]
        command += ["--host", base.HOST, "--port", str(port)]
        env = base.appliance_env()
        env["KVL_MODEL__N_SLOTS"] = str(slots)
        with log_path.open("ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        return base.Server(
            name, f"http://{base.HOST}:{port}", "/readyz", ctx.headers, proc, log_path
        )
    if ctx.model is None:
        raise RuntimeError("the appliance runs first: it assembles the model file")
    args = [str(ctx.binary), "-m", str(ctx.model), "--host", base.HOST, "--port", str(port)]
    args += ["-t", str(base.N_THREADS), "-c", str(base.N_CTX * slots), "-np", str(slots)]
    args += ["--jinja", "--flash-attn", "on", "--no-webui"]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return base.Server(name, f"http://{base.HOST}:{port}", "/health", {}, proc, log_path)


async def chat(
    session: aiohttp.ClientSession, server: base.Server, body: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    async with session.post(
        server.base_url + "/v1/chat/completions",
        json={"model": base.MODEL, **body},
        headers=server.headers,
    ) as resp:
        out: dict[str, Any] = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {resp.status}: {out}")
    return time.perf_counter() - started, out


def _valid_call(out: dict[str, Any]) -> bool:
    calls = out["choices"][0]["message"].get("tool_calls") or []
    if len(calls) != 1 or calls[0]["function"]["name"] != "get_weather":
        return False
    try:
        arguments = json.loads(calls[0]["function"]["arguments"])
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def tool_calls(server: base.Server, requests: int) -> dict[str, Any]:
    latencies, tokens, valid = [], 0, 0
    async with aiohttp.ClientSession() as session:
        await chat(
            session, server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        )
        for i in range(requests):
            body = {
                "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                "tools": [WEATHER],
                "tool_choice": "required",
                "temperature": 0,
                "max_tokens": 64,
            }
            took, out = await chat(session, server, body)
            latencies.append(took)
            tokens += int(out["usage"]["completion_tokens"])
            valid += _valid_call(out)
    return {
        "requests": requests,
        "latency_ms_p50": round(statistics.median(latencies) * 1000, 1),
        "completion_tok_s": round(tokens / sum(latencies), 2),
        "valid_calls": valid / requests,
    }


async def choices(server: base.Server, groups: int, *, native: bool) -> dict[str, Any]:
    """`groups` requests for 4 choices each: one request with n=4, or four requests."""
    walls, tokens = [], 0
    body = {
        "messages": [{"role": "user", "content": CHOICE_PROMPT}],
        "temperature": 0.8,
        "max_tokens": 48,
    }
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await chat(
            session, server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        )
        for group in range(groups):
            started = time.perf_counter()
            if native:
                _, out = await chat(session, server, {**body, "n": 4, "seed": group})
                tokens += int(out["usage"]["completion_tokens"])
            else:
                outs = await asyncio.gather(
                    *(chat(session, server, {**body, "seed": group * 4 + i}) for i in range(4))
                )
                tokens += sum(int(out["usage"]["completion_tokens"]) for _, out in outs)
            walls.append(time.perf_counter() - started)
    return {
        "groups": groups,
        "wall_ms_p50": round(statistics.median(walls) * 1000, 1),
        "aggregate_tok_s": round(tokens / sum(walls), 2),
    }


async def logprobs(server: base.Server, requests: int) -> dict[str, Any]:
    rates: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        await chat(
            session, server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        )
        for label, extra in (
            ("plain", {}),
            ("top_logprobs_5", {"logprobs": True, "top_logprobs": 5}),
        ):
            took_all, tokens = 0.0, 0
            for i in range(requests):
                body = {
                    "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    "temperature": 0,
                    "max_tokens": 48,
                    **extra,
                }
                took, out = await chat(session, server, body)
                took_all += took
                tokens += int(out["usage"]["completion_tokens"])
                if extra:
                    entries = out["choices"][0]["logprobs"]["content"]
                    assert len(entries[0]["top_logprobs"]) == 5, entries[0]
            rates[label] = round(tokens / took_all, 2)
    rates["ratio"] = round(rates["top_logprobs_5"] / rates["plain"], 3)
    return rates


# -- transports ------------------------------------------------------------------------------


@dataclass
class Tls:
    ca: Path
    cert: Path
    key: Path


def make_tls(folder: Path) -> Tls:
    ca = pki.new_ca("bench CA")
    leaf = pki.issue_with_key(
        ca,
        common_name="appliance.bench",
        names=[base.HOST],
        uri="spiffe://bench/appliance",
        lifetime=datetime.timedelta(days=1),
    )
    pki.write_issued(folder, "server", leaf)
    (folder / "ca.crt").write_bytes(ca.cert_pem)
    return Tls(folder / "ca.crt", folder / "server.crt", folder / "server.key")


def start_tls(ctx: Context, tls: Tls, *, http2: bool, grpc_port: int) -> base.Server:
    port = base.free_port()
    log_path = ctx.work / f"appliance-tls-{http2}.log"
    command = [*base.kvl_executable(), "appliance", "serve", "--data-dir", str(ctx.data_dir)]
    command += ["--host", base.HOST, "--port", str(port)]
    env = base.appliance_env()
    env |= {
        "KVL_MODEL__N_SLOTS": str(STREAMS[-1]),
        "KVL_SERVER__TLS_CERT_FILE": str(tls.cert),
        "KVL_SERVER__TLS_KEY_FILE": str(tls.key),
        "KVL_SERVER__HTTP2": "true" if http2 else "false",
        "KVL_GRPC__ENABLED": "true",
        "KVL_GRPC__PORT": str(grpc_port),
    }
    with log_path.open("ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return base.Server(
        "appliance", f"https://{base.HOST}:{port}", "/healthz", ctx.headers, proc, log_path
    )


async def _http_stream(client: httpx.AsyncClient, url: str, prompt: str) -> int:
    body = {
        "model": base.MODEL,
        "prompt": prompt,
        "max_tokens": TRANSPORT_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
    return chunks


async def _grpc_stream(stub: Any, key: str, prompt: str) -> int:
    request = pb.GenerateRequest(
        model=base.MODEL, prompt=prompt, max_tokens=TRANSPORT_TOKENS, temperature=0
    )
    replies = 0
    async for reply in stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),)):
        replies += bool(reply.text)
    return replies


def _front_cpu(process: psutil.Process) -> float:
    """CPU seconds of the serving front: the gateway process and nginx, not the model
    workers, whose decoding is the same whatever carries its tokens."""

    def cpu(p: psutil.Process) -> float:
        times = p.cpu_times()
        return float(times.user + times.system)

    total = cpu(process)
    for child in process.children(recursive=True):
        try:
            if child.name().startswith("nginx"):
                total += cpu(child)
        except psutil.NoSuchProcess:
            continue
    return total


async def _closed_loop(streams: int, requests: int, one: Any) -> tuple[float, int]:
    queue = list(range(requests))
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            # Awaited first: `tokens += await …` would read `tokens` before the await.
            got = await one(base.PROMPTS[i % len(base.PROMPTS)])
            tokens += got

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    return time.perf_counter() - started, tokens


async def _transport(
    name: str, server: base.Server, tls: Tls, grpc_port: int, *, key: str, requests: int
) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=str(tls.ca))
    process = psutil.Process(server.proc.pid)
    out: dict[str, Any] = {}
    if name == "grpc":
        credentials = grpc.ssl_channel_credentials(tls.ca.read_bytes())
        channel = grpc.aio.secure_channel(f"{base.HOST}:{grpc_port}", credentials)
        stub = pb_grpc.InferenceStub(channel)

        def one(prompt: str) -> Any:
            return _grpc_stream(stub, key, prompt)

        closing: Any = channel
    else:
        client = httpx.AsyncClient(
            http2=name == "http2",
            http1=name != "http2",
            verify=context,
            headers={"Authorization": f"Bearer {key}"},
            timeout=600,
            limits=httpx.Limits(max_connections=STREAMS[-1]),
        )

        def one(prompt: str) -> Any:
            return _http_stream(client, server.base_url, prompt)

        closing = client
    try:
        await one(base.WARMUP_PROMPT)
        for streams in STREAMS:
            cpu = _front_cpu(process)
            wall, tokens = await _closed_loop(streams, requests * streams, one)
            used = _front_cpu(process) - cpu
            out[f"streams_{streams}"] = {
                "requests": requests * streams,
                "aggregate_tok_s": round(tokens / wall, 2),
                # The gateway and nginx (not the model workers), per request.
                "front_cpu_ms_per_request": round(used * 1000 / (requests * streams), 1),
            }
    finally:
        if name == "grpc":
            await closing.close()
        else:
            await closing.aclose()
    return out


def transports(ctx: Context, requests: int) -> dict[str, Any]:
    """HTTP/1.1 (served by the app), HTTP/2 (nginx in front) and gRPC, TLS for all."""
    tls = make_tls(ctx.work)
    key = ctx.headers["Authorization"].removeprefix("Bearer ")
    figures: dict[str, Any] = {}
    for http2, names in ((False, ("http1", "grpc")), (True, ("http2",))):
        grpc_port = base.free_port()
        server = start_tls(ctx, tls, http2=http2, grpc_port=grpc_port)
        try:
            _wait(server, tls)
            for name in names:
                base.say(f"transports: {name}")
                figures[name] = asyncio.run(
                    _transport(name, server, tls, grpc_port, key=key, requests=requests)
                )
        finally:
            base.stop(server)
    for name in ("http2", "grpc"):
        figures[name]["ratios"] = {
            label: {
                "aggregate_tok_s": _ratio(
                    figures[name][label]["aggregate_tok_s"],
                    figures["http1"][label]["aggregate_tok_s"],
                ),
                "front_cpu_ms_per_request": _ratio(
                    figures[name][label]["front_cpu_ms_per_request"],
                    figures["http1"][label]["front_cpu_ms_per_request"],
                ),
            }
            for label in figures["http1"]
        }
    return figures


def _wait(server: base.Server, tls: Tls, timeout_s: float = 600) -> None:
    context = ssl.create_default_context(cafile=str(tls.ca))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the appliance exited:\n{server.log_tail()}")
        try:
            with httpx.Client(verify=context, timeout=2) as client:
                if client.get(server.base_url + "/readyz").status_code == 200:
                    return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the appliance was not ready:\n{server.log_tail()}")


def run(name: str, ctx: Context, work: Any, *, slots: int = 1) -> dict[str, Any]:
    server = start(name, ctx, slots=slots)
    process = psutil.Process(server.proc.pid)
    try:
        base.wait_ready(server, timeout_s=600)
        cpu = base.tree_cpu_seconds(process)
        figures: dict[str, Any] = asyncio.run(work(server))
        figures["cpu_s"] = round(base.tree_cpu_seconds(process) - cpu, 2)
    finally:
        base.stop(server)
    if ctx.model is None:
        ctx.model = base._model_file(ctx.data_dir)
    return figures


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The cost of tools, n and logprobs.")
    parser.add_argument("--requests", type=int, default=10, help="requests per workload")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    parser.add_argument(
        "--only", default="", help="workloads to run (tool_calls,choices_4,logprobs,transports)"
    )
    args = parser.parse_args(argv)
    build = build_llama_server()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvl-bench-") as tmp:
        work = Path(tmp)
        data_dir = work / "data"
        key = base.create_key(data_dir)
        ctx = Context(work, data_dir, {"Authorization": f"Bearer {key}"}, build.binary)
        n = args.requests
        plans = {
            "tool_calls": (lambda s: tool_calls(s, n), lambda s: tool_calls(s, n), 1),
            "choices_4": (
                lambda s: choices(s, n, native=True),
                lambda s: choices(s, n, native=False),
                4,
            ),
            "logprobs": (lambda s: logprobs(s, n), lambda s: logprobs(s, n), 1),
        }
        chosen = set(args.only.split(",")) if args.only else {*plans, "transports"}
        for label, (ours, theirs, slots) in plans.items():
            if label not in chosen:
                continue
            base.say(f"{label}: appliance")
            app = run("appliance", ctx, ours, slots=slots)
            base.say(f"{label}: llama-server")
            ref = run("llama-server", ctx, theirs, slots=slots)
            rows[label] = {"appliance": app, "llama_server": ref}
            base.say(f"  {label}: {app} vs {ref}")
        if "transports" in chosen:
            rows["transports"] = transports(ctx, n)
    if set(plans) <= chosen:
        _ratios(rows)
    result = {
        **base.stamp(),
        "llama_server_build": build.info,
        "workloads": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    base.say(f"written to {args.out}")
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The tables docs/benchmarks.md shows, from a result (a test keeps them equal)."""
    w = result["workloads"]
    load = result.get("machine", {}).get("load_average")
    lines = [
        headline(result, *([f"load average at the end {load[0]:.1f}"] if load else [])),
        "",
        "| workload | appliance | llama-server | ratio |",
        "|---|---|---|---|",
    ]
    if "tool_calls" in w:
        a, b = w["tool_calls"]["appliance"], w["tool_calls"]["llama_server"]
        lines.append(
            f"| tool calls, `tool_choice: required`: latency p50 | {a['latency_ms_p50']} ms | "
            f"{b['latency_ms_p50']} ms | {_ratio(a['latency_ms_p50'], b['latency_ms_p50'])} |"
        )
        lines.append(
            f"| tool calls: answers whose call fits the schema | {a['valid_calls']:.0%} | "
            f"{b['valid_calls']:.0%} | |"
        )
    if "choices_4" in w:
        a, b = w["choices_4"]["appliance"], w["choices_4"]["llama_server"]
        lines.append(
            f"| 4 choices (`n: 4` / 4 requests): tokens/s | {a['aggregate_tok_s']} | "
            f"{b['aggregate_tok_s']} | {_ratio(a['aggregate_tok_s'], b['aggregate_tok_s'])} |"
        )
        lines.append(
            f"| 4 choices: wall p50 | {a['wall_ms_p50']} ms | {b['wall_ms_p50']} ms | "
            f"{_ratio(a['wall_ms_p50'], b['wall_ms_p50'])} |"
        )
    if "logprobs" in w:
        a, b = w["logprobs"]["appliance"], w["logprobs"]["llama_server"]
        lines.append(
            f"| `top_logprobs: 5`: tokens/s (vs without) | {a['top_logprobs_5']} "
            f"({a['ratio']}) | {b['top_logprobs_5']} ({b['ratio']}) | "
            f"{_ratio(a['top_logprobs_5'], b['top_logprobs_5'])} |"
        )
    if "transports" in w:
        t = w["transports"]
        lines += [
            "",
            "| transport (TLS) | streams | tokens/s | front CPU ms/request | vs HTTP/1.1 |",
            "|---|---|---|---|---|",
        ]
        for name, label in (("http1", "HTTP/1.1"), ("http2", "HTTP/2 (nginx)"), ("grpc", "gRPC")):
            for streams, row in t[name].items():
                if streams == "ratios":
                    continue
                ratio = t[name].get("ratios", {}).get(streams)
                versus = (
                    f"{ratio['aggregate_tok_s']}x tokens/s, "
                    f"{ratio['front_cpu_ms_per_request']}x CPU"
                    if ratio
                    else ""
                )
                lines.append(
                    f"| {label} | {streams.removeprefix('streams_')} | {row['aggregate_tok_s']} "
                    f"| {row['front_cpu_ms_per_request']} | {versus} |"
                )
    return "\n".join(lines) + "\n"


def _ratios(rows: dict[str, Any]) -> None:
    rows["tool_calls"]["ratios"] = {
        "latency_ms_p50": _ratio(
            rows["tool_calls"]["appliance"]["latency_ms_p50"],
            rows["tool_calls"]["llama_server"]["latency_ms_p50"],
        )
    }
    rows["choices_4"]["ratios"] = {
        "aggregate_tok_s": _ratio(
            rows["choices_4"]["appliance"]["aggregate_tok_s"],
            rows["choices_4"]["llama_server"]["aggregate_tok_s"],
        ),
        "wall_ms_p50": _ratio(
            rows["choices_4"]["appliance"]["wall_ms_p50"],
            rows["choices_4"]["llama_server"]["wall_ms_p50"],
        ),
    }
    rows["logprobs"]["ratios"] = {
        "top_logprobs_5": _ratio(
            rows["logprobs"]["appliance"]["top_logprobs_5"],
            rows["logprobs"]["llama_server"]["top_logprobs_5"],
        )
    }


if __name__ == "__main__":
    raise SystemExit(main())
