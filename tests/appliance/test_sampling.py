"""Sampling options, logprobs and prompts shared by siblings, on the real model.

The batching engine runs in this process (as in test_batching.py), so each request's events
and the engine's counters can be read directly; through a worker the same fields travel as
test_ipc.py checks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    TokenLogprob,
)
from appliance.serving.sampling_options import Sampling
from tests.appliance.logits import MAX_DRIFT, MEAN_DRIFT

if TYPE_CHECKING:
    from appliance.state.records import ModelRecord

pytestmark = pytest.mark.model

GREEDY = Sampling(temperature=0.0)
CAPITAL = "The capital of France is"
BANANA = 30077  # " banana" in Gemma 3's vocabulary (checked in the test that forces it)


@dataclass
class Outcome:
    events: list[Event | Failed | SlotChange] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    streaming: threading.Event = field(default_factory=threading.Event)  # text came

    def emit(self, event: Event | Failed | SlotChange) -> None:
        self.events.append(event)
        if isinstance(event, TextDelta) and event.text:
            self.streaming.set()
        if isinstance(event, Finished | Failed):
            self.done.set()

    @property
    def finished(self) -> Finished:
        last = self.events[-1]
        assert isinstance(last, Finished), last
        return last

    @property
    def deltas(self) -> list[TextDelta]:
        return [e for e in self.events if isinstance(e, TextDelta)]

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [lp for d in self.deltas for lp in d.logprobs]

    @property
    def ids(self) -> list[int]:
        return [lp.id for lp in self.logprobs]


class Engine:
    """A loaded BatchEngine serving on its own thread."""

    def __init__(self, model: ModelRecord, *, slots: int = 2, share: int = 0) -> None:
        # Slots keep no cells between requests: these tests send the same prompt again and
        # count what is copied, or compare greedy answers, which a prompt decoded on top of
        # kept cells (another batch layout) could flip in a near-tie.
        self.engine = BatchEngine(
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
        self.engine.load()
        assert self.engine.vocab is not None
        self.vocab = self.engine.vocab
        self._thread: threading.Thread | None = None

    def request(
        self,
        text: str,
        sampling: Sampling = GREEDY,
        max_tokens: int = 12,
        *,
        logprobs: int | None = None,
        share_prompt: bool = False,
        stop: tuple[str, ...] = (),
        grammar: str | None = None,
    ) -> GenerationRequest:
        return GenerationRequest(
            prompt_tokens=tuple(self.vocab.tokenize(text, chat=False)),
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            grammar=grammar,
            logprobs=logprobs,
            share_prompt=share_prompt,
        )

    def submit(self, request: GenerationRequest) -> Outcome:
        outcome = Outcome()
        self.engine.jobs.put(Job(request, outcome.emit, threading.Event()))
        return outcome

    def start(self) -> None:
        self._thread = threading.Thread(target=self.engine.serve_forever)
        self._thread.start()

    def wait(self, *outcomes: Outcome) -> None:
        for outcome in outcomes:
            assert outcome.done.wait(120), "a request never ended"

    def run(self, request: GenerationRequest) -> Outcome:
        outcome = self.submit(request)
        self.wait(outcome)
        assert not isinstance(outcome.events[-1], Failed), outcome.events[-1]
        return outcome

    def close(self) -> None:
        self.engine.jobs.put(None)
        if self._thread is not None:
            self._thread.join(60)
        self.engine.close()


@pytest.fixture(scope="module")
def engine(default_model: ModelRecord) -> Iterator[Engine]:
    served = Engine(default_model)
    served.start()
    yield served
    served.close()


def greedy_ids(engine: Engine, text: str, max_tokens: int = 12) -> list[int]:
    return engine.run(engine.request(text, max_tokens=max_tokens, logprobs=0)).ids


# -- logit bias ------------------------------------------------------------------------------


def test_logit_bias_minus_100_bans_the_token_greedy_would_pick(engine: Engine) -> None:
    first = greedy_ids(engine, CAPITAL)[0]
    for sampling in (
        Sampling(temperature=0.0, logit_bias=((first, -100.0),)),
        Sampling(temperature=1.0, seed=3, logit_bias=((first, -100.0),)),
    ):
        ids = engine.run(engine.request(CAPITAL, sampling, logprobs=0)).ids
        assert ids
        assert first not in ids


def test_logit_bias_plus_100_forces_a_token_greedy_and_sampled(engine: Engine) -> None:
    assert engine.vocab.tokenize(" banana", chat=False)[-1] == BANANA
    for sampling in (
        Sampling(temperature=0.0, logit_bias=((BANANA, 100.0),)),
        Sampling(temperature=1.0, seed=7, top_p=0.9, logit_bias=((BANANA, 100.0),)),
    ):
        outcome = engine.run(engine.request(CAPITAL, sampling, max_tokens=4, logprobs=0))
        assert outcome.ids == [BANANA] * 4
        assert outcome.finished.text == " banana" * 4
        # Logprobs are the model's own: the forced token was unlikely there.
        assert outcome.logprobs[0].logprob < -5


def test_the_grammar_holds_against_a_bias_that_forces_a_token_it_forbids(
    engine: Engine,
) -> None:
    # The fast path samples without the grammar first: the forced " banana" is rejected, and
    # the full grammar pass picks among digits (with the bias still applied, harmlessly).
    digits = "root ::= [0-9]+"
    plain = engine.run(engine.request("Pick a number:", max_tokens=6, grammar=digits))
    biased = engine.run(
        engine.request(
            "Pick a number:",
            Sampling(temperature=0.0, logit_bias=((BANANA, 100.0),)),
            max_tokens=6,
            grammar=digits,
        )
    )
    assert plain.finished.text.isdigit()
    assert biased.finished.text == plain.finished.text
    # Banning the grammar's greedy first digit makes it pick another digit.
    first = engine.vocab.tokenize(plain.finished.text[0], chat=False)[-1]
    banned = engine.run(
        engine.request(
            "Pick a number:",
            Sampling(temperature=0.0, logit_bias=((first, -100.0),)),
            max_tokens=6,
            grammar=digits,
        )
    )
    assert banned.finished.text.isdigit()
    assert banned.finished.text[0] != plain.finished.text[0]


# -- top-k, min-p, repeat penalty ------------------------------------------------------------


def test_top_k_1_and_min_p_1_sample_as_greedy_does(engine: Engine) -> None:
    greedy = engine.run(engine.request(CAPITAL, max_tokens=16)).finished.text
    # At temperature 1 with this seed the draw leaves the greedy path (checked below), so the
    # cuts are what keeps it there: top-k 1 keeps one token; min-p 1 keeps the top one.
    free = Sampling(temperature=1.0, seed=3)
    assert engine.run(engine.request(CAPITAL, free, max_tokens=16)).finished.text != greedy
    for cut in (
        Sampling(temperature=1.0, seed=3, top_k=1),
        Sampling(temperature=1.0, seed=3, min_p=1.0),
    ):
        assert engine.run(engine.request(CAPITAL, cut, max_tokens=16)).finished.text == greedy


def test_greedy_by_argmax_picks_what_llama_cpps_greedy_sampler_picks(engine: Engine) -> None:
    # A plain greedy request takes the largest logit itself (Sampler._argmax); a neutral bias
    # keeps the same request on llama.cpp's own sampler chain (bias, then greedy). Same
    # prompts one at a time, so the same logits: every token must agree.
    neutral = Sampling(temperature=0.0, logit_bias=((BANANA, 0.0),))
    for text in (CAPITAL, "one one one one", "Write a list of three fruits:"):
        fast = engine.run(engine.request(text, max_tokens=24, logprobs=0)).ids
        chain = engine.run(engine.request(text, neutral, max_tokens=24, logprobs=0)).ids
        assert fast == chain, text


def test_neutral_min_p_and_repeat_penalty_change_nothing_and_a_real_one_does(
    engine: Engine,
) -> None:
    text = "one one one one one one one one"
    greedy = greedy_ids(engine, text, max_tokens=16)
    assert len(set(greedy)) == 1  # the model just goes on repeating
    neutral = Sampling(temperature=0.0, min_p=0.0, repeat_penalty=1.0, repeat_last_n=-1)
    assert engine.run(engine.request(text, neutral, max_tokens=16, logprobs=0)).ids == greedy
    seeded = Sampling(temperature=0.8, seed=11)
    a = engine.run(engine.request(text, seeded, max_tokens=16, logprobs=0)).ids
    same = Sampling(temperature=0.8, seed=11, min_p=0.0, repeat_penalty=1.0, top_k=0)
    assert engine.run(engine.request(text, same, max_tokens=16, logprobs=0)).ids == a
    # A penalty of 1.5 on the last 64 generated tokens breaks the loop.
    penalised = Sampling(temperature=0.0, repeat_penalty=1.5)
    ids = engine.run(engine.request(text, penalised, max_tokens=16, logprobs=0)).ids
    assert ids[0] == greedy[0]  # nothing generated yet to penalise
    assert len(set(ids)) > 1


# -- logprobs --------------------------------------------------------------------------------


def test_logprobs_cover_every_token_with_k_sorted_alternatives(engine: Engine) -> None:
    for k in (0, 1, 5, 20):
        outcome = engine.run(engine.request(CAPITAL, max_tokens=16, logprobs=k))
        done = outcome.finished
        entries = outcome.logprobs
        assert len(entries) == done.completion_tokens > 0
        assert "".join(d.text for d in outcome.deltas) == done.text
        for entry in entries:
            assert entry.logprob <= 0.0
            assert len(entry.top) == k
            values = [value for _, value in entry.top]
            assert values == sorted(values, reverse=True)
            assert all(v <= 0.0 for v in values)
            assert math.fsum(math.exp(v) for v in values) <= 1.0 + 1e-6
            if k:
                # Greedy picks the most likely token, whose logprob is the top one's.
                assert entry.top[0][0] == entry.id
                assert entry.top[0][1] == pytest.approx(entry.logprob)
        if k == 20:
            # The text of each token is its piece: the ids are what was generated.
            assert b"".join(engine.vocab.piece(e.id) for e in entries).decode() == done.text


def test_no_logprobs_unless_asked_and_sampled_tokens_need_not_be_the_top(
    engine: Engine,
) -> None:
    plain = engine.run(engine.request(CAPITAL))
    assert plain.logprobs == []
    hot = Sampling(temperature=1.5, seed=5)
    outcome = engine.run(engine.request(CAPITAL, hot, max_tokens=24, logprobs=3))
    entries = outcome.logprobs
    assert len(entries) == outcome.finished.completion_tokens
    assert any(e.id != e.top[0][0] for e in entries)
    for entry in entries:
        assert entry.logprob <= entry.top[0][1]


def test_logprobs_held_back_with_the_text_go_out_with_the_delta_that_has_it(
    engine: Engine,
) -> None:
    # A stop string holds text back until it is ruled out: the logprobs wait with it, and
    # the stop string's own token, which produces no text, is counted too.
    greedy = engine.run(engine.request(CAPITAL, max_tokens=16)).finished.text
    assert greedy.startswith(" the capital of")
    outcome = engine.run(engine.request(CAPITAL, max_tokens=16, stop=(" of",), logprobs=2))
    done = outcome.finished
    assert done.text == " the capital"
    assert done.finish_reason == "stop"
    assert len(outcome.logprobs) == done.completion_tokens == 3  # " the", " capital", " of"
    of = engine.vocab.tokenize(" of", chat=False)[-1]
    assert outcome.deltas[-1].logprobs[-1].id == of
    for delta in outcome.deltas:
        assert delta.logprobs  # no text goes out without the tokens it completes
    # A stop string at the very start: no text at all, and a last delta, empty, with the
    # logprob of the token that stopped it.
    outcome = engine.run(engine.request(CAPITAL, max_tokens=16, stop=(" the",), logprobs=0))
    assert outcome.finished.text == ""
    assert [(d.text, len(d.logprobs)) for d in outcome.deltas] == [("", 1)]
    assert outcome.finished.completion_tokens == 1


# -- prompts shared by siblings (n choices) --------------------------------------------------


@pytest.mark.parametrize(("share", "slots"), [(0, 1), (64, 2), (0, 3)])
def test_siblings_compute_their_short_prompt_once_and_answer_as_one_alone(
    default_model: ModelRecord, share: int, slots: int
) -> None:
    # share 0: ordinary prefix sharing is off; 64: the prompt is shorter than that. Either
    # way the siblings' prompt is computed once. All are queued before the engine starts.
    served = Engine(default_model, slots=slots, share=share)
    served.engine.keep_first_logits = True
    try:
        siblings = [
            served.submit(served.request(CAPITAL, logprobs=1, share_prompt=True)) for _ in range(3)
        ]
        served.start()
        served.wait(*siblings)
        alone = served.run(served.request(CAPITAL, logprobs=1))
        reused = served.engine.prefix_tokens_reused
    finally:
        served.close()
    prompt_len = alone.finished.prompt_tokens
    assert 1 < prompt_len < share or share == 0
    # The first computes it (and fills the store); the others copy all but its last token.
    assert [s.finished.cached_tokens for s in siblings] == [0, prompt_len - 1, prompt_len - 1]
    assert reused == 2 * (prompt_len - 1)
    assert alone.finished.cached_tokens == 0
    # The copied prompt is the computed one: the first token's logits agree within the
    # rounding of a different batch layout (test_batching measures it). Not greedy text: a
    # near-tie may flip with that rounding, and the rest of the answer follows.
    (first_logits,) = served.engine.first_logits.values()
    *of_siblings, of_alone = first_logits
    assert len(of_siblings) == 3
    for logits in of_siblings:
        drift = np.abs(logits - of_alone)
        assert float(drift.max()) < MAX_DRIFT
        assert float(drift.mean()) < MEAN_DRIFT
    for sibling in siblings:
        assert sibling.finished.completion_tokens > 0


def test_a_sibling_arriving_after_the_first_started_copies_its_prompt(
    default_model: ModelRecord,
) -> None:
    served = Engine(default_model, slots=2, share=0)
    served.engine.keep_first_logits = True
    try:
        served.start()
        first = served.submit(served.request(CAPITAL, max_tokens=24, share_prompt=True))
        # The first sibling has prefilled (it streams) before the second arrives.
        assert first.streaming.wait(60)
        second = served.run(served.request(CAPITAL, max_tokens=24, share_prompt=True))
        served.wait(first)
    finally:
        served.close()
    assert second.finished.cached_tokens == second.finished.prompt_tokens - 1
    # The same first-token distribution (within test_batching's layout rounding), not the
    # same greedy text: the second decodes next to the first, a different batch.
    ((of_first, of_second),) = served.engine.first_logits.values()
    drift = np.abs(of_second - of_first)
    assert float(drift.max()) < MAX_DRIFT
    assert float(drift.mean()) < MEAN_DRIFT
    assert first.finished.completion_tokens > 0
    assert second.finished.completion_tokens > 0
