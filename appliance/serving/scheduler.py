"""Continuous batching: which tokens of which sequences go into each decode step.

Pure scheduling, as llama-server does it: no llama.cpp, no clock, no I/O. Every running
sequence holds a slot (its llama.cpp ``seq_id`` and KV cells); each step, decode tokens of
running sequences go first so their streams never stall behind a long prompt, and prompt
chunks fill the rest of the ``n_batch`` budget, oldest first. New sequences take free slots
between steps. The engine that owns a :class:`SchedulerState` drives it like this::

    state = SchedulerState(config)
    while True:
        # between steps: submit() new requests, cancel() abandoned ones (clear ended.slot)
        plan = plan_step(state)
        # one llama_batch: for each entry, tokens[start:start + count] of that sequence
        # (prompt, then its sampled tokens) at those positions, seq_id = entry.slot, logits
        # on the last token where entry.wants_logits; llama_decode; sample those entries
        state, ended = apply_step(state, plan, StepOutcome(finished={...stop/cancelled...}))
        # clear the KV cache of every ended.slot before its slot is planned again, or keep
        # it and say so with retain(); at admission, clear a slot from Admission.reused on

Admission is FIFO within a priority (higher first; all equal by default). Two rules serve
the service classes: ``reserved_slots`` are taken only by sequences of at least
``reserved_priority`` (S2), and with ``preemption`` a sequence above the preemptible
priority (S0) that finds no slot takes the slot of the youngest running S0 sequence, which
goes back to the queue with what it generated so far folded into its prompt: it resumes
later by prefilling that again, its sampler state intact in the engine.

A slot keeps the KV of the sequence that last ran in it, when the engine says so
(:func:`retain`): a chat client sends each turn with every earlier turn and answer repeated,
so the next request's prompt starts with the tokens the slot already holds. As llama-server
does (``cache_prompt``), a waiting sequence takes the free slot whose kept tokens share the
longest prefix with its prompt, and its prefill starts after that common part
(:attr:`Admission.reused`); with no match it takes a slot that keeps nothing, else the one
kept longest ago, so a conversation that may come back is overwritten last.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from appliance.serving.prefix import common_prefix

if TYPE_CHECKING:
    from collections.abc import Container, Iterable, Mapping

FinishReason = Literal["stop", "length", "cancelled"]
EntryKind = Literal["prefill", "decode"]


class RejectReason(StrEnum):
    """Why :func:`submit` refused a sequence; values are the gateway's error codes."""

    context_length_exceeded = "context_length_exceeded"


class PlanMismatchError(ValueError):
    """The plan was not made from this state: applied twice, or a sequence it names was
    cancelled between :func:`plan_step` and :func:`apply_step`. An engine bug, never input."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes of one model replica's batch. Raises ValueError naming every bad field.

    The llama.cpp context to match has ``n_seq_max = n_slots`` and ``n_ctx = n_slots *
    n_ctx_per_slot`` (its KV cache split per sequence), and this ``n_batch``.
    """

    n_slots: int  # sequences decoding together (llama.cpp n_seq_max)
    n_batch: int  # tokens per llama_decode call
    n_ctx_per_slot: int  # KV cells of one slot: prompt + max_new_tokens must fit
    max_prefill_chunk: int | None = None  # prompt tokens per sequence per step; None: n_batch
    reserved_slots: int = 0  # slots only sequences of reserved_priority or more may take
    reserved_priority: int = 2
    preemption: bool = False  # sequences of preemptible_priority yield to higher ones
    preemptible_priority: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.reserved_slots < max(self.n_slots, 1):
            problems.append(
                f"reserved_slots is {self.reserved_slots}, must be in [0, n_slots) "
                f"(n_slots is {self.n_slots}; other classes need a slot)"
            )
        if self.preemptible_priority >= self.reserved_priority:
            problems.append("preemptible_priority must be below reserved_priority")
        if self.n_slots < 1:
            problems.append(f"n_slots is {self.n_slots}, must be at least 1")
        # Every running sequence may decode in the same step: one token each must fit.
        if self.n_batch < self.n_slots:
            problems.append(f"n_batch is {self.n_batch}, must be at least n_slots ({self.n_slots})")
        if self.n_ctx_per_slot < 2:
            problems.append(f"n_ctx_per_slot is {self.n_ctx_per_slot}, must be at least 2")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            problems.append(
                f"max_prefill_chunk is {self.max_prefill_chunk}, must be None or at least 1"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def prefill_chunk(self) -> int:
        return self.n_batch if self.max_prefill_chunk is None else self.max_prefill_chunk


@dataclass(frozen=True)
class SequenceState:
    """One request's progress. Its token stream is the prompt, then the tokens sampled."""

    seq_id: int  # given by submit() in arrival order, so it is also the FIFO ticket
    prompt_len: int
    max_new_tokens: int
    priority: int = 0  # higher is admitted and prefilled first
    slot: int | None = None  # None while waiting
    prefilled: int = 0  # prompt tokens already in the slot's KV cache
    # Prompt tokens whose KV the engine copies into the slot at admission (a shared prefix
    # computed once for several sequences); prefill starts after them.
    cached: int = 0
    # Tokens it generated before a preemption, now the end of its prompt.
    carried: int = 0
    generated: int = 0  # tokens sampled; the last one is not in the KV cache yet
    # The prompt's token ids, to match against what free slots kept (:func:`retain`); may
    # be empty, then it never reuses a slot. A preempted sequence keeps its first prompt
    # here: still a prefix of what it prefills again.
    tokens: tuple[int, ...] = field(default=(), repr=False)

    @property
    def prefilling(self) -> bool:
        return self.slot is not None and self.prefilled < self.prompt_len

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.prefilled == self.prompt_len

    @property
    def next_position(self) -> int:
        """Position of the next token to feed: the next prompt token, or the last sampled."""
        return self.prefilled if self.prefilled < self.prompt_len else self.next_decode_position

    @property
    def next_decode_position(self) -> int:
        return self.prompt_len + self.generated - 1

    @property
    def queue_key(self) -> tuple[int, int]:
        return (-self.priority, self.seq_id)


@dataclass(frozen=True)
class Queued:
    seq_id: int


@dataclass(frozen=True)
class Rejected:
    reason: RejectReason
    message: str


@dataclass(frozen=True)
class Admission:
    """A waiting sequence takes a free slot this step (its KV cells are clear, or hold what
    :func:`retain` says).

    The engine copies the KV of the first ``cached`` prompt tokens into the slot before it
    decodes the step; the plan's prefill for this sequence starts after them.

    ``reused``: the slot kept the KV of this many of the prompt's first tokens from the
    sequence before (:func:`retain`); the engine removes the slot's cells from there on and
    prefill starts there. At most one of ``cached`` and ``reused`` is set (the larger wins);
    with neither, the engine clears the slot's cells, kept ones included.
    """

    seq_id: int
    slot: int
    cached: int = 0
    reused: int = 0


@dataclass(frozen=True)
class Preemption:
    """A running sequence yields its slot this step; the engine clears the slot's KV before
    any admission uses it. The sequence waits again, its sampled tokens now prompt."""

    seq_id: int
    slot: int


@dataclass(frozen=True)
class BatchEntry:
    """Tokens ``start .. start + count - 1`` of one sequence's stream, in one batch."""

    seq_id: int
    slot: int
    kind: EntryKind
    start: int
    count: int
    wants_logits: bool  # sample a token from the last position after the step

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.count)


@dataclass(frozen=True)
class StepPlan:
    preempted: tuple[Preemption, ...] = ()
    admitted: tuple[Admission, ...] = ()
    entries: tuple[BatchEntry, ...] = ()  # decode entries first, then prefill chunks

    @property
    def n_tokens(self) -> int:
        return sum(entry.count for entry in self.entries)


@dataclass(frozen=True)
class StepOutcome:
    """What the engine saw in the step; ``length`` is not reported, the scheduler counts."""

    # "stop": sampled an end-of-generation token or matched a stop string;
    # "cancelled": its client went away during the step.
    finished: Mapping[int, Literal["stop", "cancelled"]] = field(default_factory=dict)


@dataclass(frozen=True)
class Ended:
    seq_id: int
    slot: int | None  # the KV sequence to clear; None if it never held a slot
    reason: FinishReason
    generated: int  # tokens sampled, an end-of-generation one included


@dataclass(frozen=True)
class Kept:
    """What a free slot's KV cells still hold: the first ``len(tokens)`` positions of the
    sequence that ran in it, which were these tokens."""

    tokens: tuple[int, ...] = field(repr=False)
    stamp: int  # when it was kept; the smallest was kept longest ago


@dataclass(frozen=True)
class SchedulerState:
    config: SchedulerConfig
    waiting: tuple[SequenceState, ...] = ()  # in admission order (SequenceState.queue_key)
    running: tuple[SequenceState, ...] = ()  # hold a slot; in queue_key order
    next_id: int = 0
    # Free slots whose cells were kept by retain(), by slot: until a sequence takes it.
    kept: Mapping[int, Kept] = field(default_factory=dict)
    kept_count: int = 0  # retain() calls so far: the next Kept.stamp

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def free_slots(self) -> list[int]:
        used = {seq.slot for seq in self.running}
        return [slot for slot in range(self.config.n_slots) if slot not in used]

    def get(self, seq_id: int) -> SequenceState | None:
        return next((s for s in (*self.waiting, *self.running) if s.seq_id == seq_id), None)


def submit(
    state: SchedulerState,
    prompt_len: int,
    max_new_tokens: int,
    priority: int = 0,
    cached: int = 0,
    *,
    tokens: tuple[int, ...] = (),
) -> tuple[SchedulerState, Queued | Rejected]:
    """Queue a sequence, or reject it when it could never fit in one slot. ``cached``: how
    many of its prompt tokens the engine will copy from a shared prefix at admission; at
    least the last prompt token is always decoded, to sample the first new token from.
    ``tokens``: the prompt itself (``prompt_len`` of them), or empty; with them it may take
    a slot that kept a prefix of it (:func:`retain`).

    The gateway checks lengths before this; ValueError here means a caller bug.
    """
    if prompt_len < 1 or max_new_tokens < 1:
        raise ValueError("a sequence needs at least one prompt token and one new token")
    if not 0 <= cached < prompt_len:
        raise ValueError(f"cached is {cached}, must be in [0, prompt_len)")
    if tokens and len(tokens) != prompt_len:
        raise ValueError(f"{len(tokens)} tokens given for a prompt of {prompt_len}")
    n_ctx = state.config.n_ctx_per_slot
    if prompt_len + max_new_tokens > n_ctx:
        message = (
            f"the prompt has {prompt_len} tokens and asks for {max_new_tokens} more; "
            f"a slot holds {n_ctx}"
        )
        return state, Rejected(RejectReason.context_length_exceeded, message)
    seq = SequenceState(
        state.next_id, prompt_len, max_new_tokens, priority, cached=cached, tokens=tokens
    )
    waiting = _ordered((*state.waiting, seq))
    return replace(state, waiting=waiting, next_id=state.next_id + 1), Queued(seq.seq_id)


def retain(state: SchedulerState, slot: int, tokens: tuple[int, ...]) -> SchedulerState:
    """The engine kept the KV cells of a sequence that ended in ``slot`` (it is free now):
    ``tokens`` are the tokens at positions ``0 .. len(tokens) - 1`` there. A later sequence
    whose prompt starts with some of them may take the slot and skip computing those."""
    if slot in state.kept or slot not in state.free_slots():
        raise ValueError(f"slot {slot} is not free, or keeps cells already")
    if not 0 < len(tokens) <= state.config.n_ctx_per_slot:
        raise ValueError(f"{len(tokens)} tokens cannot be what a slot holds")
    kept = {**state.kept, slot: Kept(tokens, state.kept_count)}
    return replace(state, kept=kept, kept_count=state.kept_count + 1)


def kept_prefix(state: SchedulerState, tokens: tuple[int, ...]) -> int:
    """The most of a prompt's first tokens that a free slot holds (less its last token,
    which is always computed): what the prompt would reuse if admitted now."""
    if not tokens:
        return 0
    longest = max((common_prefix(tokens, k.tokens) for k in state.kept.values()), default=0)
    return min(longest, len(tokens) - 1)


def reusable(seq: SequenceState, kept: Kept | None) -> int:
    """How many of the prompt's first tokens a slot that keeps ``kept`` already holds: the
    common prefix, less the prompt's last token, which is always decoded (its logits give
    the first new token). 0 when that is no better than the shared prefix it copies."""
    if kept is None or not seq.tokens:
        return 0
    n = min(common_prefix(seq.tokens, kept.tokens), seq.prompt_len - 1)
    return n if n > seq.cached else 0


def cancel(state: SchedulerState, seq_id: int) -> tuple[SchedulerState, Ended | None]:
    """Drop a waiting or running sequence. None if it is unknown (already ended: a race the
    caller need not avoid). Call between steps; during one, report it in the outcome."""
    seq = state.get(seq_id)
    if seq is None:
        return state, None
    state = replace(
        state,
        waiting=tuple(s for s in state.waiting if s.seq_id != seq_id),
        running=tuple(s for s in state.running if s.seq_id != seq_id),
    )
    return state, Ended(seq_id, seq.slot, "cancelled", seq.carried + seq.generated)


def plan_step(state: SchedulerState, no_reuse: Container[int] = ()) -> StepPlan:
    """Plan one decode step: fill free slots from the queue, decode every sequence past its
    prompt, then spend the rest of ``n_batch`` on prompt chunks in queue order. Sequences in
    ``no_reuse`` must prefill their prompt from the start (the engine writes it somewhere
    else too as it goes): they reuse no slot's kept cells.

    Greedy in queue order so the oldest prompt reaches its first token soonest; no sequence
    starves because the oldest prefilling one always gets at least one token (n_batch >=
    n_slots and it is not decoding), and younger ones never get ahead of it.
    """
    config = state.config
    preempted, admitted = _admissions(state, no_reuse)
    by_id = {a.seq_id: a for a in admitted}
    started = [_admit(seq, by_id[seq.seq_id]) for seq in state.waiting if seq.seq_id in by_id]
    gone = {p.seq_id for p in preempted}
    running = [seq for seq in state.running if seq.seq_id not in gone]
    decodes = [
        BatchEntry(seq.seq_id, _slot(seq), "decode", seq.next_decode_position, 1, wants_logits=True)
        for seq in running
        if seq.decoding
    ]
    budget = config.n_batch - len(decodes)
    prefills: list[BatchEntry] = []
    for seq in _ordered((*(s for s in running if s.prefilling), *started)):
        if budget == 0:
            break
        count = min(seq.prompt_len - seq.prefilled, config.prefill_chunk, budget)
        done = seq.prefilled + count == seq.prompt_len
        prefills.append(BatchEntry(seq.seq_id, _slot(seq), "prefill", seq.prefilled, count, done))
        budget -= count
    return StepPlan(preempted, admitted, (*decodes, *prefills))


def _admissions(
    state: SchedulerState, no_reuse: Container[int]
) -> tuple[tuple[Preemption, ...], tuple[Admission, ...]]:
    """Waiting sequences take free slots in queue order, within the reservation; one that
    finds none may take a preemptible sequence's slot. The first that can do neither stops
    the rest (the queue is in priority order, so nobody behind it could either)."""
    config = state.config
    free = state.free_slots()
    low_cap = config.n_slots - config.reserved_slots
    low = sum(1 for s in state.running if s.priority < config.reserved_priority)
    victims = (
        sorted(
            (s for s in state.running if s.priority <= config.preemptible_priority),
            key=lambda s: -s.seq_id,  # the youngest first: it has the least to redo
        )
        if config.preemption
        else []
    )
    preempted: list[Preemption] = []
    admitted: list[Admission] = []
    for seq in state.waiting:
        high = seq.priority >= config.reserved_priority
        reused = 0
        if free and (high or low < low_cap):
            slot, reused = _choose_slot(state, seq, free, reuse=seq.seq_id not in no_reuse)
            free.remove(slot)
        elif victims and seq.priority > config.preemptible_priority:
            victim = victims.pop(0)
            slot = _slot(victim)
            preempted.append(Preemption(victim.seq_id, slot))
            low -= 1  # the victim's priority is below reserved_priority
        else:
            break
        if reused:
            admitted.append(Admission(seq.seq_id, slot, reused=reused))
        else:
            admitted.append(Admission(seq.seq_id, slot, seq.cached))
        if not high:
            low += 1
    return tuple(preempted), tuple(admitted)


def _choose_slot(
    state: SchedulerState, seq: SequenceState, free: list[int], *, reuse: bool
) -> tuple[int, int]:
    """The free slot that already holds the most of the prompt, and how much; with none, a
    slot that keeps nothing, else the one kept longest ago (a conversation that was active
    more recently is likelier to come back)."""
    if reuse:
        best, slot = max((reusable(seq, state.kept.get(s)), -s) for s in free)
        if best > 0:
            return -slot, best
    empty = [s for s in free if s not in state.kept]
    if empty:
        return empty[0], 0
    return min(free, key=lambda s: state.kept[s].stamp), 0


def apply_step(
    state: SchedulerState, plan: StepPlan, outcome: StepOutcome | None = None
) -> tuple[SchedulerState, tuple[Ended, ...]]:
    """Advance past a decoded step: record the tokens fed and sampled, and end sequences that
    stopped, were cancelled, or reached max_new_tokens. Each ended slot's KV must be cleared,
    or kept and reported with :func:`retain`.

    Raises PlanMismatchError if ``plan`` was not made from ``state``.
    """
    finished = outcome.finished if outcome is not None else {}
    waiting, running, sampled = _advance(state, plan)
    ended: list[Ended] = []
    for seq_id, reported in finished.items():
        # A stop can only follow a token sampled in this step; a cancel may name any sequence,
        # even one that already ended (the client and the engine race), like cancel().
        if reported == "stop" and seq_id not in sampled:
            raise ValueError(f"sequence {seq_id} sampled no token in this step, so cannot stop")
        if reported == "cancelled" and seq_id in waiting:
            gone = waiting.pop(seq_id)
            ended.append(Ended(seq_id, None, "cancelled", gone.carried + gone.generated))
    kept: list[SequenceState] = []
    for seq in running.values():
        reason: FinishReason | None = finished.get(seq.seq_id)
        if reason is None and seq.generated == seq.max_new_tokens:
            reason = "length"
        if reason is None:
            kept.append(seq)
        else:
            ended.append(Ended(seq.seq_id, seq.slot, reason, seq.carried + seq.generated))
    # A slot taken this step no longer keeps what it held: its new sequence overwrites it.
    taken = {a.slot for a in plan.admitted}
    new_state = replace(
        state,
        waiting=_ordered(waiting.values()),
        running=_ordered(kept),
        kept={slot: k for slot, k in state.kept.items() if slot not in taken},
    )
    return new_state, tuple(sorted(ended, key=lambda e: e.seq_id))


def _advance(
    state: SchedulerState, plan: StepPlan
) -> tuple[dict[int, SequenceState], dict[int, SequenceState], set[int]]:
    """Waiting and running sequences by id once the plan ran, and those that sampled."""
    waiting = {seq.seq_id: seq for seq in state.waiting}
    running = {seq.seq_id: seq for seq in state.running}
    for preemption in plan.preempted:
        seq = running.pop(preemption.seq_id, None)
        if seq is None or seq.slot != preemption.slot:
            raise PlanMismatchError(f"sequence {preemption.seq_id} is not running there")
        waiting[seq.seq_id] = _requeue(seq)
    used = {seq.slot for seq in running.values()}
    for admission in plan.admitted:
        seq = waiting.pop(admission.seq_id, None)
        if seq is None or admission.slot in used:
            raise PlanMismatchError(f"sequence {admission.seq_id} cannot take its planned slot")
        used.add(admission.slot)
        running[seq.seq_id] = _admit(seq, admission)
    sampled: set[int] = set()
    for entry in plan.entries:
        seq = running.get(entry.seq_id)
        if seq is None or (seq.slot, seq.next_position) != (entry.slot, entry.start):
            raise PlanMismatchError(f"sequence {entry.seq_id} is not where the plan expects")
        if entry.kind == "prefill":
            seq = replace(seq, prefilled=seq.prefilled + entry.count)
        if entry.wants_logits:
            seq = replace(seq, generated=seq.generated + 1)
            sampled.add(seq.seq_id)
        running[seq.seq_id] = seq
    return waiting, running, sampled


def _requeue(seq: SequenceState) -> SequenceState:
    """A preempted sequence: every token it has (prompt and sampled) is its prompt now."""
    return replace(
        seq,
        slot=None,
        prompt_len=seq.prompt_len + seq.generated,
        max_new_tokens=seq.max_new_tokens - seq.generated,
        prefilled=0,
        generated=0,
        cached=0,
        carried=seq.carried + seq.generated,
    )


def _admit(seq: SequenceState, admission: Admission) -> SequenceState:
    return replace(seq, slot=admission.slot, prefilled=max(admission.cached, admission.reused))


def _ordered(seqs: Iterable[SequenceState]) -> tuple[SequenceState, ...]:
    return tuple(sorted(seqs, key=lambda seq: seq.queue_key))


def _slot(seq: SequenceState) -> int:
    # Only called on sequences that hold a slot; the assert narrows the type for mypy.
    assert seq.slot is not None  # noqa: S101
    return seq.slot
