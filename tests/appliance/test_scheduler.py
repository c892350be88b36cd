"""The continuous-batching slot scheduler: examples that document it, then properties over
random interleavings of arrivals, steps, stops and cancellations."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from appliance.serving.scheduler import (
    Admission,
    BatchEntry,
    Ended,
    PlanMismatchError,
    Preemption,
    Queued,
    Rejected,
    RejectReason,
    SchedulerConfig,
    SchedulerState,
    SequenceState,
    StepOutcome,
    StepPlan,
    apply_step,
    cancel,
    plan_step,
    retain,
    submit,
)
from tests.budget import tries

Reported = dict[int, Literal["stop", "cancelled"]]


class Driver:
    """A stand-in engine for the examples: submits, plans and applies, as an engine would."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.state = SchedulerState(config)

    def submit(self, prompt_len: int, max_new_tokens: int, priority: int = 0) -> int:
        self.state, result = submit(self.state, prompt_len, max_new_tokens, priority)
        assert isinstance(result, Queued)
        return result.seq_id

    def step(self, finished: Reported | None = None) -> tuple[StepPlan, tuple[Ended, ...]]:
        """One decode step; ``finished``: what the engine saw happen to which sequence."""
        plan = plan_step(self.state)
        self.state, ended = apply_step(self.state, plan, StepOutcome(finished or {}))
        return plan, ended


# -- examples --------------------------------------------------------------------------------


def test_decode_tokens_go_first_and_a_long_prompt_fills_the_rest_of_the_batch() -> None:
    engine = Driver(SchedulerConfig(n_slots=2, n_batch=8, n_ctx_per_slot=64))
    a = engine.submit(prompt_len=3, max_new_tokens=10)
    plan, _ = engine.step()
    assert plan.admitted == (Admission(a, slot=0),)
    # The whole prompt fits; logits of its last token give the first sampled token.
    assert plan.entries == (BatchEntry(a, 0, "prefill", start=0, count=3, wants_logits=True),)

    b = engine.submit(prompt_len=20, max_new_tokens=5)
    plan, _ = engine.step()
    assert plan.entries == (
        BatchEntry(a, 0, "decode", start=3, count=1, wants_logits=True),
        BatchEntry(b, 1, "prefill", start=0, count=7, wants_logits=False),
    )
    engine.step()
    plan, _ = engine.step()
    # b's prompt ends in this step (7 + 7 + 6 = 20), so it samples its first token too.
    assert plan.entries == (
        BatchEntry(a, 0, "decode", start=5, count=1, wants_logits=True),
        BatchEntry(b, 1, "prefill", start=14, count=6, wants_logits=True),
    )
    assert plan.entries[1].positions == range(14, 20)  # its KV cells in slot 1
    assert engine.state.get(b) == SequenceState(b, 20, 5, slot=1, prefilled=20, generated=1)


def test_a_sequence_ends_at_max_new_tokens_and_its_slot_is_handed_back() -> None:
    engine = Driver(SchedulerConfig(n_slots=1, n_batch=4, n_ctx_per_slot=16))
    a = engine.submit(prompt_len=2, max_new_tokens=3)
    assert engine.step()[1] == ()  # the prompt, and the first token
    assert engine.step()[1] == ()  # the second token
    assert engine.step()[1] == (Ended(a, slot=0, reason="length", generated=3),)
    assert engine.state.idle


def test_sequences_wait_for_a_slot_in_arrival_order() -> None:
    engine = Driver(SchedulerConfig(n_slots=1, n_batch=4, n_ctx_per_slot=16))
    a = engine.submit(prompt_len=2, max_new_tokens=8)
    b = engine.submit(prompt_len=2, max_new_tokens=8)
    c = engine.submit(prompt_len=2, max_new_tokens=8)
    engine.step()
    assert [seq.seq_id for seq in engine.state.waiting] == [b, c]
    # a samples end-of-generation: its slot goes to b in the next step, not to c.
    assert engine.step({a: "stop"})[1] == (Ended(a, 0, "stop", generated=2),)
    assert engine.step()[0].admitted == (Admission(b, slot=0),)


def test_higher_priority_jumps_the_queue_but_preempts_nobody() -> None:
    engine = Driver(SchedulerConfig(n_slots=1, n_batch=4, n_ctx_per_slot=16))
    low = engine.submit(prompt_len=2, max_new_tokens=2)
    waiting = engine.submit(prompt_len=2, max_new_tokens=2)
    engine.step()
    urgent = engine.submit(prompt_len=2, max_new_tokens=2, priority=1)
    assert engine.step()[1] == (Ended(low, 0, "length", 2),)  # low still ran to its end
    assert engine.step()[0].admitted == (Admission(urgent, slot=0),)
    assert [seq.seq_id for seq in engine.state.waiting] == [waiting]


def test_a_chunk_cap_lets_several_prompts_progress_together() -> None:
    engine = Driver(SchedulerConfig(n_slots=3, n_batch=10, n_ctx_per_slot=64, max_prefill_chunk=4))
    a, b, c = (engine.submit(prompt_len=30, max_new_tokens=4) for _ in range(3))
    plan, _ = engine.step()
    assert [(e.seq_id, e.count) for e in plan.entries] == [(a, 4), (b, 4), (c, 2)]


def test_a_cached_prefix_is_copied_in_at_admission_and_only_the_rest_is_prefilled() -> None:
    engine = Driver(SchedulerConfig(n_slots=2, n_batch=16, n_ctx_per_slot=64))
    engine.state, queued = submit(engine.state, prompt_len=40, max_new_tokens=4, cached=36)
    assert isinstance(queued, Queued)
    plan, _ = engine.step()
    assert plan.admitted == (Admission(queued.seq_id, slot=0, cached=36),)
    # Four prompt tokens after the shared 36, the last of which yields the first new token.
    assert plan.entries == (BatchEntry(queued.seq_id, 0, "prefill", 36, 4, wants_logits=True),)
    with pytest.raises(ValueError, match="cached"):
        submit(engine.state, prompt_len=8, max_new_tokens=1, cached=8)


def test_s2_arriving_preempts_the_youngest_running_s0_which_resumes_with_its_tokens() -> None:
    engine = Driver(SchedulerConfig(n_slots=2, n_batch=16, n_ctx_per_slot=64, preemption=True))
    old = engine.submit(prompt_len=4, max_new_tokens=10, priority=0)
    young = engine.submit(prompt_len=4, max_new_tokens=10, priority=0)
    for _ in range(3):  # both prefill, then decode twice: three tokens each
        engine.step()
    urgent = engine.submit(prompt_len=5, max_new_tokens=4, priority=2)
    plan, _ = engine.step()
    assert plan.preempted == (Preemption(young, slot=1),)
    assert plan.admitted == (Admission(urgent, slot=1),)
    assert young not in {e.seq_id for e in plan.entries}
    resumed = engine.state.get(young)
    assert resumed is not None
    # Its three sampled tokens are prompt now; it may still make the seven it had left.
    assert (resumed.slot, resumed.prompt_len, resumed.max_new_tokens) == (None, 7, 7)
    assert resumed.carried == 3
    ends: dict[int, Ended] = {}
    while not engine.state.idle:
        _, ended = engine.step()
        ends.update({e.seq_id: e for e in ended})
    assert ends[young].generated == 10  # three before, seven after
    assert ends[old].generated == 10
    assert ends[urgent].generated == 4


def test_reserved_slots_are_kept_for_s2() -> None:
    config = SchedulerConfig(n_slots=3, n_batch=16, n_ctx_per_slot=64, reserved_slots=1)
    engine = Driver(config)
    standard = [engine.submit(prompt_len=2, max_new_tokens=8, priority=1) for _ in range(3)]
    plan, _ = engine.step()
    # Two slots for everyone; the third stays free for S2 although S1 work waits.
    assert [a.seq_id for a in plan.admitted] == standard[:2]
    urgent = engine.submit(prompt_len=2, max_new_tokens=8, priority=2)
    plan, _ = engine.step()
    assert plan.admitted == (Admission(urgent, slot=2),)
    with pytest.raises(ValueError, match="reserved_slots"):
        SchedulerConfig(n_slots=2, n_batch=4, n_ctx_per_slot=8, reserved_slots=2)


def test_a_sequence_that_cannot_fit_a_slot_is_rejected_with_a_reason() -> None:
    state = SchedulerState(SchedulerConfig(n_slots=1, n_batch=8, n_ctx_per_slot=16))
    after, result = submit(state, prompt_len=10, max_new_tokens=7)
    assert isinstance(result, Rejected)
    assert result.reason is RejectReason.context_length_exceeded
    assert "16" in result.message
    assert after is state
    with pytest.raises(ValueError, match="at least one"):
        submit(state, prompt_len=0, max_new_tokens=1)


def test_cancel_frees_a_running_slot_and_ignores_a_sequence_already_gone() -> None:
    engine = Driver(SchedulerConfig(n_slots=1, n_batch=4, n_ctx_per_slot=16))
    a = engine.submit(prompt_len=2, max_new_tokens=8)
    b = engine.submit(prompt_len=2, max_new_tokens=8)
    engine.step()
    engine.state, ended = cancel(engine.state, a)
    assert ended == Ended(a, slot=0, reason="cancelled", generated=1)  # the engine clears slot 0
    engine.state, ended = cancel(engine.state, b)
    assert ended == Ended(b, slot=None, reason="cancelled", generated=0)  # it held no KV
    assert cancel(engine.state, a) == (engine.state, None)
    assert engine.state.idle


def test_a_plan_is_applied_once_and_only_to_its_own_state() -> None:
    engine = Driver(SchedulerConfig(n_slots=1, n_batch=4, n_ctx_per_slot=16))
    a = engine.submit(prompt_len=2, max_new_tokens=8)
    before = engine.state
    plan, _ = engine.step()
    with pytest.raises(PlanMismatchError):
        apply_step(engine.state, plan)  # applied twice
    plan = plan_step(engine.state)
    cancelled, _ = cancel(engine.state, a)
    with pytest.raises(PlanMismatchError):
        apply_step(cancelled, plan)  # cancelled between plan and apply
    with pytest.raises(ValueError, match="sampled no token"):
        apply_step(before, StepPlan(), StepOutcome({a: "stop"}))


def test_a_config_names_every_problem_at_once() -> None:
    with pytest.raises(ValueError, match="n_batch is 1") as caught:
        SchedulerConfig(n_slots=2, n_batch=1, n_ctx_per_slot=1, max_prefill_chunk=0)
    problems = str(caught.value).split("; ")
    assert [problem.split()[0] for problem in problems] == [
        "n_batch",
        "n_ctx_per_slot",
        "max_prefill_chunk",
    ]


# -- properties ------------------------------------------------------------------------------


def token_strings(min_size: int, max_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, 1), min_size=min_size, max_size=max_size).map(tuple)


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    n_slots = draw(st.integers(1, 4))
    return SchedulerConfig(
        n_slots=n_slots,
        n_batch=n_slots + draw(st.integers(0, 12)),
        n_ctx_per_slot=draw(st.integers(2, 48)),
        max_prefill_chunk=draw(st.none() | st.integers(1, 8)),
    )


def queue_order(seq: SequenceState) -> tuple[int, int]:
    # Spelled out here rather than read from SequenceState.queue_key, so the tests pin it down.
    return (-seq.priority, seq.seq_id)


def work(seq: SequenceState) -> int:
    """Units of progress left: every step that is not idle spends at least one."""
    return seq.prompt_len - max(seq.prefilled, seq.cached) + seq.max_new_tokens - seq.generated


class SchedulerMachine(RuleBasedStateMachine):
    """Equal priorities: strict FIFO, and a step bound for every sequence."""

    priorities: st.SearchStrategy[int] = st.just(0)
    fifo = True  # admissions in arrival order
    bounded = True  # each sequence ends within its deadline

    def __init__(self) -> None:
        super().__init__()
        self.state = SchedulerState(SchedulerConfig(n_slots=1, n_batch=1, n_ctx_per_slot=2))
        self.steps = 0
        # seq_id -> the step count by which it must have ended. The work of everything ahead
        # of it when it arrived, plus its own: while it is present, each step spends at least
        # one unit of that work (it decodes; or the oldest prefilling sequence, never younger
        # than it, gets a token; or every slot is held by older sequences, one of which moves).
        self.deadline: dict[int, int] = {}
        self.admitted: list[int] = []
        self.gone: list[int] = []

    @initialize(config=configs())
    def configure(self, config: SchedulerConfig) -> None:
        self.state = SchedulerState(config)

    @rule(prompt_len=st.integers(1, 40), max_new_tokens=st.integers(1, 16), data=st.data())
    def arrive(self, prompt_len: int, max_new_tokens: int, data: st.DataObject) -> None:
        before = self.state
        # Some arrivals share a prefix whose KV the engine copies in at admission.
        cached = data.draw(st.integers(0, prompt_len - 1))
        priority = data.draw(self.priorities)
        # Some bring their tokens, from an alphabet small enough that kept slots match.
        tokens = data.draw(st.one_of(st.just(()), token_strings(prompt_len, prompt_len)))
        self.state, result = submit(
            before, prompt_len, max_new_tokens, priority, cached, tokens=tokens
        )
        if prompt_len + max_new_tokens > before.config.n_ctx_per_slot:
            assert isinstance(result, Rejected)
            assert self.state is before
            return
        assert result == Queued(before.next_id)
        ahead = sum(work(seq) for seq in (*before.waiting, *before.running))
        own = prompt_len - cached + max_new_tokens
        self.deadline[result.seq_id] = self.steps + ahead + own

    @rule(data=st.data())
    def keep_a_free_slot(self, data: st.DataObject) -> None:
        """The engine kept the cells of a sequence that ended in a free slot."""
        before = self.state
        free = [slot for slot in before.free_slots() if slot not in before.kept]
        if not free:
            return
        slot = data.draw(st.sampled_from(free))
        tokens = data.draw(token_strings(1, before.config.n_ctx_per_slot))
        self.state = retain(before, slot, tokens)
        assert self.state.kept[slot].tokens == tokens

    @rule(data=st.data())
    def cancel_between_steps(self, data: st.DataObject) -> None:
        before = self.state
        present = [seq.seq_id for seq in (*before.waiting, *before.running)]
        seq_id = data.draw(st.sampled_from([*present, *self.gone[-3:], before.next_id]))
        seq = before.get(seq_id)
        self.state, ended = cancel(before, seq_id)
        if seq is None:
            assert ended is None
            assert self.state is before
            return
        assert ended == Ended(seq_id, seq.slot, "cancelled", seq.carried + seq.generated)
        assert self.state.get(seq_id) is None
        self.forget(seq_id)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        plan = plan_step(self.state)
        sampled = sorted(e.seq_id for e in plan.entries if e.wants_logits)
        present = [seq.seq_id for seq in (*self.state.waiting, *self.state.running)]
        stops = data.draw(st.sets(st.sampled_from(sampled), max_size=2)) if sampled else set()
        # A client may also go away just as its sequence ended: the engine need not know.
        cancellable = [*present, *self.gone[-2:]]
        cancels = (
            data.draw(st.sets(st.sampled_from(cancellable), max_size=1)) if cancellable else set()
        )
        finished: Reported = dict.fromkeys(stops, "stop")
        finished.update(dict.fromkeys(cancels, "cancelled"))
        self.check_step(plan, finished)

    def teardown(self) -> None:
        # Drain: everything admitted ends, without stops or cancels to help it along.
        budget = sum(work(seq) for seq in (*self.state.waiting, *self.state.running))
        for _ in range(budget):
            if self.state.idle:
                break
            self.check_step(plan_step(self.state), {})
        assert self.state.idle
        assert not self.deadline

    def check_step(self, plan: StepPlan, finished: Reported) -> None:
        before = self.state
        assert plan == plan_step(before)  # pure: the same state, the same plan
        assert plan.n_tokens <= before.config.n_batch
        holders = check_admissions(before, plan)
        self.admitted += [a.seq_id for a in plan.admitted]
        n_decodes = check_decodes(before, plan, holders)
        check_prefills(before.config, plan, holders, n_decodes)

        self.state, ended = apply_step(before, plan, StepOutcome(finished))
        self.steps += 1
        check_progress(before, plan, holders, self.state, ended)
        for end in check_ends(before, holders, finished, self.state, ended):
            self.forget(end.seq_id)
        if self.bounded:
            for seq in (*self.state.waiting, *self.state.running):
                assert self.steps < self.deadline[seq.seq_id], f"sequence {seq.seq_id} starved"

    def forget(self, seq_id: int) -> None:
        del self.deadline[seq_id]
        self.gone.append(seq_id)

    @invariant()
    def slots_are_held_by_one_sequence_each(self) -> None:
        slots = [seq.slot for seq in self.state.running]
        assert all(slot is not None and 0 <= slot < self.state.config.n_slots for slot in slots)
        assert len(set(slots)) == len(slots)
        assert all(seq.slot is None for seq in self.state.waiting)

    @invariant()
    def only_free_slots_keep_cells(self) -> None:
        assert not set(self.state.kept) & {seq.slot for seq in self.state.running}

    @invariant()
    def queues_stay_in_order(self) -> None:
        for seqs in (self.state.waiting, self.state.running):
            keys = [queue_order(seq) for seq in seqs]
            assert keys == sorted(keys)
        if self.fifo:
            assert self.admitted == sorted(self.admitted)

    @invariant()
    def progress_is_consistent(self) -> None:
        for seq in self.state.running:
            assert 0 <= seq.prefilled <= seq.prompt_len
            assert seq.generated < seq.max_new_tokens
            # The step that feeds a prompt's last token samples the first new one.
            assert (seq.generated >= 1) == seq.decoding


def check_admissions(before: SchedulerState, plan: StepPlan) -> dict[int, SequenceState]:
    """The head of the queue takes the free slots, one slot each. Returns every sequence
    holding a slot in the step, by id."""
    free = before.free_slots()
    head = before.waiting[: min(len(free), len(before.waiting))]
    assert [a.seq_id for a in plan.admitted] == [seq.seq_id for seq in head]
    assert len({a.slot for a in plan.admitted}) == len(plan.admitted)
    assert {a.slot for a in plan.admitted} <= set(free)
    holders = {seq.seq_id: seq for seq in before.running}
    for a, seq in zip(plan.admitted, head, strict=True):
        if a.reused:
            # Kept cells that hold the start of the prompt, more of it than the shared
            # prefix would give; its last token is always computed.
            assert a.cached == 0
            assert seq.cached < a.reused < seq.prompt_len
            assert seq.tokens[: a.reused] == before.kept[a.slot].tokens[: a.reused]
        else:
            assert a.cached == seq.cached
        # What the slot holds once admitted is not computed again: prefill starts after it.
        prefilled = max(a.cached, a.reused)
        holders[a.seq_id] = replace(seq, slot=a.slot, prefilled=prefilled)
    return holders


def check_decodes(before: SchedulerState, plan: StepPlan, holders: dict[int, SequenceState]) -> int:
    """Every decoding sequence feeds its last sampled token, once, ahead of any prompt."""
    decoding = [seq for seq in before.running if seq.decoding]
    decodes = plan.entries[: len(decoding)]
    assert sorted(e.seq_id for e in decodes) == sorted(seq.seq_id for seq in decoding)
    for entry in decodes:
        seq = holders[entry.seq_id]
        # The token goes right after those already in the slot's KV cache.
        position = seq.prompt_len + seq.generated - 1
        assert entry == BatchEntry(seq.seq_id, _held(seq), "decode", position, 1, wants_logits=True)
    return len(decodes)


def check_prefills(
    config: SchedulerConfig, plan: StepPlan, holders: dict[int, SequenceState], n_decodes: int
) -> None:
    """Prompt chunks in queue order: each takes what it may unless the batch is full, once
    one is cut short no later sequence gets anything, and the oldest always progresses."""
    chunks = plan.entries[n_decodes:]
    assert all(e.kind == "prefill" for e in chunks)
    by_seq = {e.seq_id: e for e in chunks}
    assert len(by_seq) == len(chunks)
    prefilling = sorted(
        (seq for seq in holders.values() if seq.prefilled < seq.prompt_len),
        key=queue_order,
    )
    assert set(by_seq) <= {seq.seq_id for seq in prefilling}
    if prefilling:
        assert prefilling[0].seq_id in by_seq
    cut_short = False
    for seq in prefilling:
        chunk = by_seq.get(seq.seq_id)
        got = 0 if chunk is None else chunk.count
        assert not (cut_short and got)
        if chunk is not None:
            assert (chunk.slot, chunk.start) == (seq.slot, seq.prefilled)
            assert chunk.count >= 1
            assert chunk.wants_logits == (chunk.start + chunk.count == seq.prompt_len)
        if got < min(seq.prompt_len - seq.prefilled, config.prefill_chunk):
            assert plan.n_tokens == config.n_batch
            cut_short = True
    for entry in plan.entries:
        assert entry.start + entry.count <= config.n_ctx_per_slot


def check_progress(
    before: SchedulerState,
    plan: StepPlan,
    holders: dict[int, SequenceState],
    after: SchedulerState,
    ended: tuple[Ended, ...],
) -> None:
    """Each planned sequence moved by exactly its tokens, one sampled token per logits
    entry; the others did not move."""
    ends = {end.seq_id: end for end in ended}
    for entry in plan.entries:
        seq = holders[entry.seq_id]
        generated = seq.generated + entry.wants_logits
        now = after.get(entry.seq_id)
        if now is None:
            assert ends[entry.seq_id].generated == generated
        else:
            prefilled = seq.prefilled + (entry.count if entry.kind == "prefill" else 0)
            assert (now.prefilled, now.generated) == (prefilled, generated)
    planned = {entry.seq_id for entry in plan.entries}
    for seq in (*before.waiting, *before.running):
        if seq.seq_id not in ends and seq.seq_id not in planned:
            assert after.get(seq.seq_id) == holders.get(seq.seq_id, seq)


def check_ends(
    before: SchedulerState,
    holders: dict[int, SequenceState],
    finished: Reported,
    after: SchedulerState,
    ended: tuple[Ended, ...],
) -> tuple[Ended, ...]:
    """A sequence ends for the reason reported, else at its length, handing back its slot."""
    ends = {end.seq_id: end for end in ended}
    present = {seq.seq_id: seq for seq in (*before.waiting, *before.running)}
    assert set(ends) <= set(present)
    for seq_id, seq in present.items():
        end = ends.get(seq_id)
        assert (after.get(seq_id) is None) == (end is not None)
        if end is None:
            continue
        assert end.reason == finished.get(seq_id, "length")
        if end.reason == "length":
            assert end.generated == seq.max_new_tokens
        held = holders.get(seq_id)
        assert end.slot == (held.slot if held is not None else None)
        assert end.slot is None or end.slot in after.free_slots()
    return ended


def _held(seq: SequenceState) -> int:
    assert seq.slot is not None
    return seq.slot


class PriorityMachine(SchedulerMachine):
    """Mixed priorities: the queue head is the highest priority, oldest first."""

    priorities = st.integers(0, 2)
    fifo = False
    # A steady stream of urgent work may starve the rest, by design; the drain in teardown
    # still bounds the steps to finish everything.
    bounded = False


@st.composite
def class_configs(draw: st.DrawFn) -> SchedulerConfig:
    n_slots = draw(st.integers(1, 4))
    return SchedulerConfig(
        n_slots=n_slots,
        n_batch=n_slots + draw(st.integers(0, 12)),
        n_ctx_per_slot=draw(st.integers(2, 48)),
        max_prefill_chunk=draw(st.none() | st.integers(1, 8)),
        reserved_slots=draw(st.integers(0, n_slots - 1)),
        preemption=draw(st.booleans()),
    )


class ClassesMachine(SchedulerMachine):
    """Service classes: S2 reservations and S0 preemption. Checked each step: the plan is
    pure and within budget; slots stay unique; sequences below S2 never hold more than the
    unreserved slots; a preempted sequence is S0, runs nothing in its step, and yields to a
    higher one that takes its slot; no token is lost (a sequence's prompt plus what it may
    still generate is constant, and what it carries over counts when it ends)."""

    priorities = st.integers(0, 2)
    fifo = False
    bounded = False

    def __init__(self) -> None:
        super().__init__()
        self.total: dict[int, int] = {}  # seq_id -> prompt_len + max_new_tokens at arrival

    @initialize(config=class_configs())
    def configure(self, config: SchedulerConfig) -> None:
        self.state = SchedulerState(config)

    def check_step(self, plan: StepPlan, finished: Reported) -> None:
        before = self.state
        config = before.config
        assert plan == plan_step(before)
        assert plan.n_tokens <= config.n_batch
        for seq in (*before.waiting, *before.running):
            self.total.setdefault(seq.seq_id, seq.prompt_len + seq.max_new_tokens)
        running = {seq.seq_id: seq for seq in before.running}
        taken = {a.slot: a.seq_id for a in plan.admitted}
        for p in plan.preempted:
            victim = running[p.seq_id]
            assert config.preemption
            assert victim.priority == 0
            assert victim.slot == p.slot
            taker = before.get(taken[p.slot])
            assert taker is not None
            assert taker.priority > 0
        planned = {e.seq_id for e in plan.entries}
        assert not planned & {p.seq_id for p in plan.preempted}
        self.admitted += [a.seq_id for a in plan.admitted]
        self.state, ended = apply_step(before, plan, StepOutcome(finished))
        self.steps += 1
        low = [seq for seq in self.state.running if seq.priority < config.reserved_priority]
        assert len(low) <= config.n_slots - config.reserved_slots
        for seq in (*self.state.waiting, *self.state.running):
            assert seq.prompt_len + seq.max_new_tokens == self.total[seq.seq_id]
            assert seq.prompt_len - seq.carried >= 1  # its own prompt is still there
        for end in ended:
            start = self.total.pop(end.seq_id)
            assert end.generated <= start
            self.forget(end.seq_id)


# derandomize: CI and a laptop explore the same cases; no deadline, tests check behaviour.
PROPERTY_SETTINGS = settings(
    max_examples=tries(150), stateful_step_count=40, derandomize=True, deadline=None
)


def test_scheduler_properties_with_equal_priorities() -> None:
    run_state_machine_as_test(SchedulerMachine, settings=PROPERTY_SETTINGS)


def test_scheduler_properties_with_mixed_priorities() -> None:
    run_state_machine_as_test(PriorityMachine, settings=PROPERTY_SETTINGS)


def test_scheduler_properties_with_reservations_and_preemption() -> None:
    run_state_machine_as_test(ClassesMachine, settings=PROPERTY_SETTINGS)
