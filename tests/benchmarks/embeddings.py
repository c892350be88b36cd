"""Embedding throughput: dynamic batching against one request at a time.

The same engine (all-MiniLM-L6-v2 int8, onnxruntime, the appliance's settings) embeds
the same texts twice, in this process:

* one at a time: each text is its own request, awaited before the next is sent (a
  server without batching, or a single client);
* batched: the same texts sent as concurrent single-text requests (``--clients`` at a
  time, closed loop) through the appliance's :class:`EmbeddingBatcher`, which runs the
  requests that arrive together as one onnxruntime call.

Reported: texts per second and latency p50/p99 per request, and the ratio of the rates.
The first pass is a warm-up. Run: ``python -m tests.benchmarks.embeddings``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from appliance.serving.embeddings import (
    BatcherOptions,
    EmbeddingBatcher,
    EmbeddingEngine,
    EmbeddingOptions,
)
from tests.benchmarks.report import TIMES, headline, table
from tests.benchmarks.serving import say, stamp

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "embeddings.json"

SUBJECTS = ("The library", "The canteen", "The bus to school", "The chess club", "Our teacher")
PREDICATES = (
    "opens early on weekdays and closes at five.",
    "serves a warm lunch from a quarter past twelve.",
    "leaves from the town square every morning.",
    "meets in room twelve after the last lesson.",
    "asked us to read two chapters before Friday.",
)


def texts(n: int) -> list[str]:
    pairs = [f"{s} {p}" for s in SUBJECTS for p in PREDICATES]
    return [f"{pairs[i % len(pairs)]} (note {i})" for i in range(n)]


def _summary(latencies: list[float], wall: float, n: int) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "texts": n,
        "wall_s": round(wall, 3),
        "texts_per_s": round(n / wall, 1),
        "latency_ms_p50": round(statistics.median(ordered) * 1000, 2),
        "latency_ms_p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 2),
    }


async def one_at_a_time(batcher: EmbeddingBatcher, items: list[str]) -> dict[str, Any]:
    latencies = []
    started = time.perf_counter()
    for text in items:
        t = time.perf_counter()
        await batcher.embed([text])
        latencies.append(time.perf_counter() - t)
    return _summary(latencies, time.perf_counter() - started, len(items))


async def concurrent(batcher: EmbeddingBatcher, items: list[str], clients: int) -> dict[str, Any]:
    latencies: list[float] = []
    queue = list(reversed(items))

    async def client() -> None:
        while queue:
            text = queue.pop()
            t = time.perf_counter()
            await batcher.embed([text])
            latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return _summary(latencies, time.perf_counter() - started, len(items))


async def run(n: int, clients: int, threads: int) -> dict[str, Any]:
    engine = await asyncio.to_thread(EmbeddingEngine.load, EmbeddingOptions(threads=threads))
    items = texts(n)
    async with EmbeddingBatcher(engine, BatcherOptions(max_queue=max(64, clients))) as batcher:
        await concurrent(batcher, items[:64], clients)  # warm-up
        single = await one_at_a_time(batcher, items)
        batched = await concurrent(batcher, items, clients)
    return {
        "provider": engine.provider,
        "one_at_a_time": single,
        "batched": batched,
        "ratio_texts_per_s": round(batched["texts_per_s"] / single["texts_per_s"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Embedding throughput, batched vs single.")
    parser.add_argument("--texts", type=int, default=512, help="texts per pass (512)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (32)")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime threads (2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    figures = asyncio.run(run(args.texts, args.clients, args.threads))
    result = {
        **stamp(),
        "settings": {"texts": args.texts, "clients": args.clients, "threads": args.threads},
        **figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    one, many = figures["one_at_a_time"], figures["batched"]
    say(
        f"embeddings ({figures['provider']}): one at a time {one['texts_per_s']} texts/s "
        f"(p50 {one['latency_ms_p50']} ms); batched, {args.clients} clients "
        f"{many['texts_per_s']} texts/s (p50 {many['latency_ms_p50']} ms): "
        f"{figures['ratio_texts_per_s']}x"
    )
    say(f"written to {args.out}")
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows, from a result (a test keeps them equal;
    `python -m tests.benchmarks.tables` writes it there)."""
    settings, one, many = result["settings"], result["one_at_a_time"], result["batched"]

    def latency(figures: dict[str, Any]) -> str:
        return f"{figures['latency_ms_p50']:.0f} / {figures['latency_ms_p99']:.0f} ms"

    more = f"{settings['threads']} threads, {result['provider']}, {settings['texts']} texts"
    return "\n".join([
        headline(result, more),
        "",
        *table(
            ["", "texts/s", "latency p50 / p99 per request"],
            [
                ["one request at a time", f"{one['texts_per_s']:.1f}", latency(one)],
                [
                    f"{settings['clients']} concurrent single-text clients, dynamic batcher",
                    f"{many['texts_per_s']:.1f}",
                    latency(many),
                ],
                ["batched / one at a time", f"**{result['ratio_texts_per_s']}{TIMES}**", ""],
            ],
        ),
    ]) + "\n"  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
