"""Admission control at the door: service-class objectives, per-account quotas, and the
throttle on failed authentication. No aiohttp here; the completion service (and the
gateway's authentication) calls it.

The prediction itself is pure (appliance.serving.predictor); this service keeps what it
needs between requests: each model's smoothed service rates and its idle speed (measured
at load, kept current), each account's buckets, and the metrics of every decision.

A request's objectives are its class's with allowances for its tokens: its first token
within `first_token_s` plus an allowance per prompt token, its last within `complete_s`
plus those and an allowance per completion token; unset, the allowances are the model's
own idle time per token on this node. Three answers at the door: a prompt that even an
idle node could not serve within its class is refused for good (400
`prompt_too_long_for_class`, naming the longest prompt the class takes here); one that
would wait too long behind the work in flight is refused for now (429 `overloaded`,
Retry-After when it would fit); one that would take a free slot at once is admitted
whatever the current speed says (a busy host shows in the speed measured, not in refusals
with every slot free).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from appliance.observability.objectives import ClassObjectives as Targets
from appliance.observability.objectives import ObjectiveBook
from appliance.quotas.buckets import TokenBucket
from appliance.quotas.leases import LeaseBook
from appliance.serving.predictor import (
    Capacity,
    InFlight,
    Objectives,
    Rates,
    StepCost,
    at_occupancy,
    decide,
    fits_idle,
    largest_prompt,
    predict,
)
from shared.classes import ServiceClass
from shared.errors import (
    AccountLimit,
    ErrorCode,
    OutboxFull,
    Overloaded,
    PromptTooLongForClass,
    QuotaExhausted,
    RateLimited,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from appliance.observability.metrics import Metrics
    from appliance.observability.objectives import Ticket
    from appliance.serving.engine import Finished, Run
    from appliance.serving.registry import LoadedModel
    from appliance.settings import ClassObjectives, ClassSettings
    from appliance.state.store import ApiKey, AsyncStore
    from shared import protocol

DAY_S = 86_400.0
MINUTE_S = 60.0
_MAX_CLIENTS = 10_000  # addresses remembered by the authentication throttle
_MAX_CONNECTIONS = 10_000  # connections whose last refusal's Retry-After is remembered
_MAX_KEYS = 10_000  # keys remembered by the refusal hold
# Refusals of one key held at once; beyond, they are answered at once (a client with more
# connections than this costs what it costs, but cannot make the gateway hold sockets
# without bound).
_MAX_HELD = 256
# Refusals for load or a quota, which say Retry-After: those a key that asks again at once
# has held (AdmissionControl.hold_refusal), on every door.
_HELD_REFUSALS = frozenset(
    {
        ErrorCode.overloaded,
        ErrorCode.queue_full,
        ErrorCode.rate_limit_exceeded,
        ErrorCode.insufficient_quota,
    }
)


# A place held at the door this long without its request leaving it stops counting (a
# backstop: every caller leaves its place when its prompt is tokenized or refused).
PLACE_HELD_S = 5.0
# An admitted request waits this long at most for the door to answer the requests that
# keep arriving (a flood), before its prompt is prepared anyway: longer than a burst takes
# to answer (96 requests: 30-40 ms on two busy cores), a tenth of a second of a first token.
AFTER_THE_DOOR_S = 0.1
# ... and until the door has been quiet this long: a burst's requests reach the gateway a
# few tenths of a millisecond apart when its client (or the host) is busy, one per turn
# of the event loop, not all in one.
DOOR_QUIET_S = 0.001
_PLACES = 1 << 61  # places' arrival order: after every submitted request, before a new one


class Place:
    """A request past the door's early check, its prompt not yet tokenized: counted as
    queued by the requests after it until it is left (`with place: ...`)."""

    def __init__(self, places: dict[int, Place], flight: InFlight, until: float) -> None:
        self._places = places
        self.flight = flight
        self.until = until
        places[id(self)] = self

    def leave(self) -> None:
        self._places.pop(id(self), None)

    def __enter__(self) -> Place:
        return self

    def __exit__(self, *_: object) -> None:
        self.leave()


class AdmissionControl:
    def __init__(self, settings: ClassSettings, store: AsyncStore, metrics: Metrics) -> None:
        self._settings = settings
        self._store = store
        self._metrics = metrics
        self._rates: dict[str, Rates] = {}  # model -> its speed now, smoothed
        self._idle: dict[str, Rates] = {}  # model -> its speed with nothing else running
        self._minute: dict[int, TokenBucket] = {}  # account id -> requests per minute
        self._day: dict[int, TokenBucket] = {}  # account id -> tokens per day
        self._auth: OrderedDict[str, TokenBucket] = OrderedDict()  # client address -> failures
        self._refusals: OrderedDict[int, TokenBucket] = OrderedDict()  # key id -> 429s a second
        self._held: dict[int, int] = {}  # key id -> its refusals being held now
        # (key id, connection) -> until when its last refusal's Retry-After runs
        self._refused: OrderedDict[tuple[int, str], float] = OrderedDict()
        self._places: dict[str, dict[int, Place]] = {}  # model -> places held at its door
        self._arrivals = 0  # requests that came to the early check
        self._lane = asyncio.Lock()  # admitted requests, one at a time, after the door
        self._flooded_until = 0.0  # till when the lane lets admitted requests by (a flood)
        self.outbox_full = False  # set by the fleet link: the outbox is at its bound
        # class → the objectives the hub set for it (apply_targets)
        self._hub_targets: dict[protocol.ServiceClassName, protocol.ClassTargets] = {}
        # Budgets across the fleet: leases from the hub (the fleet link renews them).
        self.leases = LeaseBook(
            lambda klass: self.class_settings(ServiceClass(klass)).safe_tokens_per_minute
        )
        # The live objectives, per class and account: each decision below ends a request's
        # ticket (the heartbeat sends the book; /metrics shows it per class).
        self.book = ObjectiveBook(
            {
                k.value: Targets(o.admit_s, o.first_token_s, o.complete_s)
                for k in ServiceClass
                for o in [self.class_settings(k)]
            }
        )

    def class_settings(self, klass: ServiceClass) -> ClassObjectives:
        """A class's settings: the node's own, with the objectives the hub set over them."""
        objectives: ClassObjectives = getattr(self._settings, klass.value.lower())
        given = self._hub_targets.get(klass.value)
        if given is None:
            return objectives
        return objectives.model_copy(update=given.model_dump(exclude_none=True))

    def apply_targets(
        self, targets: Mapping[protocol.ServiceClassName, protocol.ClassTargets]
    ) -> None:
        """The objectives the hub sets (protocol.NodeSettings.objectives), from now on: for
        admission and for what the live objectives count met or missed."""
        self._hub_targets = dict(targets)
        for k in ServiceClass:
            o = self.class_settings(k)
            self.book.objectives[k.value] = Targets(o.admit_s, o.first_token_s, o.complete_s)

    def rates(self, model: str) -> Rates:
        return self._rates.get(model, Rates())

    def idle_rates(self, model: str) -> Rates:
        """`model`'s speed with nothing else running: measured at its load, kept current
        from its requests (until either, Rates' defaults)."""
        return self._idle.get(model, Rates())

    def targets(
        self, klass: ServiceClass, model: str, prompt_tokens: int, completion_tokens: int = 0
    ) -> Targets:
        """One request's objectives: its class's, with the allowances for its tokens."""
        c = self.class_settings(klass)
        per_prompt, per_output = self.allowances(klass, model)
        first = prompt_tokens * per_prompt
        return Targets(
            c.admit_s,
            c.first_token_s + first,
            c.complete_s + first + completion_tokens * per_output,
        )

    def allowances(self, klass: ServiceClass, model: str) -> tuple[float, float]:
        """Seconds a class's objectives allow per prompt token (SLO.B) and per completion
        token (SLO.C) on `model`: the class's settings, else the model's idle speed."""
        c = self.class_settings(klass)
        idle = self.idle_rates(model)
        per_prompt = c.first_token_per_token_s
        per_output = c.complete_per_token_s
        return (
            1 / idle.prefill_tok_s if per_prompt is None else per_prompt,
            idle.token_s if per_output is None else per_output,
        )

    def calibrated(self, model: str, idle: Rates) -> None:
        """A model's idle speed as measured at its load: what the allowances and the
        prediction start from (until then, Rates' defaults)."""
        self._idle[model] = idle
        self._rates.setdefault(model, idle)

    def door(self, model: str) -> dict[str, Any]:
        """What the door holds for `model`: its idle speed (whether measured yet) and each
        class's objectives with their allowances, and the longest prompt each admits (None:
        any); the admin API shows it."""
        idle = self.idle_rates(model)
        classes: dict[str, Any] = {}
        for k in ServiceClass:
            c = self.class_settings(k)
            per_prompt, per_output = self.allowances(k, model)
            classes[k.value] = {
                "admit_s": c.admit_s,
                "first_token_s": c.first_token_s,
                "first_token_per_prompt_token_s": per_prompt,
                "complete_s": c.complete_s,
                "complete_per_token_s": per_output,
                "largest_prompt": largest_prompt(c.first_token_s, per_prompt, idle),
            }
        return {
            "idle_speed": {
                "measured": model in self._idle,
                "prefill_tokens_per_s": round(idle.prefill_tok_s, 1),
                "seconds_per_token": round(idle.token_s, 5),
            },
            "objectives": classes,
        }

    # -- quotas ------------------------------------------------------------------------------

    async def check_quota(
        self, key: ApiKey, klass: ServiceClass, ticket: Ticket | None = None
    ) -> None:
        """Refuse (QuotaExhausted or RateLimited) when the account is over a
        quota of its class; a
        request counts against requests per minute here, its tokens once it is done.
        `ticket`: the request's, ended by a refusal (a request without one is not
        counted in the objectives: speech)."""
        if self.outbox_full:
            if ticket is not None:
                ticket.refuse("outbox")
            raise OutboxFull(
                "the usage ledger waits for the hub (its outbox is full); this appliance "
                "takes new work once the hub has acknowledged some",
                retry_after=60,
            )
        account = key.account
        per_day, per_minute = self.quotas(key, klass)
        now = time.monotonic()
        if per_day:
            day = await self._day_bucket(account.id, per_day, now)
            if (wait := day.wait_s(1, now)) > 0:
                self._refuse_quota(klass, "tokens_per_day", per_day, wait, ticket)
        if per_minute:
            minute = self._minute.get(account.id)
            if minute is None or minute.capacity != per_minute:
                minute = TokenBucket.full(per_minute, MINUTE_S, now)
                self._minute[account.id] = minute
            if (wait := minute.take(1, now)) > 0:
                self._refuse_quota(klass, "requests_per_minute", per_minute, wait, ticket)

    def quotas(self, key: ApiKey, klass: ServiceClass) -> tuple[int, int]:
        """(tokens per day, requests per minute) of the key's account: its own, set on the
        hub, else its class's; 0 is no limit."""
        limits = self.class_settings(klass)
        account = key.account
        per_day = account.tokens_per_day
        per_minute = account.requests_per_minute
        return (
            limits.tokens_per_day if per_day is None else per_day,
            limits.requests_per_minute if per_minute is None else per_minute,
        )

    def _refuse_quota(
        self, klass: ServiceClass, quota: str, limit: int, wait: float, ticket: Ticket | None
    ) -> None:
        self._metrics.quota_refusals.labels(klass.value, quota).inc()
        if ticket is not None:
            ticket.refuse("quota")
        refusal = QuotaExhausted if quota == "tokens_per_day" else RateLimited
        raise refusal(
            f"the account is over its {quota} quota ({limit}, class {klass.value}); "
            f"retry after {math.ceil(wait)} s",
            retry_after=wait,
        )

    async def _day_bucket(self, account_id: int, capacity: int, now: float) -> TokenBucket:
        bucket = self._day.get(account_id)
        if bucket is None or bucket.capacity != capacity:
            # Seeded from the ledger, so a restart does not hand out a fresh day.
            since = (datetime.now(UTC) - timedelta(seconds=DAY_S)).isoformat()
            used = await self._store.run(self._store.sync.tokens_used_since, account_id, since)
            bucket = TokenBucket(capacity, DAY_S, capacity - used, now)
            self._day[account_id] = bucket
        return bucket

    def charge(self, key: ApiKey, klass: ServiceClass, tokens: int) -> None:
        """Charge the tokens a request actually used to its account's daily quota."""
        per_day, _ = self.quotas(key, klass)
        bucket = self._day.get(key.account.id)
        if per_day and bucket is not None:
            bucket.charge(tokens, time.monotonic())

    # -- budgets across the fleet ------------------------------------------------------------

    def take_lease(
        self,
        key: ApiKey,
        klass: ServiceClass,
        request_id: str,
        cost: int,
        ticket: Ticket | None = None,
    ) -> str | None:
        """For an account with a budget on the hub: reserve the request's worst case from
        this node's lease (the lease's id; None on safe capacity, or without a budget).
        Raises QuotaExhausted or RateLimited."""
        if key.account.budget_tokens is None:
            return None
        try:
            return self.leases.take(key.account.name, klass.value, request_id, cost, time.time())
        except AccountLimit:
            self._metrics.quota_refusals.labels(klass.value, "budget").inc()
            if ticket is not None:
                ticket.refuse("quota")
            raise

    def settle_lease(self, lease_id: str | None, request_id: str, tokens: int) -> None:
        self.leases.settle(lease_id, request_id, tokens)

    # -- admission ---------------------------------------------------------------------------

    def admit(
        self,
        deployment: LoadedModel,
        klass: ServiceClass,
        prompt_tokens: int,
        max_tokens: int,
        ticket: Ticket | None = None,
    ) -> Targets:
        """The request's objectives, once admitted. Refuse it for good (400
        ``prompt_too_long_for_class``) when even an idle replica could not give its first
        token in time, or now (429 ``overloaded``) when the prediction says it cannot hold
        a slot within its class's SLO.A or see its first token within SLO.B; a request
        that would take a free slot at once is admitted."""
        if ticket is not None:
            ticket.at_door = True
        model = self._calibrate(deployment)
        targets = self.targets(klass, model, prompt_tokens)
        idle = self.idle_rates(model)
        if not fits_idle(prompt_tokens, idle, targets.first_token_s):
            self._metrics.admission.labels(klass.value, "prompt_too_long").inc()
            if ticket is not None:
                ticket.refuse("first_token")
            raise PromptTooLongForClass(self._too_long(klass, model, prompt_tokens, idle))
        self._decide(deployment, klass, prompt_tokens, max_tokens, targets, ticket)
        self._metrics.admission.labels(klass.value, "admitted").inc()
        if ticket is not None:
            ticket.targets = targets
        return targets

    def refuse_early(
        self,
        deployment: LoadedModel,
        klass: ServiceClass,
        rough_tokens: int,
        max_tokens: int,
        ticket: Ticket | None = None,
    ) -> Place:
        """Refuse now (429 ``overloaded``) what `admit` would refuse whatever its prompt,
        before the prompt is rendered and tokenized (the most of a refusal's cost, when a
        burst meets a full queue): the predicted wait for a slot does not depend on the
        prompt, nor does the first token's lateness shrink with it while the class allows
        no more per prompt token than the model now takes.

        Past this check the request holds a place, counted as queued (its prompt
        `rough_tokens` long, its completion `max_tokens`) by the requests after it at the
        door until its caller leaves it (`with`): a burst cannot all pass the check while
        the first of it is still rendering its prompts."""
        self._arrivals += 1
        model = self._calibrate(deployment)
        targets = self.targets(klass, model, 0)
        per_prompt, _ = self.allowances(klass, model)
        by_prompt = per_prompt <= 1 / self.rates(model).prefill_tok_s
        self._decide(deployment, klass, 0, 1, targets, ticket, first_token=by_prompt)
        order = _PLACES + self._arrivals
        flight = InFlight(klass.priority, rough_tokens, max_tokens, arrival=order)
        places = self._places.setdefault(model, {})
        return Place(places, flight, time.monotonic() + PLACE_HELD_S)

    async def after_the_door(self) -> None:
        """Wait, one admitted request at a time, until the door has answered the requests
        that came to it meanwhile and none came for `DOOR_QUIET_S`, or `AFTER_THE_DOOR_S`
        at most. An admitted request's prompt is then rendered and tokenized (a
        millisecond or more of the loop each) after the refusals of the burst it came
        with, and each admitted request after it looks again. In a flood (one waited its
        bound) those queued behind it wait a turn of the loop each for `AFTER_THE_DOOR_S`,
        then one waits again: the door keeps half the time, the model is not starved."""
        async with self._lane:
            now = time.monotonic()
            if now < self._flooded_until:
                await asyncio.sleep(0)
                return
            deadline = now + AFTER_THE_DOOR_S
            seen = -1
            while seen != self._arrivals:
                if time.monotonic() >= deadline:
                    self._flooded_until = time.monotonic() + AFTER_THE_DOOR_S
                    return
                seen = self._arrivals
                await asyncio.sleep(DOOR_QUIET_S)

    def _calibrate(self, deployment: LoadedModel) -> str:
        model = deployment.record.ref
        if model not in self._idle and deployment.calibration is not None:
            self.calibrated(model, deployment.calibration)
        return model

    def _decide(  # noqa: PLR0917 - one prediction's inputs
        self,
        deployment: LoadedModel,
        klass: ServiceClass,
        prompt_tokens: int,
        max_tokens: int,
        targets: Targets,
        ticket: Ticket | None,
        *,
        first_token: bool = True,
    ) -> None:
        """Raise `Overloaded` when the prediction refuses the request (its first token
        judged only with `first_token`)."""
        flights = [f for r in deployment.replicas if r.ready for f in r.flights()]
        flights += self._held_places(deployment.record.ref)
        new = InFlight(klass.priority, prompt_tokens, max_tokens, arrival=1 << 62)
        capacity = _capacity(deployment)
        first = targets.first_token_s if first_token else math.inf
        objectives = Objectives(targets.admit_s, first, targets.complete_s)
        rates = self._rates_now(deployment, len(flights) + 1, capacity)
        decision = decide(new, flights, capacity, rates, objectives)
        at_once = decision.prediction.admit_s == 0 and decision.prediction.drain_s == 0
        if decision.admitted or at_once:
            return
        reason = decision.reason.value
        self._metrics.admission.labels(klass.value, reason).inc()
        if ticket is not None:
            ticket.refuse("first_token" if reason == "first_token" else "admit")
        raise Overloaded(
            f"class {klass.value} cannot be served within its objectives now: {decision.detail}",
            retry_after=decision.retry_after_s,
        )

    def _held_places(self, model: str) -> list[InFlight]:
        places = self._places.get(model)
        if not places:
            return []
        now = time.monotonic()
        for place in [p for p in places.values() if p.until <= now]:
            place.leave()
        return [p.flight for p in places.values()]

    def _rates_now(self, deployment: LoadedModel, sequences: int, capacity: Capacity) -> Rates:
        """The rates to predict with: what finished requests measured, and, once the model's
        idle speed is known, its calls as they run on this host now, as many sequences
        sharing each as `sequences` make (up to its slots)."""
        rates = self.rates(deployment.record.ref)
        if deployment.calibration is None:
            return rates
        per_replica = -(-sequences // capacity.replicas)
        return at_occupancy(
            rates,
            StepCost.of(deployment.calibration),
            deployment.slowdown,
            min(capacity.slots, per_replica),
            deployment.options.n_batch,
        )

    def doomed(
        self, deployment: LoadedModel, runs: list[Run], waited_s: float, by_s: float
    ) -> bool:
        """Whether a request still queued (`runs`: its choices), `waited_s` after its
        admission, would not hold a slot by `by_s` (its first-token deadline, when it would
        be shed) as the queue and the model's speed are now: shed now, not at the deadline,
        so its client can go elsewhere or come back sooner."""
        flights = [f for r in deployment.replicas if r.ready for f in r.flights()]
        capacity = _capacity(deployment)
        rates = self._rates_now(deployment, len(flights), capacity)
        for run in runs:
            own = run.flight()
            if own is None or own.running:
                return False
            others = list(flights)
            with contextlib.suppress(ValueError):
                others.remove(own)
            if waited_s + predict(own, others, capacity, rates).admit_s <= by_s:
                return False
        return bool(runs)

    def _too_long(self, klass: ServiceClass, model: str, prompt_tokens: int, idle: Rates) -> str:
        c = self.class_settings(klass)
        per_prompt, _ = self.allowances(klass, model)
        most = largest_prompt(c.first_token_s, per_prompt, idle)
        others = [
            k.value
            for k in ServiceClass
            if k != klass
            and fits_idle(prompt_tokens, idle, self.targets(k, model, prompt_tokens).first_token_s)
        ]
        takes = (
            f"an account of class {' or '.join(others)} would be served it"
            if others
            else "no class takes it on this node"
        )
        return (
            f"the prompt has {prompt_tokens} tokens; class {klass.value} takes at most "
            f"{most} on this node, whose model {model} prefills {idle.prefill_tok_s:.0f} "
            f"tokens/s idle (the class's first token within {c.first_token_s:g} s and "
            f"{per_prompt * 1000:g} ms per prompt token); {takes}"
        )

    def shed(
        self, klass: ServiceClass, waited_s: float, objective: float, ticket: Ticket | None = None
    ) -> Overloaded:
        """The error for a queued request that missed its first-token objective (its own:
        the class's with the allowance for its prompt)."""
        self._metrics.sheds.labels(klass.value).inc()
        if ticket is not None:
            ticket.refuse("shed")
        return Overloaded(
            f"class {klass.value}: no first token after {waited_s:.1f} s, past the "
            f"{objective:g} s objective; the request was dropped from the queue",
            retry_after=max(1.0, objective),
        )

    def finished(
        self, model: str, klass: ServiceClass, finished: Finished, ticket: Ticket | None = None
    ) -> None:
        """Learn from a finished request, and measure it against its own objectives (its
        class's with the allowances for its tokens)."""
        m = self._metrics
        objectives = self.targets(klass, model, finished.prompt_tokens, finished.completion_tokens)
        if ticket is not None:
            ticket.targets = objectives
            ticket.serve(
                queue_s=finished.queue_s,
                ttft_s=finished.ttft_s,
                duration_s=finished.duration_s,
                cancelled=finished.finish_reason == "cancelled",
            )
        if finished.ttft_s is not None:
            prefill_s = finished.ttft_s - (finished.queue_s or 0.0)
            decode_s = finished.duration_s - finished.ttft_s
            self._rates[model] = self.rates(model).observe(
                prompt_tokens=finished.prompt_tokens,
                prefill_s=prefill_s,
                completion_tokens=finished.completion_tokens,
                decode_s=decode_s,
            )
            if finished.cached_tokens == 0:  # with a cached prefix: not its prefill speed
                self._idle[model] = self.idle_rates(model).toward(
                    prefill_tok_s=finished.prompt_tokens / prefill_s if prefill_s > 0 else None,
                    token_s=(
                        decode_s / (finished.completion_tokens - 1)
                        if finished.completion_tokens > 1 and decode_s > 0
                        else None
                    ),
                )
            m.class_ttft_seconds.labels(klass.value).observe(finished.ttft_s)
        if finished.finish_reason == "cancelled":
            return
        m.class_completion_seconds.labels(klass.value).observe(finished.duration_s)
        if finished.queue_s is not None and finished.queue_s > objectives.admit_s:
            m.slo_misses.labels(klass.value, "admit").inc()
        if finished.ttft_s is not None and finished.ttft_s > objectives.first_token_s:
            m.slo_misses.labels(klass.value, "first_token").inc()
        if finished.duration_s > objectives.complete_s:
            m.slo_misses.labels(klass.value, "complete").inc()

    # -- clients that do not wait ------------------------------------------------------------

    async def hold_refusal(
        self, key_id: int, code: ErrorCode, connection: str, retry_after_s: float | None
    ) -> bool:
        """Hold a refusal for load or a quota (`_HELD_REFUSALS`) for `classes.refusal_hold_s`
        before it is answered, when the same connection (`connection`: its peer address and
        port) was refused within the Retry-After its last refusal gave, or when the key's
        refusals are past `classes.refusal_burst` and then `classes.refusals_per_second`;
        True if it was held.

        A refusal costs the gateway a parse, a key check and a prediction: well under a
        millisecond, but a client in a loop that asks again the moment it is refused (not
        waiting its Retry-After) sends a thousand a second, and the CPU that takes from the
        model's decode threads (which wait on each other at every step) stalls every
        account's generation. A held refusal costs nothing while it waits, and such a client
        then asks once per hold per connection (or, opening a new connection each time, is
        held past the key's rate). A burst of one key's users (each on its own connection,
        refused for the first time) is refused at once: they cannot have waited a
        Retry-After they have not had yet."""
        settings = self._settings
        if code not in _HELD_REFUSALS or settings.refusal_hold_s <= 0:
            return False
        now = time.monotonic()
        peer = (key_id, connection)
        again = self._refused.pop(peer, 0.0) > now  # asked again within its Retry-After
        wait = max(retry_after_s or 0.0, settings.refusal_hold_s)
        self._refused[peer] = now + wait
        while len(self._refused) > _MAX_CONNECTIONS:
            self._refused.popitem(last=False)
        bucket = self._refusals.get(key_id)
        if bucket is None:
            burst, rate = settings.refusal_burst, settings.refusals_per_second
            bucket = self._refusals[key_id] = TokenBucket.full(burst, burst / rate, now)
            while len(self._refusals) > _MAX_KEYS:
                self._refusals.popitem(last=False)
        self._refusals.move_to_end(key_id)
        held = self._held.get(key_id, 0)
        over_rate = bucket.take(1, now) > 0
        if not (again or over_rate) or held >= _MAX_HELD:
            return False
        self._held[key_id] = held + 1
        self._metrics.refusals_held.inc()
        try:
            await asyncio.sleep(settings.refusal_hold_s)
            # Its Retry-After runs from the answer it is about to get.
            self._refused[peer] = time.monotonic() + wait
        finally:
            if (left := self._held[key_id] - 1) > 0:
                self._held[key_id] = left
            else:
                del self._held[key_id]
        return True

    # -- failed authentication ---------------------------------------------------------------

    def auth_throttled(self, address: str) -> float:
        """Seconds this client address must wait before it may try a key again (0: now)."""
        bucket = self._auth.get(address)
        return 0.0 if bucket is None else bucket.wait_s(1, time.monotonic())

    def auth_failed(self, address: str) -> None:
        now = time.monotonic()
        bucket = self._auth.get(address)
        if bucket is None:
            per_minute = self._settings.auth_failures_per_minute
            bucket = self._auth[address] = TokenBucket.full(per_minute, MINUTE_S, now)
            while len(self._auth) > _MAX_CLIENTS:
                self._auth.popitem(last=False)
        self._auth.move_to_end(address)
        bucket.charge(1, now)


def _capacity(deployment: LoadedModel) -> Capacity:
    return Capacity(
        replicas=max(1, sum(1 for r in deployment.replicas if r.ready)),
        slots=deployment.options.n_slots,
        reserved=deployment.options.reserved_slots,
        preemption=deployment.options.preemption,
    )
