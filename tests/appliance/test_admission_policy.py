"""The admission predictor and the token buckets, pure: examples, then properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.quotas.buckets import TokenBucket
from appliance.serving.predictor import (
    Capacity,
    InFlight,
    Objectives,
    Rates,
    Reason,
    StepCost,
    at_occupancy,
    decide,
    fits_idle,
    idle_first_token_s,
    largest_prompt,
    predict,
    slowdown,
)
from tests.budget import tries

RATES = Rates(prefill_tok_s=1000.0, token_s=0.1, expected_tokens=20.0)
S1 = Objectives(admit_s=1.0, first_token_s=2.0, complete_s=30.0)


def running(priority: int = 1, produced: int = 0, max_tokens: int = 100) -> InFlight:
    return InFlight(
        priority, prompt_tokens=10, max_tokens=max_tokens, produced=produced, running=True
    )


def queued(priority: int = 1, arrival: int = 0) -> InFlight:
    return InFlight(priority, prompt_tokens=10, max_tokens=100, arrival=arrival)


def new(priority: int = 1, prompt: int = 100) -> InFlight:
    return InFlight(priority, prompt_tokens=prompt, max_tokens=50, arrival=1_000)


def test_an_idle_model_admits_at_once_and_the_first_token_follows_the_prefill() -> None:
    p = predict(new(prompt=500), [], Capacity(replicas=1, slots=2), RATES)
    assert p.admit_s == 0
    assert p.first_token_s == 0.5 + 0.1


def test_a_full_model_predicts_the_first_slot_to_free_and_refuses_past_the_objective() -> None:
    capacity = Capacity(replicas=1, slots=2)
    # Two running sequences expected to make 20 tokens: 15 and 10 left, 1.5 s and 1.0 s.
    flights = [running(produced=5), running(produced=10)]
    assert predict(new(), flights, capacity, RATES).admit_s == 1.0
    # A queue ahead takes the slots as they free, 2.01 s each (prefill and 20 tokens): at
    # 1.0 s and 1.5 s; the next slot frees at 3.01 s.
    ahead = [queued(arrival=1), queued(arrival=2)]
    p = predict(new(), flights + ahead, capacity, RATES)
    assert math.isclose(p.admit_s, 3.01)
    decision = decide(new(), flights + ahead, capacity, RATES, S1)
    assert not decision.admitted
    assert decision.reason is Reason.admit
    assert decision.retry_after_s == 3.0  # then it would wait about the 1 s it may
    assert "3.0 s" in decision.detail
    # A sequence past the expected length still has a few tokens to go, not none.
    assert predict(
        new(), [running(produced=19), running(produced=30)], capacity, RATES
    ).admit_s == (0.8)


def test_s0_work_yields_to_s1_and_reserved_slots_wait_for_s2() -> None:
    s0_everywhere = [running(priority=0), running(priority=0)]
    capacity = Capacity(replicas=1, slots=2)
    assert predict(new(priority=1), s0_everywhere, capacity, RATES).admit_s == 0
    assert predict(new(priority=0), s0_everywhere, capacity, RATES).admit_s > 0
    no_preemption = Capacity(replicas=1, slots=2, preemption=False)
    assert predict(new(priority=1), s0_everywhere, no_preemption, RATES).admit_s > 0
    reserved = Capacity(replicas=1, slots=2, reserved=1)
    one_s1 = [running(priority=1)]
    assert predict(new(priority=2), one_s1, reserved, RATES).admit_s == 0
    assert predict(new(priority=1), one_s1, reserved, RATES).admit_s > 0
    all_reserved = Capacity(replicas=1, slots=1, reserved=1)
    refused = decide(new(priority=1), [], all_reserved, RATES, S1)
    assert not refused.admitted
    assert refused.retry_after_s == 60.0


def test_rates_learn_from_finished_requests() -> None:
    rates = Rates(prefill_tok_s=100.0, token_s=0.1, expected_tokens=10.0)
    learned = rates.observe(prompt_tokens=200, prefill_s=0.5, completion_tokens=11, decode_s=0.5)
    assert 100.0 < learned.prefill_tok_s < 400.0
    assert 0.05 < learned.token_s < 0.1
    assert learned.expected_tokens == 10.2
    assert rates.observe(prompt_tokens=0, prefill_s=None, completion_tokens=1, decode_s=None) == (
        Rates(100.0, 0.1, 8.2)
    )


def test_the_idle_speed_takes_a_faster_measurement_at_once_and_drifts_to_a_slower_one() -> None:
    idle = Rates(prefill_tok_s=1000.0, token_s=0.05)
    assert idle.toward(prefill_tok_s=1500.0, token_s=0.04) == Rates(1500.0, 0.04)
    slower = idle.toward(prefill_tok_s=500.0, token_s=0.1)  # a busy host, for a while
    assert slower.prefill_tok_s == 995.0
    assert math.isclose(slower.token_s, 0.0505)
    assert idle.toward(prefill_tok_s=None, token_s=None) == idle  # nothing measured


def test_the_longest_prompt_a_class_takes_follows_its_allowance_and_the_idle_speed() -> None:
    idle = Rates(prefill_tok_s=1000.0, token_s=0.1)
    # No allowance: the base alone, less one step, at 1 ms a token.
    assert largest_prompt(2.0, 0.0, idle) == 1900
    assert fits_idle(1900, idle, 2.0)
    assert not fits_idle(1901, idle, 2.0)
    assert idle_first_token_s(1901, idle) > 2.0
    # Half a prefill's time allowed per token: twice as many.
    assert largest_prompt(2.0, 0.0005, idle) == 3800
    # The prefill's time or more: any prompt; a base shorter than one step: none.
    assert largest_prompt(2.0, 0.001, idle) is None
    assert largest_prompt(0.05, 0.0, idle) == 0


def test_the_cost_of_a_call_comes_from_the_idle_prefill_and_decode() -> None:
    # 64 tokens in 0.1 s, one token in 0.0163 s: 1.33 ms a token, 15 ms a call.
    cost = StepCost.of(Rates(prefill_tok_s=640.0, token_s=0.0163))
    assert cost.token_s == pytest.approx((0.1 - 0.0163) / 63)
    assert cost.fixed_s == pytest.approx(0.0163 - cost.token_s)
    assert cost.seconds(64) == pytest.approx(0.1)
    # A prefill measured no slower than a decode (noise) still costs something a token.
    odd = StepCost.of(Rates(prefill_tok_s=64 / 0.01, token_s=0.02))
    assert odd.token_s > 0
    assert odd.fixed_s >= 0


def test_a_host_that_slows_the_calls_slows_the_prediction_and_a_full_batch_too() -> None:
    cost = StepCost.of(Rates(prefill_tok_s=640.0, token_s=0.0163))
    # Calls that take twice their idle time: the factor moves toward 2, call by call.
    factor = slowdown(1.0, [(4, 2 * cost.seconds(4))] * 100, cost)
    assert 1.9 < factor <= 2.0
    assert slowdown(factor, [(0, 0.5), (3, 0.0)], cost) == factor  # nothing to learn from
    live = Rates(prefill_tok_s=640.0, token_s=0.0163, expected_tokens=20.0)
    one = at_occupancy(live, cost, 1.0, 1, 512)
    assert one.token_s == pytest.approx(0.0163)
    four = at_occupancy(live, cost, 1.0, 4, 512)
    assert four.token_s > one.token_s  # four tokens a call
    slow = at_occupancy(live, cost, factor, 4, 512)
    assert slow.token_s == pytest.approx(factor * four.token_s)
    assert slow.prefill_tok_s < four.prefill_tok_s <= live.prefill_tok_s
    # What finished requests measured stays the floor: never predicted faster than that.
    measured = Rates(prefill_tok_s=100.0, token_s=0.5, expected_tokens=20.0)
    assert at_occupancy(measured, cost, 1.0, 1, 512) == measured


def test_a_token_bucket_refuses_when_empty_recovers_with_time_and_carries_debt() -> None:
    bucket = TokenBucket.full(capacity=3, period_s=60, now=0)
    assert [bucket.take(1, now=0) for _ in range(3)] == [0, 0, 0]
    assert bucket.take(1, now=0) == 20.0  # one request back every 20 s
    assert bucket.take(1, now=20) == 0
    bucket.charge(10, now=20)  # work already done: the bucket owes 10
    assert bucket.wait_s(1, now=20) == 220.0
    assert bucket.wait_s(5, now=20) == math.inf  # more than it ever holds


# -- properties ------------------------------------------------------------------------------

flights_st = st.lists(
    st.builds(
        InFlight,
        priority=st.integers(0, 2),
        prompt_tokens=st.integers(1, 2000),
        max_tokens=st.integers(1, 500),
        produced=st.integers(0, 500),
        running=st.booleans(),
        arrival=st.integers(0, 100),
    ),
    max_size=12,
)
capacity_st = st.builds(
    Capacity,
    replicas=st.integers(1, 3),
    slots=st.integers(1, 6),
    reserved=st.integers(0, 2),
    preemption=st.booleans(),
)
rates_st = st.builds(
    Rates,
    prefill_tok_s=st.floats(10, 5000),
    token_s=st.floats(0.001, 1),
    expected_tokens=st.floats(1, 500),
)
new_st = st.builds(
    InFlight,
    priority=st.integers(0, 2),
    prompt_tokens=st.integers(1, 2000),
    max_tokens=st.integers(1, 500),
    arrival=st.just(1_000),
)
objectives_st = st.builds(
    Objectives, admit_s=st.floats(0, 30), first_token_s=st.floats(0, 60), complete_s=st.just(600.0)
)
PROPERTIES = settings(max_examples=tries(300), derandomize=True, deadline=None)


@PROPERTIES
@given(new_st, flights_st, capacity_st, rates_st, objectives_st)
def test_refused_exactly_when_an_objective_would_be_missed(
    request: InFlight, flights: list[InFlight], capacity: Capacity, rates: Rates, o: Objectives
) -> None:
    p = predict(request, flights, capacity, rates)
    d = decide(request, flights, capacity, rates, o)
    assert 0 <= p.admit_s <= p.first_token_s
    assert d.admitted == (p.admit_s <= o.admit_s and p.first_token_s <= o.first_token_s)
    if not d.admitted:
        assert d.retry_after_s >= 1
        assert d.detail


@PROPERTIES
@given(new_st, flights_st, capacity_st, rates_st, st.integers(1, 2000))
def test_more_work_queued_ahead_never_predicts_an_earlier_slot(
    request: InFlight, flights: list[InFlight], capacity: Capacity, rates: Rates, prompt: int
) -> None:
    before = predict(request, flights, capacity, rates)
    ahead = InFlight(request.priority, prompt, 100, arrival=0)
    after = predict(request, [*flights, ahead], capacity, rates)
    assert after.admit_s >= before.admit_s


@PROPERTIES
@given(new_st, flights_st, capacity_st, rates_st)
def test_a_higher_class_never_waits_longer(
    request: InFlight, flights: list[InFlight], capacity: Capacity, rates: Rates
) -> None:
    low = InFlight(0, request.prompt_tokens, request.max_tokens, arrival=request.arrival)
    high = InFlight(2, request.prompt_tokens, request.max_tokens, arrival=request.arrival)
    assert (
        predict(high, flights, capacity, rates).admit_s
        <= predict(low, flights, capacity, rates).admit_s
    )
