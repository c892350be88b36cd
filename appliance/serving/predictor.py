"""The admission predictor: a request's wait and first token predicted from the batch slots,
and the decision to refuse it now if its service class's objectives cannot be met.

Pure: no clock, no I/O. The admission control (appliance.inference.admission) keeps, per
model, the measured service rates (:class:`Rates`, smoothed) and what is in flight
(:class:`InFlight`), and asks :func:`decide` before it submits a request. The prediction
replays the batch slots: each running sequence frees its slot after its expected
remaining tokens; the requests queued ahead (higher priority first, then arrival) take
slots as they free; the new request takes the first slot left. Its first token follows
its prefill and one decode step.

Priority rules (the service classes, shared/classes.py): slots reserved for S2 are
not counted for lower classes; running S0 sequences are preemptible, so for S1 and above
their slots count as free now. A request is refused when the predicted admission is later
than its class's SLO.A or its first token later than SLO.B; ``Retry-After`` is when the
prediction says it would fit.

A class's first-token objective is a base plus an allowance per prompt token (the admission
control scales it per request), and a prompt is judged against what an idle replica does
with it (:func:`idle_first_token_s`, from the model's idle speed): one that no wait could
bring within its class (:func:`largest_prompt`) is refused for good, not for now.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

PREEMPTIBLE = 0  # the priority of S0 work (shared.classes.ServiceClass.priority)
RESERVED = 2  # the priority that may use reserved slots (S2)


@dataclass(frozen=True)
class Objectives:
    """One service class's objectives, in seconds: SLO.A, SLO.B and SLO.C."""

    admit_s: float
    first_token_s: float
    complete_s: float


@dataclass(frozen=True)
class Rates:
    """A model's measured service rates, smoothed (exponentially weighted)."""

    prefill_tok_s: float = 400.0  # prompt tokens per second while prefilling
    token_s: float = 0.05  # seconds between one stream's tokens at the current load
    expected_tokens: float = 64.0  # completion tokens a request ends with, on average

    def observe(
        self,
        *,
        prompt_tokens: int,
        prefill_s: float | None,
        completion_tokens: int,
        decode_s: float | None,
        alpha: float = 0.2,
    ) -> Rates:
        """The rates after one finished request: ``prefill_s`` from its admission to its
        first token, ``decode_s`` from its first token to its last."""
        prefill = self.prefill_tok_s
        if prefill_s is not None and prefill_s > 0 and prompt_tokens > 0:
            prefill = _ewma(prefill, prompt_tokens / prefill_s, alpha)
        token = self.token_s
        if decode_s is not None and decode_s > 0 and completion_tokens > 1:
            token = _ewma(token, decode_s / (completion_tokens - 1), alpha)
        expected = _ewma(self.expected_tokens, float(max(completion_tokens, 1)), alpha)
        return Rates(prefill, token, expected)

    def toward(
        self, *, prefill_tok_s: float | None, token_s: float | None, drift: float = 0.01
    ) -> Rates:
        """Idle speed kept current from one request's measured speeds (None: not measured):
        a faster one is taken at once, a slower one moves it by `drift` only (a busy host
        slows requests for a while; a model's own speed changes seldom)."""
        prefill, token = self.prefill_tok_s, self.token_s
        if prefill_tok_s is not None and prefill_tok_s > 0:
            prefill = max(prefill_tok_s, _ewma(prefill, prefill_tok_s, drift))
        if token_s is not None and token_s > 0:
            token = min(token_s, _ewma(token, token_s, drift))
        return Rates(prefill, token, self.expected_tokens)


@dataclass(frozen=True)
class StepCost:
    """A llama_decode call's seconds on an idle host: `fixed_s` a call, and `token_s` for
    each token in its batch. From the idle speed measured at load (a 64-token prefill is
    one call of 64 tokens, a decoded token one call of one)."""

    fixed_s: float
    token_s: float

    @classmethod
    def of(cls, idle: Rates, prefill_tokens: int = 64) -> StepCost:
        prefill_s = prefill_tokens / idle.prefill_tok_s
        # The two calls differ by prefill_tokens - 1 tokens; a measurement too noisy to say
        # (the prefill no slower than a decode) leaves a quarter of the prefill's average.
        per_token = max(
            (prefill_s - idle.token_s) / (prefill_tokens - 1), prefill_s / prefill_tokens / 4
        )
        return cls(max(0.0, idle.token_s - per_token), per_token)

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.token_s * tokens


def slowdown(factor: float, steps: Iterable[tuple[int, float]], cost: StepCost) -> float:
    """How much slower than `cost` the model's calls run now (the host's other work, a
    thermal limit), smoothed over its last calls: each call moves it by a twentieth."""
    for tokens, seconds in steps:
        if tokens > 0 and seconds > 0:
            factor = _ewma(factor, seconds / cost.seconds(tokens), 0.05)
    return factor


def at_occupancy(live: Rates, cost: StepCost, factor: float, running: int, n_batch: int) -> Rates:
    """The rates to predict with while `running` sequences share each call: a stream's
    token is one call of them all, and a prompt's chunk shares its call with their
    tokens; never faster than what finished requests measured (`live`, which also saw the
    calls other prompts' prefills made long)."""
    running = max(1, running)
    call_s = factor * cost.seconds(running)
    chunk = max(1, n_batch - (running - 1))
    per_prompt_token_s = factor * (cost.token_s + cost.seconds(running - 1) / chunk)
    return Rates(
        min(live.prefill_tok_s, 1 / per_prompt_token_s),
        max(live.token_s, call_s),
        live.expected_tokens,
    )


_EPSILON = 1e-9  # of rounding: a prompt that fits exactly, fits


def fits_idle(prompt_tokens: int, idle: Rates, first_token_s: float) -> bool:
    """Whether an idle replica gives the prompt its first token within `first_token_s`."""
    return idle_first_token_s(prompt_tokens, idle) <= first_token_s + _EPSILON


def idle_first_token_s(prompt_tokens: int, idle: Rates) -> float:
    """A prompt's first token on an idle replica: its prefill and one decode step."""
    return prompt_tokens / idle.prefill_tok_s + idle.token_s


def largest_prompt(first_token_s: float, per_token_s: float, idle: Rates) -> int | None:
    """The longest prompt whose first token an idle replica gives within `first_token_s`
    plus `per_token_s` per prompt token; None: any (the allowance covers the prefill)."""
    room = first_token_s - idle.token_s
    prefill = 1 / idle.prefill_tok_s
    if per_token_s >= prefill:
        return None if room >= 0 else 0
    return max(0, math.floor(room / (prefill - per_token_s) + _EPSILON))


def _ewma(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


@dataclass(frozen=True)
class InFlight:
    """A submitted request: running (it holds a slot) or queued."""

    priority: int
    prompt_tokens: int
    max_tokens: int
    produced: int = 0  # tokens streamed so far
    running: bool = False
    arrival: int = 0  # order of arrival, the FIFO ticket within a priority


@dataclass(frozen=True)
class Capacity:
    replicas: int
    slots: int  # per replica
    reserved: int = 0  # per replica, for priority >= RESERVED only
    preemption: bool = True  # S0 sequences yield their slot to higher classes


class Reason(StrEnum):
    admit = "admit"  # SLO.A: it would wait too long for a slot
    first_token = "first_token"  # noqa: S105 - SLO.B: its first token would come too late
    admitted = "admitted"


@dataclass(frozen=True)
class Prediction:
    admit_s: float  # until it holds a slot
    first_token_s: float  # until its first token
    drain_s: float  # until the work queued ahead of it has taken its slots


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: Reason
    prediction: Prediction
    retry_after_s: float = 0.0
    detail: str = field(default="", compare=False)


def expected_remaining(flight: InFlight, rates: Rates) -> float:
    """Tokens a sequence is expected still to produce: what the smoothed average completion
    length leaves, but at least a few (it has not stopped yet) and never more than its
    ``max_tokens`` allows."""
    left = flight.max_tokens - flight.produced
    return float(max(1, min(left, max(rates.expected_tokens - flight.produced, 8.0))))


def service_s(flight: InFlight, rates: Rates) -> float:
    """A queued request's time in a slot: its prefill, then its expected tokens."""
    return flight.prompt_tokens / rates.prefill_tok_s + expected_remaining(flight, rates) * (
        rates.token_s
    )


def predict(new: InFlight, flights: list[InFlight], capacity: Capacity, rates: Rates) -> Prediction:
    """When ``new`` would hold a slot and see its first token, were it queued now."""
    usable = capacity.slots - (capacity.reserved if new.priority < RESERVED else 0)
    slots = max(0, usable) * capacity.replicas
    preempt = capacity.preemption and new.priority > PREEMPTIBLE
    free_at: list[float] = []
    for flight in flights:
        if not flight.running:
            continue
        if preempt and flight.priority == PREEMPTIBLE:
            continue  # it would yield its slot
        free_at.append(expected_remaining(flight, rates) * rates.token_s)
    # Slots nobody holds are free now. More holders than slots (reserved ones in use by
    # S2 work): the holders that free first are the ones this request can use.
    free_at.sort()
    free_at = ([0.0] * (slots - len(free_at)) + free_at)[:slots] if slots else []
    if not free_at:
        # No slot this class may ever use on this model: nothing to wait for.
        return Prediction(math.inf, math.inf, math.inf)
    heapq.heapify(free_at)
    ahead = sorted(
        (f for f in flights if not f.running and _queue_key(f) < _queue_key(new)),
        key=_queue_key,
    )
    drain = 0.0
    for flight in ahead:
        start = heapq.heappop(free_at)
        drain = max(drain, start)
        heapq.heappush(free_at, start + service_s(flight, rates))
    admit = free_at[0]
    first = admit + new.prompt_tokens / rates.prefill_tok_s + rates.token_s
    return Prediction(admit, first, drain)


def _queue_key(flight: InFlight) -> tuple[int, int]:
    return (-flight.priority, flight.arrival)


def decide(
    new: InFlight,
    flights: list[InFlight],
    capacity: Capacity,
    rates: Rates,
    objectives: Objectives,
) -> Decision:
    """Admit ``new`` or refuse it now, with the reason and when to retry."""
    p = predict(new, flights, capacity, rates)
    if p.admit_s > objectives.admit_s:
        return Decision(
            admitted=False,
            reason=Reason.admit,
            prediction=p,
            retry_after_s=_retry_after(p.admit_s - objectives.admit_s, p),
            detail=f"a slot would free in {_s(p.admit_s)}; the class admits within "
            f"{_s(objectives.admit_s)}",
        )
    if p.first_token_s > objectives.first_token_s:
        return Decision(
            admitted=False,
            reason=Reason.first_token,
            prediction=p,
            retry_after_s=_retry_after(p.first_token_s - objectives.first_token_s, p),
            detail=f"the first token would come in {_s(p.first_token_s)}; the class's "
            f"objective is {_s(objectives.first_token_s)}",
        )
    return Decision(admitted=True, reason=Reason.admitted, prediction=p)


def _retry_after(late_s: float, p: Prediction) -> float:
    """Seconds until the queue ahead has drained enough for a retry to fit: how late the
    request would be now, at least one second; unbounded predictions say one minute."""
    if math.isinf(late_s) or math.isinf(p.admit_s):
        return 60.0
    return max(1.0, math.ceil(late_s))


def _s(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds:.1f} s"
