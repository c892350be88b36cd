"""The batching engine with the real model, in this process: shared-prefix reuse.

Through a worker and the gateway, the same engine is covered by test_gateway.py and
test_supervisor.py; here its prefix store is driven directly, so the tests can line up
arrivals exactly (all queued before the engine's first step).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from appliance.serving.batching import BatchEngine
from appliance.serving.engine import (
    EngineOptions,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    SlotChange,
    TextDelta,
)
from appliance.serving.sampling_options import Sampling
from tests.appliance.logits import MAX_DRIFT, MEAN_DRIFT

if TYPE_CHECKING:
    from appliance.state.records import ModelRecord

pytestmark = pytest.mark.model

SYSTEM = (
    "You are the help desk of a secondary school. Answer in one short sentence, politely, "
    "and never invent timetable details you were not given. "
) * 6
QUESTIONS = [
    "When does the library open?",
    "Who teaches chemistry?",
    "Is there a bus on Saturday?",
    "Where is room 12?",
    "Can I bring a laptop?",
]


@dataclass
class Outcome:
    events: list[Event | Failed | SlotChange] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Event | Failed | SlotChange) -> None:
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.done.set()

    @property
    def finished(self) -> Finished:
        last = self.events[-1]
        assert isinstance(last, Finished), last
        return last


@dataclass
class Ran:
    outcomes: list[Outcome]
    reused: int  # prompt tokens copied from the prefix store
    first_logits: list[np.ndarray[Any, Any]]  # per prompt, its first sampled position's


def run(
    model: ModelRecord,
    prompts: list[str],
    *,
    slots: int,
    share: int,
    cancel_first: bool = False,
    keep_first_logits: bool = False,
) -> Ran:
    """Queue every prompt before the engine starts, run to the end. Slots keep nothing
    between requests: what is reused comes from the prefix store alone."""
    engine = BatchEngine(
        model,
        EngineOptions(
            n_ctx=512,
            n_slots=slots,
            n_batch=128,
            n_threads=1,
            prefix_min_tokens=share,
            cache_prompt=False,
        ),
    )
    engine.load()
    engine.keep_first_logits = keep_first_logits
    assert engine.vocab is not None
    outcomes = [Outcome() for _ in prompts]
    tokenized = [tuple(engine.vocab.tokenize(text, chat=False)) for text in prompts]
    for i, (tokens, outcome) in enumerate(zip(tokenized, outcomes, strict=True)):
        cancel = threading.Event()
        if cancel_first and i == 0:
            cancel.set()
        request = GenerationRequest(
            prompt_tokens=tokens,
            max_tokens=12,
            sampling=Sampling(temperature=0.0),
        )
        engine.jobs.put(Job(request, outcome.emit, cancel))
    thread = threading.Thread(target=engine.serve_forever)
    thread.start()
    try:
        for outcome in outcomes:
            assert outcome.done.wait(120), "a request never ended"
    finally:
        engine.jobs.put(None)
        thread.join(60)
        engine.close()
    # Each prompt is there once; one that never sampled (cancelled) has none.
    logits = [engine.first_logits.get(tokens, [np.zeros(0)])[0] for tokens in tokenized]
    return Ran(outcomes, engine.prefix_tokens_reused, logits)


def test_a_shared_prefix_is_computed_once_and_the_model_sees_the_same_prompt(
    default_model: ModelRecord,
) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS]
    # One slot: each request decodes alone, so the only difference sharing makes is where
    # the prefix's KV came from (and the shape of the prefill that follows it).
    shared = run(default_model, prompts, slots=1, share=32, keep_first_logits=True)
    plain = run(default_model, prompts, slots=1, share=0, keep_first_logits=True)
    assert plain.reused == 0
    prefix_len = shared.outcomes[0].finished.prompt_tokens - 10  # the questions are under 10
    # The first prompt builds the store while it prefills; the four others copy it.
    assert shared.reused >= 4 * prefix_len
    assert [o.finished.cached_tokens >= prefix_len for o in shared.outcomes] == [False] + [True] * 4
    for mine, theirs in zip(shared.first_logits, plain.first_logits, strict=True):
        assert mine.size == theirs.size > 0
        drift = np.abs(mine - theirs)
        assert float(drift.max()) < MAX_DRIFT
        assert float(drift.mean()) < MEAN_DRIFT
    # The measure tells prompts apart: another question moves the logits past the tolerance.
    for one, other in zip(plain.first_logits, plain.first_logits[1:], strict=False):
        assert float(np.abs(one - other).max()) > MAX_DRIFT
    assert all(o.finished.completion_tokens > 0 for o in shared.outcomes + plain.outcomes)


def test_concurrent_sequences_share_one_prefix_and_all_finish(
    default_model: ModelRecord,
) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS]
    ran = run(default_model, prompts, slots=4, share=32)
    outcomes = ran.outcomes
    assert ran.reused > 0
    for outcome in outcomes:
        assert outcome.finished.finish_reason in {"stop", "length"}
        assert outcome.finished.completion_tokens > 0


def test_a_builder_cancelled_before_it_starts_hands_the_prefix_to_a_waiting_request(
    default_model: ModelRecord,
) -> None:
    # The first request would build the prefix for the others, but its client is gone
    # before the first step: the parked requests are placed again, one of them builds.
    prompts = [SYSTEM + q for q in QUESTIONS[:3]]
    ran = run(default_model, prompts, slots=2, share=32, cancel_first=True)
    outcomes, reused = ran.outcomes, ran.reused
    assert outcomes[0].finished.finish_reason == "cancelled"
    assert outcomes[0].finished.completion_tokens == 0
    for outcome in outcomes[1:]:
        assert outcome.finished.completion_tokens > 0
    assert reused > 0


def test_s2_preempts_a_running_s0_sequence_which_resumes_and_completes(
    default_model: ModelRecord,
) -> None:
    engine = BatchEngine(
        default_model, EngineOptions(n_ctx=512, n_slots=1, n_batch=128, n_threads=1)
    )
    engine.load()
    assert engine.vocab is not None
    vocab = engine.vocab

    def request(text: str, priority: int, max_tokens: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_tokens=tuple(vocab.tokenize(text, chat=False)),
            max_tokens=max_tokens,
            sampling=Sampling(temperature=0.0),
            priority=priority,
        )

    background, urgent = Outcome(), Outcome()
    order: list[str] = []
    thread = threading.Thread(target=engine.serve_forever)
    thread.start()
    try:
        started = threading.Event()

        def on_background(event: Event | Failed | SlotChange) -> None:
            background.emit(event)
            if sum(isinstance(e, TextDelta) for e in background.events) == 3:
                started.set()
            if isinstance(event, Finished):
                order.append("S0")

        def on_urgent(event: Event | Failed | SlotChange) -> None:
            urgent.emit(event)
            if isinstance(event, Finished):
                order.append("S2")

        long_story = "Once upon a time, in a village by the sea, there lived"
        engine.jobs.put(Job(request(long_story, 0, 48), on_background, threading.Event()))
        assert started.wait(60), "the S0 sequence never started"
        engine.jobs.put(
            Job(request("The capital of France is", 2, 6), on_urgent, threading.Event())
        )
        assert urgent.done.wait(60)
        assert background.done.wait(120)
    finally:
        engine.jobs.put(None)
        thread.join(60)
        engine.close()
    # The only slot went to S2 while S0 was mid-stream; S0 then resumed where it was.
    assert engine.preemptions == 1
    assert order == ["S2", "S0"]
    assert urgent.finished.completion_tokens > 0
    done = background.finished
    assert done.completion_tokens == 48 or done.finish_reason == "stop"
    streamed = "".join(e.text for e in background.events if isinstance(e, TextDelta))
    assert streamed == done.text


def test_a_conversations_next_turn_reuses_the_cells_its_slot_kept(
    default_model: ModelRecord,
) -> None:
    """Turn two of a chat repeats turn one and its answer: it goes to the slot that ran turn
    one, computes only what is new, and the model sees the same prompt as without reuse."""

    def start(*, keep: bool) -> tuple[BatchEngine, threading.Thread]:
        engine = BatchEngine(
            default_model,
            EngineOptions(
                n_ctx=512,
                n_slots=2,
                n_batch=128,
                n_threads=1,
                # The shared prefix store is on, as in service: turn two starts with turn
                # one's prompt, which must not make it build a store of that instead.
                prefix_min_tokens=32,
                cache_prompt=keep,
            ),
        )
        engine.load()
        engine.keep_first_logits = True
        thread = threading.Thread(target=engine.serve_forever)
        thread.start()
        return engine, thread

    def stop(engine: BatchEngine, thread: threading.Thread) -> None:
        engine.jobs.put(None)
        thread.join(60)
        engine.close()

    def send(engine: BatchEngine, *prompts: tuple[int, ...]) -> list[Outcome]:
        outcomes = [Outcome() for _ in prompts]
        for prompt, outcome in zip(prompts, outcomes, strict=True):
            request = GenerationRequest(
                prompt_tokens=prompt, max_tokens=12, sampling=Sampling(temperature=0.0), logprobs=0
            )
            engine.jobs.put(Job(request, outcome.emit, threading.Event()))
        for outcome in outcomes:
            assert outcome.done.wait(120), "a request never ended"
        return outcomes

    engine, thread = start(keep=True)
    try:
        assert engine.vocab is not None
        vocab = engine.vocab
        first = tuple(vocab.tokenize(SYSTEM + QUESTIONS[0], chat=False))
        # Another client's conversation in the other slot: turn two must find its own.
        other = tuple(vocab.tokenize("Write a short poem about trains at night.", chat=False))
        turn_one, _ = send(engine, first, other)
        assert engine.slot_tokens_reused == 0  # both slots were empty
        answer = tuple(
            lp.id for e in turn_one.events if isinstance(e, TextDelta) for lp in e.logprobs
        )
        assert answer
        # Not a prompt's start, so no BOS (a chat template's text is tokenized like this).
        follow_up = tuple(vocab.tokenize(" Thank you. And on Sunday?", chat=True))
        second = first + answer + follow_up
        (turn_two,) = send(engine, second)
        reused = engine.slot_tokens_reused
    finally:
        stop(engine, thread)
    assert engine.prefix_tokens_reused == reused  # none copied from a store
    # All of turn one that went through the model: the prompt and the answer but its last
    # token, unless that ended the answer (an end-of-generation token has no logprob).
    assert len(first) + len(answer) - 1 <= reused <= len(first) + len(answer)
    assert turn_two.finished.cached_tokens == reused
    assert turn_two.finished.completion_tokens > 0

    plain_engine, plain_thread = start(keep=False)
    try:
        (plain,) = send(plain_engine, second)
    finally:
        stop(plain_engine, plain_thread)
    assert plain_engine.slot_tokens_reused == 0
    assert plain.finished.cached_tokens == 0
    # The first answer token's logits with the kept cells and with all computed afresh:
    # within the rounding of another batch layout (MAX_DRIFT, measured above).
    (mine,) = engine.first_logits[second]
    (theirs,) = plain_engine.first_logits[second]
    assert mine.size == theirs.size > 0
    drift = np.abs(mine - theirs)
    assert float(drift.max()) < MAX_DRIFT
    assert float(drift.mean()) < MEAN_DRIFT
    # The measure tells prompts apart: turn one's first logits are far from turn two's.
    (one,) = engine.first_logits[first]
    assert float(np.abs(one - mine).max()) > MAX_DRIFT
