"""Structured output and tool calls with the real model: every sampled answer fits.

The batching engine runs in this process (as in test_batching.py) so many seeds decode
side by side; the grammar and the validator are the ones the gateway uses
(appliance.validation.structured). Temperature 1.0: the model's own preferences are
what would break a bound, and the grammar must not let them.
"""

from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from appliance.serving.batching import BatchEngine
from appliance.serving.engine import (
    EngineOptions,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    LlamaVocabulary,
)
from appliance.serving.sampling_options import Sampling
from appliance.validation.structured import json_schema_output
from appliance.validation.tools import plan_tools

if TYPE_CHECKING:
    from appliance.state.records import ModelRecord

pytestmark = pytest.mark.model

BOUNDED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "title": {"type": "string", "maxLength": 16},
        "published": {"type": "string", "format": "date"},
    },
    "required": ["rating", "confidence", "title", "published"],
    "additionalProperties": False,
}


@dataclass
class Outcome:
    events: list[Event | Failed] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Any) -> None:
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.done.set()

    @property
    def finished(self) -> Finished:
        last = self.events[-1]
        assert isinstance(last, Finished), last
        return last


def generate(
    model: ModelRecord,
    prompt: str,
    grammar: str,
    seeds: list[int],
    max_tokens: int,
    *,
    temperature: float = 1.0,
    chat: bool = True,
) -> list[Finished]:
    """One constrained generation per seed, four at a time, all queued before the start.
    ``prompt`` is a user message, or (``chat`` false) the rendered prompt itself."""
    engine = BatchEngine(model, EngineOptions(n_ctx=512, n_slots=4, n_batch=256, n_threads=1))
    engine.load()
    assert engine.vocab is not None
    if chat:
        prompt = engine.vocab.chat_template.render([{"role": "user", "content": prompt}])
    tokens = tuple(engine.vocab.tokenize(prompt, chat=True))
    outcomes = [Outcome() for _ in seeds]
    for seed, outcome in zip(seeds, outcomes, strict=True):
        request = GenerationRequest(
            prompt_tokens=tokens,
            max_tokens=max_tokens,
            sampling=Sampling(temperature=temperature, seed=seed),
            grammar=grammar,
        )
        engine.jobs.put(Job(request, outcome.emit, threading.Event()))
    thread = threading.Thread(target=engine.serve_forever)
    thread.start()
    try:
        for outcome in outcomes:
            assert outcome.done.wait(1200), "a generation never ended"
    finally:
        engine.jobs.put(None)
        thread.join(60)
        engine.close()
    return [o.finished for o in outcomes]


@pytest.mark.timeout(1500)  # 30 generations; minutes on two loaded cores
def test_every_seed_fits_the_bounds_and_formats(default_model: ModelRecord) -> None:
    structured = json_schema_output(BOUNDED, "review")
    prompt = (
        "Review the film Metropolis as JSON with a rating, a confidence, a title "
        "and the date it was published."
    )
    finished = generate(default_model, prompt, structured.grammar, list(range(30)), 120)
    answers = []
    for result in finished:
        assert result.finish_reason == "stop", result  # the grammar closed the object
        assert structured.problems(result.text) == [], result.text
        value = json.loads(result.text)
        assert 1 <= value["rating"] <= 5
        assert isinstance(value["rating"], int)
        assert 0 <= value["confidence"] <= 1
        assert len(value["title"]) <= 16
        datetime.date.fromisoformat(value["published"])
        answers.append(value)
    # Temperature 1.0 with 30 seeds: the grammar constrains, it does not fix the answer.
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 10


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.timeout(900)
def test_a_required_tool_call_always_parses_into_a_valid_call(default_model: ModelRecord) -> None:
    """tool_choice=required with the model's own (Gemma family) template: the generic
    format, greedy and seeded, every answer one valid get_weather call."""
    record = default_model
    vocab = LlamaVocabulary.load(record)
    try:
        plan = plan_tools([WEATHER_TOOL], "required", template=vocab.chat_template)
        prompt_messages = [{"role": "user", "content": "What is the weather in Lisbon?"}]
        prompt = plan.render(vocab.chat_template, prompt_messages)
    finally:
        vocab.close()
    assert plan.format == "generic"
    assert plan.grammar is not None
    greedy = generate(record, prompt, plan.grammar, [0], 120, temperature=0.0, chat=False)
    seeded = generate(record, prompt, plan.grammar, list(range(1, 8)), 120, chat=False)
    for result in greedy + seeded:
        assert result.finish_reason == "stop", result
        output = plan.parse(result.text)
        assert output.content is None
        [call] = output.calls
        assert call.name == "get_weather"
        arguments = json.loads(call.arguments_json)
        assert set(arguments) == {"city", "unit"}
        assert arguments["unit"] in {"celsius", "fahrenheit"}
        assert isinstance(arguments["city"], str)
        assert len(arguments["city"]) <= 40
