"""Concurrent streams: the appliance's continuous batching against ``llama-server -np N``.

What is compared
    * the appliance (``kvl appliance serve``, ``model.n_slots=N``, ``model.n_ctx=2048`` per
      slot, two threads) and ``llama-server`` built from the llama.cpp vendored in the same
      llama-cpp-python sdist (tests/benchmarks/llama_server.py) with ``-np N -c 2048*N -t 2``
      and the arguments that align its context with the appliance's (serving.py explains
      them), serving the same GGUF file;
    * N = 1, 4, 8 and 16 concurrent streams: N clients in a closed loop, each sending its
      next request as soon as the previous one ends, until ``waves * N`` requests are done
      (the prompts of tests/benchmarks/serving.py in turn, greedy, ``max_tokens`` each);
    * a shared-prefix workload: 8 clients whose requests all start with the same long
      system prompt (about 400 tokens) followed by a different short question, as a help
      desk on a LAN would send. llama-server keeps each slot's last prompt and reuses it
      when the next request in that slot starts the same (its prompt cache); the appliance
      computes the prefix once and copies it into every slot that needs it;
    * a conversation workload: 8 clients, each holding a conversation of ``--turns`` turns
      as a chat client does, every request repeating the whole conversation so far (the
      system prompt, each earlier question and the answer the server gave) before the next
      question. llama-server's prompt cache keeps each slot's last conversation and
      computes only the new turn when the client's next request lands in that slot.

Figures per server and workload: aggregate completion tokens per second (all completion
tokens over the wall time from the first request sent to the last response ended), TTFT
p50 and p99 on the client (request sent on a fresh loopback connection to first text
chunk), and the wall time. Ratios are appliance / llama-server (higher is better for the
rate, lower for TTFT). The servers never run at the same time.

Each workload runs ``--repeats`` times on each server, alternating which goes first; the
result keeps every run's ratio, their spread, and the figures of the median run.

Run: ``python -m tests.benchmarks.concurrency [--streams 1,4,8,16] [--repeats 3] [--turns 6]
[--out PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import psutil

from tests.benchmarks import serving as base
from tests.benchmarks.llama_server import build_llama_server, gpu_names
from tests.benchmarks.report import DASH, TIMES, headline, table

if TYPE_CHECKING:
    from collections.abc import Sequence

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "concurrency.json"
SHARED_STREAMS = 8
TARGETS = {
    "streams_1": 1.05,
    "streams_4": 1.05,
    "streams_8": 1.05,
    "streams_16": 1.05,
    "shared_prefix": 1.2,
    "conversation": 1.2,
}
CONVERSATION_STREAMS = 8

SYSTEM_PROMPT = (
    "You are the help desk assistant of Riverside Secondary School. You answer questions "
    "from students, parents and staff about the timetable, the library, the canteen, school "
    "trips, sports clubs, exams and the school's rules. Be brief, friendly and precise. If "
    "you do not know an answer, say so and name the office that can help: the front office "
    "for general questions, the exams office for exams, the bursar for payments, and the "
    "head of year for anything about a particular student. Never share personal data about "
    "a student or a member of staff. Opening hours: the school opens at 7:45 and closes at "
    "17:30; the library opens at 8:00 and closes at 17:00, on Fridays at 15:30; the canteen "
    "serves breakfast from 7:45 to 8:30 and lunch from 12:15 to 13:30. Term dates: autumn "
    "term from 4 September to 20 December, spring term from 6 January to 4 April, summer "
    "term from 22 April to 18 July. Exams: mock exams in the second week of January, final "
    "exams from mid May to the end of June. Clubs: chess on Mondays, robotics on Tuesdays, "
    "football on Wednesdays, choir on Thursdays, drama on Fridays, all from 15:30 to 16:30. "
    "Rules: phones stay in lockers during lessons; laptops are allowed in the library; "
    "visitors sign in at the front office. Answer the question below.\n\n"
)
QUESTIONS: tuple[str, ...] = (
    "When does the library close on Friday?",
    "Which day is the robotics club?",
    "When do the final exams start?",
    "Can my son bring his laptop to the library?",
    "What time is lunch served?",
    "Who do I ask about paying for a school trip?",
    "When does the spring term begin?",
    "Is there a chess club?",
)


@dataclass
class Result:
    ttft_s: float
    completion_tokens: int


@dataclass
class Workload:
    name: str
    streams: int
    prompts: tuple[str, ...]
    requests: int
    max_tokens: int
    turns: int = 0  # a conversation of this many turns a client (0: independent requests)


@dataclass
class Measured:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    peak_rss_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        ttfts = sorted(r.ttft_s * 1000 for r in self.results)
        tokens = sum(r.completion_tokens for r in self.results)
        return {
            "requests": len(self.results),
            "completion_tokens": tokens,
            "wall_s": round(self.wall_s, 2),
            "aggregate_tok_s": round(tokens / self.wall_s, 2) if self.wall_s else None,
            "ttft_ms_p50": round(statistics.median(ttfts), 1),
            "ttft_ms_p99": round(_percentile(ttfts, 0.99), 1),
            "peak_rss_mib": round(self.peak_rss_bytes / 2**20, 1),
        }


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    index = max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))
    return ordered[index]


async def one_request(
    session: aiohttp.ClientSession, server: base.Server, prompt: str, max_tokens: int
) -> Result:
    result, _ = await answered(session, server, prompt, max_tokens)
    return result


async def answered(
    session: aiohttp.ClientSession, server: base.Server, prompt: str, max_tokens: int
) -> tuple[Result, str]:
    streamed = await base.stream_completion(session, server, prompt, max_tokens)
    tokens = streamed.completion_tokens or len(streamed.chunk_times)
    return Result(streamed.chunk_times[0], tokens), streamed.text


def turn_prompt(past: Sequence[tuple[str, str]], question: str) -> str:
    """A conversation's next request: the system prompt, every earlier turn (the
    question and the answer the server gave), then the new question."""
    turns = "".join(f"Q: {q}\nA:{a}\n\n" for q, a in past)
    return f"{SYSTEM_PROMPT}{turns}Q: {question}\nA:"


async def drive(server: base.Server, workload: Workload) -> Measured:
    """``workload.streams`` clients in a closed loop over the workload's prompts."""
    measured = Measured()
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await base.stream_completion(session, server, base.WARMUP_PROMPT, 8)
        queue: asyncio.Queue[str] = asyncio.Queue()
        for i in range(workload.requests):
            queue.put_nowait(workload.prompts[i % len(workload.prompts)])

        async def client() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                result = await one_request(session, server, prompt, workload.max_tokens)
                measured.results.append(result)

        async def conversation(first: int) -> None:
            # Client `first` asks the questions from its own place in the list onwards.
            past: list[tuple[str, str]] = []
            for turn in range(workload.turns):
                question = workload.prompts[(first + turn) % len(workload.prompts)]
                prompt = turn_prompt(past, question)
                result, text = await answered(session, server, prompt, workload.max_tokens)
                measured.results.append(result)
                past.append((question, text))

        started = time.perf_counter()
        if workload.turns:
            await asyncio.gather(*(conversation(i) for i in range(workload.streams)))
        else:
            await asyncio.gather(*(client() for _ in range(workload.streams)))
        measured.wall_s = time.perf_counter() - started
    return measured


def start(name: str, streams: int, ctx: Context, *, cache_prompt: bool = False) -> base.Server:
    port = base.free_port()
    log_path = ctx.work / f"{name}-{streams}.log"
    if name == "appliance":
        command = [*base.kvl_executable(), "appliance", "serve", "--data-dir", str(ctx.data_dir)]
        command += ["--host", base.HOST, "--port", str(port)]
        env = base.appliance_env()
        env["KVL_MODEL__N_SLOTS"] = str(streams)
        env["KVL_MODEL__MAX_QUEUE"] = str(max(16, streams))
        # Off by default (docs/operations.md says why); the conversation workload turns it
        # on, as llama-server's prompt cache is on by default.
        env["KVL_MODEL__CACHE_PROMPT"] = "true" if cache_prompt else "false"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        return base.Server(
            name, f"http://{base.HOST}:{port}", "/readyz", ctx.headers, proc, log_path
        )
    assert ctx.model is not None
    args = [str(ctx.binary), "-m", str(ctx.model), "--host", base.HOST, "--port", str(port)]
    args += ["-t", str(base.N_THREADS), "-c", str(base.N_CTX * streams), "-np", str(streams)]
    args += base.gpu_args()
    args += list(base.ALIGNED_LLAMA_SERVER_ARGS)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return base.Server(name, f"http://{base.HOST}:{port}", "/health", {}, proc, log_path)


@dataclass
class Context:
    work: Path
    data_dir: Path
    headers: dict[str, str]
    binary: Path
    model: Path | None = None


def measure(name: str, workload: Workload, ctx: Context) -> Measured:
    server = start(name, workload.streams, ctx, cache_prompt=workload.turns > 0)
    proc = psutil.Process(server.proc.pid)
    try:
        with base.RssSampler(proc) as sampler:
            base.wait_ready(server, timeout_s=600)
            measured = asyncio.run(drive(server, workload))
        measured.peak_rss_bytes = sampler.peak
    finally:
        base.stop(server)
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Concurrent streams vs llama-server -np N.")
    parser.add_argument("--streams", default="1,4,8,16", help="stream counts (1,4,8,16)")
    parser.add_argument("--waves", type=int, default=4, help="requests per stream (4)")
    parser.add_argument(
        "--repeats", type=int, default=3,
        help="runs of each workload and server, alternating which goes first (3)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--turns", type=int, default=6, help="turns of each conversation (6)")
    parser.add_argument(
        "--workloads", default="streams,shared_prefix,conversation",
        help="which workloads to run (streams,shared_prefix,conversation)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    chosen = set(args.workloads.split(","))
    counts = [int(n) for n in args.streams.split(",") if n] if "streams" in chosen else []
    workloads = [
        Workload(f"streams_{n}", n, base.PROMPTS, args.waves * n, args.max_tokens) for n in counts
    ]
    shared = tuple(SYSTEM_PROMPT + q for q in QUESTIONS)
    if "shared_prefix" in chosen:
        workloads.append(
            Workload("shared_prefix", SHARED_STREAMS, shared, args.waves * SHARED_STREAMS, 32)
        )
    talks = args.turns * CONVERSATION_STREAMS
    if "conversation" in chosen:
        workloads.append(
            Workload("conversation", CONVERSATION_STREAMS, QUESTIONS, talks, 32, turns=args.turns)
        )
    build = build_llama_server()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvl-bench-") as tmp:
        work = Path(tmp)
        data_dir = work / "data"
        key = base.create_key(data_dir)
        ctx = Context(work, data_dir, {"Authorization": f"Bearer {key}"}, build.binary)
        for i, workload in enumerate(workloads):
            runs = []
            for repeat in range(args.repeats):
                first = (i + repeat) % 2 == 0
                order = ("appliance", "llama-server") if first else ("llama-server", "appliance")
                figures: dict[str, Any] = {}
                for name in order:
                    base.say(f"{workload.name} #{repeat + 1}: {name}, {workload.requests} requests")
                    figures[name] = measure(name, workload, ctx).summary()
                    if ctx.model is None:
                        ctx.model = base._model_file(data_dir)
                runs.append(_row_of(workload, figures["appliance"], figures["llama-server"]))
                base.say(_row(workload.name, runs[-1]))
            rows[workload.name] = _summarised(runs)
            base.say(f"  {workload.name}: ratio spread {rows[workload.name]['ratio_spread']}")
    result = {
        **base.stamp(gpus=gpu_names()),
        "settings": {
            "n_threads": base.N_THREADS,
            "n_ctx_per_slot": base.N_CTX,
            "waves": args.waves,
            "repeats": args.repeats,
            "llama_server_args": [
                "-t",
                str(base.N_THREADS),
                "-c",
                f"{base.N_CTX}*N",
                "-np",
                "N",
                *list(base.ALIGNED_LLAMA_SERVER_ARGS),
            ],
            "shared_prefix_system_prompt_chars": len(SYSTEM_PROMPT),
            "conversation_turns": args.turns,
        },
        "llama_server_build": build.info,
        "targets": TARGETS,
        "workloads": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    base.say(f"written to {args.out}")
    return 0


def _row_of(workload: Workload, app: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    return {
        "streams": workload.streams,
        "requests": workload.requests,
        "max_tokens": workload.max_tokens,
        "appliance": app,
        "llama_server": ref,
        "ratios": {
            "aggregate_tok_s": _ratio(app["aggregate_tok_s"], ref["aggregate_tok_s"]),
            "ttft_ms_p50": _ratio(app["ttft_ms_p50"], ref["ttft_ms_p50"]),
            "ttft_ms_p99": _ratio(app["ttft_ms_p99"], ref["ttft_ms_p99"]),
            "wall_s": _ratio(app["wall_s"], ref["wall_s"]),
        },
    }


def _summarised(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput ratio, every run's ratio, and their spread: one
    run of a few seconds moves with the machine's noise, the median of several less."""
    ordered = sorted(runs, key=lambda run: run["ratios"]["aggregate_tok_s"] or 0.0)
    median = dict(ordered[(len(ordered) - 1) // 2])
    ratios = [run["ratios"]["aggregate_tok_s"] or 0.0 for run in ordered]
    median["repeats"] = [
        {
            "aggregate_tok_s": run["ratios"]["aggregate_tok_s"],
            "appliance_tok_s": run["appliance"]["aggregate_tok_s"],
            "llama_server_tok_s": run["llama_server"]["aggregate_tok_s"],
        }
        for run in runs
    ]
    median["ratio_spread"] = {
        "min": ratios[0],
        "median": round(statistics.median(ratios), 3),
        "max": ratios[-1],
    }
    return median


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _row(name: str, row: dict[str, Any]) -> str:
    app, ref, ratios = row["appliance"], row["llama_server"], row["ratios"]
    return (
        f"  {name}: {app['aggregate_tok_s']} vs {ref['aggregate_tok_s']} tok/s "
        f"({ratios['aggregate_tok_s']}x); TTFT p50 {app['ttft_ms_p50']} vs {ref['ttft_ms_p50']} "
        f"ms, p99 {app['ttft_ms_p99']} vs {ref['ttft_ms_p99']} ms"
    )


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows, from a result (a test keeps them equal;
    `python -m tests.benchmarks.tables` writes it there)."""
    settings, workloads = result["settings"], result["workloads"]
    repeats = max((len(w.get("repeats", [])) for w in workloads.values()), default=0)
    more = [
        f"{settings['n_threads']} threads, context {settings['n_ctx_per_slot']} per slot",
        f"{settings['waves']} requests per stream",
    ]
    if repeats > 1:
        more.append(f"ratio: median (min{DASH}max) of {repeats} repeats")
    rows = [
        [
            _label(name, row, settings),
            f"{row['appliance']['aggregate_tok_s']:.1f}",
            f"{row['llama_server']['aggregate_tok_s']:.1f}",
            _ratio_cell(row, result.get("targets", {}).get(name)),
            _target_cell(result.get("targets", {}).get(name)),
            _versus(row, "ttft_ms_p50"),
            _versus(row, "ttft_ms_p99"),
        ]
        for name, row in workloads.items()
    ]
    header = ["workload", "appliance tok/s", "llama-server tok/s", "ratio", "target"]
    header += ["TTFT p50 (ms)", "TTFT p99 (ms)"]
    return "\n".join([headline(result, *more), "", *table(header, rows)]) + "\n"


def _label(name: str, row: dict[str, Any], settings: dict[str, Any]) -> str:
    streams = row["streams"]
    if name == "shared_prefix":
        return f"shared prefix, {streams} streams"
    if name == "conversation":
        # Older results did not record the turns (nor run this workload).
        turns = settings.get("conversation_turns")
        return f"conversations, {streams} streams" + (f" {TIMES} {turns} turns" if turns else "")
    if name.startswith("streams_"):
        return f"{streams} stream{'s' if streams > 1 else ''}"
    return name


def _ratio_cell(row: dict[str, Any], wanted: float | None) -> str:
    """Aggregate tok/s, appliance / llama-server: the median of the repeats and their range
    where the result has repeats, else its one ratio; bold where a target applies."""
    spread = row.get("ratio_spread")
    if spread:
        text = f"{spread['median']:.2f} ({spread['min']:.2f}{DASH}{spread['max']:.2f})"
    else:
        text = f"{row['ratios']['aggregate_tok_s']:.2f}"
    return f"**{text}**" if wanted is not None else text


def _target_cell(wanted: float | None) -> str:
    return f"≥ {wanted}" if wanted is not None else ""


def _versus(row: dict[str, Any], key: str) -> str:
    return f"{row['appliance'][key]:.0f} vs {row['llama_server'][key]:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
