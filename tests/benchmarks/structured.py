"""Structured output: the appliance's JSON Schema converter against two others.

Three ways to constrain the same model to the same schemas, measured in one run:

* ``port``: appliance.validation.grammar, the grammar the appliance uses;
* ``bundled``: the converter llama-cpp-python 0.3.36 bundles (llama_cpp.llama_grammar),
  which the appliance used before;
* ``llguidance``: Microsoft's llguidance (PyPI), which compiles the schema itself and
  masks tokens from its own parser. It cannot hand llama.cpp a grammar: what it emits is
  Lark or its own JSON grammar, and llama.cpp takes llguidance grammars only in a build
  with LLAMA_LLGUIDANCE, and then only in llama-server's common code, not through
  ``llama_sampler_init_grammar`` (checked here: that call returns NULL). So it runs as its
  own sampler loop: its mask applied to the logits, then the same temperature sampling.

For each schema: compile time (schema to a ready sampler: the conversion plus
``llama_sampler_init_grammar`` against the vocabulary, or llguidance's schema compile plus
its matcher; median of 20) and, over ``--seeds`` seeds at temperature 1.0 with the real
model, how many answers parse and validate against the schema with its formats. The
GBNF ways decode through the appliance's own engine (appliance.serving.batching).
Run: ``python -m tests.benchmarks.structured``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import llama_cpp
import numpy as np

from appliance.serving.batching import BatchEngine
from appliance.serving.catalog import ensure_default_model
from appliance.serving.engine import (
    EngineOptions,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    LlamaVocabulary,
)
from appliance.serving.sampling_options import Sampling
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from appliance.validation.grammar import json_schema_to_gbnf
from tests.benchmarks.report import headline, table
from tests.benchmarks.serving import say, stamp

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "structured.json"

SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "bounded": (
        "Review the film Metropolis as JSON: rating, confidence, title, published date.",
        {
            "type": "object",
            "properties": {
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "title": {"type": "string", "maxLength": 16},
                "published": {"type": "string", "format": "date"},
            },
            "required": ["rating", "confidence", "title", "published"],
            "additionalProperties": False,
        },
    ),
    "person": (
        "Give a person as JSON: name, age and pet.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "pet": {"enum": ["cat", "dog", "none"]},
            },
            "required": ["name", "age", "pet"],
            "additionalProperties": False,
        },
    ),
    "event": (
        "Give a meeting as JSON: an id, a start time and one attendee's email.",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "start": {"type": "string", "format": "date-time"},
                "attendees": {
                    "type": "array",
                    "items": {"type": "string", "format": "email"},
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["id", "start", "attendees"],
            "additionalProperties": False,
        },
    ),
    "code": (
        "Give a product code like AB-123 and its price in euros as JSON.",
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
            },
            "required": ["code", "price"],
            "additionalProperties": False,
        },
    ),
}


def bundled_gbnf(schema: dict[str, Any]) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf as bundled  # noqa: PLC0415

    return str(bundled(json.dumps(schema)))


CONVERTERS = {"port": json_schema_to_gbnf, "bundled": bundled_gbnf}


def validity(schema: dict[str, Any], text: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "not JSON"
    cls = jsonschema.validators.validator_for(schema)
    errors = list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    return "valid" if not errors else errors[0].message[:80]


def compile_ms(vocab: Any, make: Any, schema: dict[str, Any]) -> float:
    samples = []
    for _ in range(20):
        start = time.perf_counter()
        grammar = make(schema)
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        samples.append(time.perf_counter() - start)
        if not sampler:
            raise RuntimeError("llama.cpp refused the grammar")
        llama_cpp.llama_sampler_free(sampler)
    return statistics.median(samples) * 1000


def prompt_tokens(vocab: LlamaVocabulary, prompt: str) -> tuple[int, ...]:
    text = vocab.chat_template.render([{"role": "user", "content": prompt}])
    return tuple(vocab.tokenize(text, chat=True))


def run_gbnf(
    model: ModelRecord, jobs: list[tuple[str, str, int]], max_tokens: int
) -> list[Finished]:
    """(prompt, grammar, seed) each, four at a time through the appliance's engine."""
    engine = BatchEngine(model, EngineOptions(n_ctx=512, n_slots=4, n_batch=256))
    engine.load()
    assert engine.vocab is not None
    done: list[threading.Event] = []
    results: list[Finished | None] = [None] * len(jobs)
    for i, (prompt, grammar, seed) in enumerate(jobs):
        finished = threading.Event()
        done.append(finished)

        def emit(event: Any, i: int = i, finished: threading.Event = finished) -> None:
            if isinstance(event, Finished):
                results[i] = event
            if isinstance(event, Finished | Failed):
                finished.set()

        request = GenerationRequest(
            prompt_tokens=prompt_tokens(engine.vocab, prompt),
            max_tokens=max_tokens,
            sampling=Sampling(temperature=1.0, seed=seed),
            grammar=grammar,
        )
        engine.jobs.put(Job(request, emit, threading.Event()))
    thread = threading.Thread(target=engine.serve_forever)
    thread.start()
    for finished in done:
        finished.wait()
    engine.jobs.put(None)
    thread.join()
    engine.close()
    if any(r is None for r in results):
        raise RuntimeError("a generation failed")
    return [r for r in results if r is not None]


class Guided:
    """llguidance's matcher as the constraint of a plain llama.cpp decoding loop."""

    def __init__(self, model: ModelRecord) -> None:
        import llguidance  # noqa: PLC0415
        import llguidance.llamacpp  # noqa: PLC0415

        self.llguidance = llguidance
        self.llm = llama_cpp.Llama(model_path=model.path, n_ctx=512, verbose=False)
        self.vocab = self.llm._model.vocab
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        start = time.perf_counter()
        self.tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(self.vocab)
        self.tokenizer_s = time.perf_counter() - start

    def matcher(self, schema: dict[str, Any]) -> Any:
        grammar = self.llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def compile_ms(self, schema: dict[str, Any]) -> float:
        samples = []
        for _ in range(20):
            start = time.perf_counter()
            self.matcher(schema)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1000

    def generate(
        self, tokens: tuple[int, ...], schema: dict[str, Any], seed: int, n: int
    ) -> tuple[str, bool]:
        """(the text, whether it ended before ``n`` tokens)."""
        matcher = self.matcher(schema)
        rng = np.random.default_rng(seed)
        self.llm.reset()  # type: ignore[no-untyped-call]
        self.llm.eval(list(tokens))
        out = b""
        stopped = False
        for _ in range(n):
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1),
                shape=(self.n_vocab,),
            ).astype(np.float64)
            words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            bits = ((words[:, None] >> np.arange(32, dtype=np.uint32)) & 1).ravel()
            allowed = bits[: self.n_vocab].astype(bool)
            logits[~allowed] = -np.inf
            weights = np.exp(logits - logits.max())
            token = int(rng.choice(self.n_vocab, p=weights / weights.sum()))
            if token == self.eos or llama_cpp.llama_vocab_is_eog(self.vocab, token):
                stopped = True
                break
            matcher.consume_token(token)
            out += self.llm.detokenize([token])
            if matcher.is_stopped():
                stopped = True
                break
            self.llm.eval([token])
        return out.decode("utf-8", errors="replace"), stopped


def llguidance_grammar_in_llama_cpp(vocab: Any, schema: dict[str, Any]) -> bool:
    """Whether llama.cpp's grammar sampler takes llguidance's form (llama-server's)."""
    text = "%llguidance {}\nstart: %json " + json.dumps(schema)
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode(), b"start")
    if sampler:
        llama_cpp.llama_sampler_free(sampler)
    return bool(sampler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "catalog.db")
        model = ensure_default_model(store, Path(tmp) / "models")
        store.close()
        vocab = LlamaVocabulary.load(model)
        report: dict[str, Any] = {
            **stamp(),
            "model": model.name,
            "seeds": args.seeds,
            "temperature": 1.0,
            "max_tokens": args.max_tokens,
            "llguidance_grammar_accepted_by_llama_cpp": llguidance_grammar_in_llama_cpp(
                vocab.handle, SCHEMAS["person"][1]
            ),
            "schemas": {},
        }
        guided = Guided(model)
        report["llguidance_tokenizer_s"] = round(guided.tokenizer_s, 2)
        jobs: list[tuple[str, str, int]] = []
        keys: list[tuple[str, str]] = []
        for name, (prompt, schema) in SCHEMAS.items():
            entry: dict[str, Any] = {"compile_ms": {}, "valid": {}, "failures": {}}
            for way, make in CONVERTERS.items():
                entry["compile_ms"][way] = round(compile_ms(vocab.handle, make, schema), 3)
                grammar = make(schema)
                for seed in range(args.seeds):
                    jobs.append((prompt, grammar, seed))
                    keys.append((name, way))
            entry["compile_ms"]["llguidance"] = round(guided.compile_ms(schema), 3)
            report["schemas"][name] = entry
        say(f"{len(jobs)} GBNF generations")
        for (name, way), result in zip(keys, run_gbnf(model, jobs, args.max_tokens), strict=True):
            outcome = validity(SCHEMAS[name][1], result.text)
            if result.finish_reason == "length":
                outcome = "cut by max_tokens"
            entry = report["schemas"][name]
            entry["valid"][way] = entry["valid"].get(way, 0) + (outcome == "valid")
            if outcome != "valid":
                entry["failures"].setdefault(way, []).append(f"{outcome}: {result.text[:60]!r}")
        for name, (prompt, schema) in SCHEMAS.items():
            say(f"llguidance: {name}")
            entry = report["schemas"][name]
            entry["valid"]["llguidance"] = 0
            tokens = prompt_tokens(vocab, prompt)
            for seed in range(args.seeds):
                text, stopped = guided.generate(tokens, schema, seed, args.max_tokens)
                outcome = validity(schema, text) if stopped else "cut by max_tokens"
                entry["valid"]["llguidance"] += outcome == "valid"
                if outcome != "valid":
                    entry["failures"].setdefault("llguidance", []).append(
                        f"{outcome}: {text[:60]!r}"
                    )
        vocab.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, entry in report["schemas"].items():
        say(f"{name}: compile ms {entry['compile_ms']}, valid of {args.seeds} {entry['valid']}")
    say(f"wrote {args.out}")


WAYS = ("port", "bundled", "llguidance")


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows, from a result (a test keeps them equal;
    `python -m tests.benchmarks.tables` writes it there)."""
    seeds = result["seeds"]

    def figures(entry: dict[str, Any], key: str, fmt: str) -> str:
        cells = [format(entry[key][way], fmt) if way in entry[key] else "—" for way in WAYS]
        if key == "valid":
            cells[0] = f"**{cells[0]}**"
        return " / ".join(cells)

    rows = [
        [name, figures(entry, "compile_ms", ".3f"), figures(entry, "valid", "d")]
        for name, entry in result["schemas"].items()
    ]
    accepted = "yes" if result.get("llguidance_grammar_accepted_by_llama_cpp") else "no"
    more = (
        f"{result['model']}, temperature {result['temperature']}, {seeds} seeds per schema and "
        f"way, {result['max_tokens']} tokens at most"
    )
    return "\n".join([
        headline(result, more),
        "",
        *table(
            ["schema", "compile ms: " + " / ".join(WAYS), f"valid of {seeds}: " + " / ".join(WAYS)],
            rows,
        ),
        "",
        (
            f"llguidance's one-off index of the vocabulary: {result['llguidance_tokenizer_s']} s; "
            f"llama.cpp's grammar sampler takes llguidance's grammar: {accepted}."
        ),
    ]) + "\n"  # fmt: skip


if __name__ == "__main__":
    main()
