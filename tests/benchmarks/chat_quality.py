"""Chat quality: do the embedded models follow short instructions?

Twelve fixed instructions (:data:`INSTRUCTIONS`), each with two mechanical checks of the
reply: on topic (a keyword of the right answer) and in the form asked for (one word, JSON
with keys a and b, three lines, just the number, ...); followed means both. Both embedded
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
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.serving.catalog import CHAT_MODEL_NAME, DEFAULT_MODEL_NAME
from tests.benchmarks.report import headline, table
from tests.benchmarks.serving import HOST, free_port, say, stamp

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "chat-quality.json"
MODELS = (CHAT_MODEL_NAME, DEFAULT_MODEL_NAME)
MAX_TOKENS = 96
N_THREADS = 2
N_CTX = 2048


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines() if line.strip()]


Check = Callable[[str], bool]


def has(*keywords: str) -> Check:
    """Any of the keywords, as a whole word, in any case."""
    pattern = re.compile(rf"\b(?:{'|'.join(keywords)})\b", re.IGNORECASE)
    return lambda reply: pattern.search(reply) is not None


def at_most(n: int) -> Check:
    return lambda reply: 0 < len(words(reply)) <= n


def only(expected: str) -> Check:
    """Exactly this and nothing else, but for surrounding punctuation and space."""
    return lambda reply: reply.strip().strip(".!'\"") == expected


def one_word(reply: str) -> bool:
    return len(words(reply)) == 1


def three_lines(reply: str) -> bool:
    return len(lines(reply)) == 3


def json_with_keys_a_and_b(reply: str) -> bool:
    text = re.sub(r"^```(?:json)?\s*|\s*```$", "", reply.strip())  # a fenced block is JSON too
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"a", "b"}


FRUITS = has(
    "apples?", "bananas?", "oranges?", "pears?", "grapes?", "grapefruits?", "mangoe?s?",
    "strawberry", "strawberries", "cherry", "cherries", "peach", "peaches", "plums?",
    "kiwis?", "lemons?", "limes?", "pineapples?", "watermelons?", "melons?", "blueberry",
    "blueberries", "raspberry", "raspberries", "apricots?", "papayas?", "figs?",
    "pomegranates?", "avocados?", "coconuts?",
)  # fmt: skip


def a_fruit_a_line(reply: str) -> bool:
    return three_lines(reply) and all(FRUITS(line) for line in lines(reply))


def answers_yes_or_no(reply: str) -> bool:
    found = words(reply)
    return bool(found) and found[0].lower() in ("yes", "no")


def one_to_five(reply: str) -> bool:
    return all(re.search(rf"\b{n}\b", reply) for n in "12345")


def with_commas(reply: str) -> bool:
    return re.search(r"\b1\s*,\s*2\s*,\s*3\s*,\s*4\s*,\s*5\b", reply) is not None


def one_sentence(reply: str) -> bool:
    text = reply.strip()
    return "\n" not in text and len(re.findall(r"[.!?](?=\s|$)", text)) == 1


@dataclass(frozen=True)
class Instruction:
    """One instruction, and how its reply is judged: ``topic`` (a keyword of the right
    answer) and ``form`` (the format asked for); followed means both."""

    id: str
    prompt: str
    topic: Check
    form: Check
    passes_when: str


INSTRUCTIONS: tuple[Instruction, ...] = (
    Instruction(
        "one_word_capital",
        "What is the capital of France? Answer with one word.",
        has("paris"),
        one_word,
        "Paris, in one word",
    ),
    Instruction(
        "json_keys",
        "Reply in JSON with keys a and b, where a is 1 and b is 2. Reply with the JSON only.",
        lambda reply: '"a"' in reply and '"b"' in reply,
        json_with_keys_a_and_b,
        'names "a" and "b"; the reply parses as a JSON object with exactly those keys',
    ),
    Instruction(
        "three_fruits",
        "List three fruits, one per line, and nothing else.",
        FRUITS,
        a_fruit_a_line,
        "names a fruit; three lines, a fruit on each",
    ),
    Instruction(
        "haiku_sea",
        "Write a haiku about the sea.",
        has("seas?", "oceans?", "waves?", "tides?", "shores?", "surf"),
        three_lines,
        "about the sea (sea, ocean, waves, tide, shore, surf); three lines",
    ),
    Instruction(
        "translate_french",
        "Translate 'good morning' to French.",
        has("bonjour"),
        at_most(12),
        "bonjour; 12 words or fewer",
    ),
    Instruction(
        "number_only",
        "What is 7 plus 5? Answer with just the number.",
        has("12"),
        only("12"),
        "12, and nothing else",
    ),
    Instruction(
        "yes_or_no",
        "Is the sun a star? Answer yes or no.",
        lambda reply: answers_yes_or_no(reply) and words(reply)[0].lower() == "yes",
        answers_yes_or_no,
        "the first word is yes or no; yes",
    ),
    Instruction(
        "opposite",
        "What is the opposite of hot? Answer with one word.",
        has("cold"),
        one_word,
        "cold, in one word",
    ),
    Instruction(
        "count_commas",
        "Count from 1 to 5, separated by commas.",
        one_to_five,
        with_commas,
        "the numbers 1 to 5; as 1, 2, 3, 4, 5",
    ),
    Instruction(
        "capitals",
        "Write the word 'hello' in capital letters, and nothing else.",
        has("hello"),
        only("HELLO"),
        "hello; HELLO, and nothing else",
    ),
    Instruction(
        "bees",
        "What do bees make? Answer in a few words.",
        has("honey"),
        at_most(20),
        "honey; 20 words or fewer",
    ),
    Instruction(
        "one_sentence_cat",
        "Describe a cat in one sentence.",
        has("cats?"),
        one_sentence,
        "about a cat; one sentence, one line",
    ),
)


def judge(instruction: Instruction, reply: str) -> dict[str, Any]:
    # The instruction echoed back is not on topic: a base model repeats its prompt.
    on_topic = instruction.topic(reply.replace(instruction.prompt, ""))
    in_form = instruction.form(reply)
    return {
        "id": instruction.id,
        "followed": on_topic and in_form,
        "on_topic": on_topic,
        "form": in_form,
        "reply": reply,
    }


def tally(results: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "followed": sum(r["followed"] for r in results),
        "on_topic": sum(r["on_topic"] for r in results),
        "total": len(results),
    }


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
