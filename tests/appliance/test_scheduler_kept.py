"""Slots that keep the KV of the sequence that ran in them (retain): which free slot a new
sequence takes, and how much of its prompt it skips computing."""

from __future__ import annotations

import pytest

from appliance.serving.scheduler import (
    Admission,
    BatchEntry,
    Queued,
    SchedulerConfig,
    SchedulerState,
    apply_step,
    kept_prefix,
    plan_step,
    retain,
    submit,
)

CONFIG = SchedulerConfig(n_slots=3, n_batch=64, n_ctx_per_slot=64)


def queue(
    state: SchedulerState, tokens: tuple[int, ...], *, cached: int = 0, max_new: int = 4
) -> tuple[SchedulerState, int]:
    state, result = submit(state, len(tokens), max_new, cached=cached, tokens=tokens)
    assert isinstance(result, Queued)
    return state, result.seq_id


def keeping(*kept: tuple[int, ...] | None) -> SchedulerState:
    """All slots free; slot i keeps ``kept[i]`` (None: nothing), kept in that order."""
    state = SchedulerState(CONFIG)
    for slot, tokens in enumerate(kept):
        if tokens is not None:
            state = retain(state, slot, tokens)
    return state


def test_a_conversations_next_turn_takes_its_slot_and_prefills_only_the_new_part() -> None:
    # Turn one: a 10-token prompt, three tokens sampled (the last one, end of turn, is never
    # decoded), so the slot holds 12 tokens once it ends.
    state = SchedulerState(CONFIG)
    first = tuple(range(100, 110))
    state, seq = queue(state, first, max_new=3)
    state, _ = queue(state, (7, 8, 9), max_new=3)  # another client, in slot 1
    for _ in range(3):
        state, ended = apply_step(state, plan_step(state))
    assert [(e.seq_id, e.slot, e.reason) for e in ended] == [(seq, 0, "length"), (1, 1, "length")]
    answer = (201, 202)
    state = retain(state, 0, first + answer)
    state = retain(state, 1, (7, 8, 9, 31, 32))
    # Turn two: everything before, then the end of the turn and the user's new text.
    second = (*first, *answer, 2, 300, 301, 302)
    state, seq = queue(state, second)
    plan = plan_step(state)
    assert plan.admitted == (Admission(seq, slot=0, reused=12),)
    # Prefill starts right after the kept cells: positions 12 .. 15 of the slot.
    assert plan.entries == (BatchEntry(seq, 0, "prefill", 12, 4, wants_logits=True),)
    state, _ = apply_step(state, plan)
    assert 0 not in state.kept  # its new sequence overwrites what slot 0 held
    assert set(state.kept) == {1}


def test_the_slot_with_the_longest_common_prefix_wins() -> None:
    prompt = (1, 2, 3, 4, 5, 6, 7, 8)
    state = keeping((1, 2, 9), (1, 2, 3, 4, 5, 99), (1, 2, 3))
    state, seq = queue(state, prompt)
    assert plan_step(state).admitted == (Admission(seq, slot=1, reused=5),)


def test_at_least_the_last_prompt_token_is_computed() -> None:
    # The same prompt again (a retry): all of it is kept, but its last token's logits give
    # the first new token, so that one is decoded again.
    prompt = (5, 6, 7, 8)
    state = keeping(None, (*prompt, 40, 41))
    state, seq = queue(state, prompt)
    plan = plan_step(state)
    assert plan.admitted == (Admission(seq, slot=1, reused=3),)
    assert plan.entries == (BatchEntry(seq, 1, "prefill", 3, 1, wants_logits=True),)


@pytest.mark.parametrize(
    ("kept", "slot"),
    [
        # No match: a slot that keeps nothing, so no conversation is lost ...
        (((9, 9), None, (8, 8)), 1),
        # ... else the one kept longest ago (slot 0 was kept first).
        (((9, 9), (7, 7), (8, 8)), 0),
    ],
)
def test_without_a_match_an_empty_slot_goes_first_then_the_least_recently_kept(
    kept: tuple[tuple[int, ...] | None, ...], slot: int
) -> None:
    state, seq = queue(keeping(*kept), (1, 2, 3))
    assert plan_step(state).admitted == (Admission(seq, slot=slot),)


def test_least_recently_kept_is_by_when_kept_not_by_slot_number() -> None:
    state = SchedulerState(CONFIG)
    for slot in (2, 0, 1):
        state = retain(state, slot, (50 + slot,))
    state, seq = queue(state, (1, 2, 3))
    assert plan_step(state).admitted == (Admission(seq, slot=2),)


def test_the_shared_prefix_and_a_kept_slot_do_not_both_apply_the_larger_wins() -> None:
    prompt = tuple(range(20))
    # The slot holds 12 of the prompt, the prefix store 8: the slot's cells are used, and
    # nothing is copied from the store.
    state, seq = queue(keeping(None, prompt[:12]), prompt, cached=8)
    plan = plan_step(state)
    assert plan.admitted == (Admission(seq, slot=1, cached=0, reused=12),)
    assert plan.entries[0].start == 12
    # The store holds more: it is copied into a slot that keeps nothing, and the kept
    # conversation stays for its own next turn.
    state, seq = queue(keeping(None, prompt[:12]), prompt, cached=15)
    plan = plan_step(state)
    assert plan.admitted == (Admission(seq, slot=0, cached=15),)
    assert plan.entries[0].start == 15


def test_a_sequence_that_must_prefill_all_its_prompt_reuses_nothing() -> None:
    prompt = tuple(range(10))
    state, seq = queue(keeping(prompt[:6], None), prompt)
    assert plan_step(state, no_reuse={seq}).admitted == (Admission(seq, slot=1),)
    assert plan_step(state).admitted == (Admission(seq, slot=0, reused=6),)


def test_a_prompt_without_its_tokens_never_reuses() -> None:
    state = keeping((1, 2, 3), (4, 5, 6), (7, 8, 9))
    state, result = submit(state, 3, 4)
    assert isinstance(result, Queued)
    assert plan_step(state).admitted == (Admission(result.seq_id, slot=0),)


def test_several_admissions_in_one_step_each_take_their_own_conversation() -> None:
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    state = keeping(a[:3], None, b[:3])
    state, seq_b = queue(state, b)
    state, seq_a = queue(state, a)
    state, seq_c = queue(state, (9, 9, 9))
    assert plan_step(state).admitted == (
        Admission(seq_b, slot=2, reused=3),
        Admission(seq_a, slot=0, reused=3),
        Admission(seq_c, slot=1),
    )


def test_only_a_free_slot_can_keep_cells() -> None:
    state, _ = queue(SchedulerState(CONFIG), (1, 2))
    state, _ = apply_step(state, plan_step(state))  # slot 0 is busy now
    with pytest.raises(ValueError, match="not free"):
        retain(state, 0, (1, 2))
    state = retain(state, 1, (1, 2))
    with pytest.raises(ValueError, match="not free"):
        retain(state, 1, (1, 2))
    with pytest.raises(ValueError, match="cannot be what a slot holds"):
        retain(state, 2, tuple(range(65)))


def test_tokens_must_be_the_whole_prompt() -> None:
    with pytest.raises(ValueError, match="2 tokens given for a prompt of 3"):
        submit(SchedulerState(CONFIG), 3, 4, tokens=(1, 2))


def test_kept_prefix_is_what_the_best_free_slot_would_give() -> None:
    state = keeping((1, 2, 3, 4), None, (1, 2, 9))
    assert kept_prefix(state, (1, 2, 3, 5)) == 3
    assert kept_prefix(state, (1, 2, 3)) == 2  # its last token is computed
    assert kept_prefix(state, (7, 7)) == 0
    assert kept_prefix(state, ()) == 0
    assert kept_prefix(SchedulerState(CONFIG), (1, 2, 3)) == 0
