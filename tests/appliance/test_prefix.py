"""Shared-prefix policy: examples that document it, then properties over random traffic."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.serving.prefix import Alone, Build, Park, PrefixShare, Reuse, common_prefix
from tests.budget import tries

SYSTEM = tuple(range(100, 180))  # an 80-token system prompt


def prompt(*tail: int) -> tuple[int, ...]:
    return (*SYSTEM, *tail)


def test_the_second_prompt_with_a_common_prefix_makes_the_first_build_it_when_unstarted() -> None:
    share = PrefixShare(min_tokens=16, max_tokens=512)
    assert share.place(0, prompt(1, 2), unstarted={0}) == Alone()
    # Sequence 0 has not prefilled a token yet: it builds, so the prefix is computed once.
    assert share.place(1, prompt(3, 4), unstarted={0}) == Build(builder=0, length=80)
    assert share.builder == 0
    assert share.target == SYSTEM
    assert share.place(2, prompt(5), unstarted={0}) == Park()
    assert not share.progress(0, 64)  # part way
    assert share.progress(0, 80)
    assert share.tokens == SYSTEM
    assert share.place(2, prompt(5), unstarted=set()) == Reuse(80)


def test_a_newcomer_builds_itself_when_its_partner_already_started() -> None:
    share = PrefixShare(min_tokens=16, max_tokens=512)
    share.place(0, prompt(1), unstarted={0})
    assert share.place(1, prompt(2), unstarted=set()) == Build(builder=None, length=80)
    assert share.builder == 1


def test_the_store_is_capped_and_a_prompt_keeps_its_last_token_to_decode() -> None:
    share = PrefixShare(min_tokens=16, max_tokens=50)
    share.place(0, prompt(1), unstarted=set())
    assert share.place(1, prompt(2), unstarted=set()) == Build(builder=None, length=50)
    share.progress(1, 50)
    # A prompt that is exactly the stored prefix still decodes its last token itself.
    assert share.place(2, SYSTEM[:50], unstarted=set()) == Reuse(49)


def test_a_prompt_whose_start_a_slot_kept_builds_and_waits_only_for_more() -> None:
    # A chat's turn two starts with turn one's prompt (and answer), which a slot kept: a
    # store of that prompt would make it compute everything the slot already holds.
    share = PrefixShare(min_tokens=16, max_tokens=512)
    share.place(0, prompt(1, 2), unstarted=set())
    assert share.place(1, prompt(1, 2, 3), unstarted=set(), kept=82) == Alone()
    assert share.builder is None
    # A slot that holds less than the common part: building is still worth it.
    assert share.place(2, prompt(4), unstarted=set(), kept=40) == Build(builder=None, length=80)
    # While it is built: wait only if it gives more than the slot.
    assert share.place(3, prompt(5), unstarted=set(), kept=80) == Alone()
    assert share.place(4, prompt(6), unstarted=set(), kept=79) == Park()
    assert share.progress(2, 80)
    # A store that holds it is offered anyway: the scheduler takes the larger.
    assert share.place(5, prompt(7), unstarted=set(), kept=90) == Reuse(80)


def test_short_common_prefixes_and_a_disabled_share_place_alone() -> None:
    share = PrefixShare(min_tokens=16, max_tokens=512)
    share.place(0, (1, 2, 3, 4), unstarted=set())
    assert share.place(1, (1, 2, 3, 5), unstarted=set()) == Alone()
    off = PrefixShare(min_tokens=0, max_tokens=512)
    off.place(0, prompt(1), unstarted=set())
    assert off.place(1, prompt(2), unstarted=set()) == Alone()


def test_a_builder_that_leaves_early_empties_the_store_and_readers_pin_it() -> None:
    share = PrefixShare(min_tokens=16, max_tokens=512)
    share.place(0, prompt(1), unstarted={0})
    share.place(1, prompt(2), unstarted={0})
    assert share.ended(0)  # parked prompts are placed again
    assert (share.tokens, share.target, share.builder) == ((), (), None)
    # Placed again, the parked prompt finds its partner in the history and builds.
    assert share.place(1, prompt(2), unstarted=set()) == Build(builder=None, length=80)
    share.progress(1, 80)
    assert share.place(2, prompt(3), unstarted=set()) == Reuse(80)
    # While sequence 2 waits to copy, another prefix may not replace the store.
    other = tuple(range(500, 600))
    share.place(3, other, unstarted=set())
    assert share.place(4, other, unstarted=set()) == Alone()
    share.admitted(2)
    assert share.place(5, other, unstarted=set()) == Build(builder=None, length=99)


def test_a_rejected_sequence_leaves_the_history_so_its_reused_id_is_not_confused() -> None:
    share = PrefixShare(min_tokens=16, max_tokens=512)
    share.place(0, prompt(1), unstarted=set())
    share.rejected(0)  # the engine refused it; the next arrival gets id 0 again
    assert share.place(0, tuple(range(500, 600)), unstarted={0}) == Alone()


def test_siblings_share_a_short_prompt_even_with_sharing_off() -> None:
    # OpenAI's n: the same 6-token prompt three times; min_tokens 0 turns ordinary sharing off.
    share = PrefixShare(min_tokens=0, max_tokens=512)
    short = (2, 10, 11, 12, 13, 14)
    # The first sibling builds all but its last token at once: the others are on their way.
    assert share.place(0, short, unstarted=set(), siblings=True) == Build(builder=None, length=5)
    assert share.place(1, short, unstarted=set(), siblings=True) == Park()
    assert share.progress(0, 6)
    assert share.place(1, short, unstarted=set(), siblings=True) == Reuse(5)
    assert share.place(2, short, unstarted=set(), siblings=True) == Reuse(5)
    # A request that is not a sibling still never shares here.
    assert share.place(3, short, unstarted=set()) == Alone()


def test_an_unstarted_sibling_that_came_first_builds_for_the_others() -> None:
    share = PrefixShare(min_tokens=64, max_tokens=512)
    short = (2, 10, 11, 12)
    # Placed alone while another store had readers, the first sibling has not started yet.
    share.readers.add(99)
    assert share.place(0, short, unstarted={0}, siblings=True) == Alone()
    share.admitted(99)
    assert share.place(1, short, unstarted={0}, siblings=True) == Build(builder=0, length=3)
    assert share.progress(0, 4)
    assert share.place(1, short, unstarted=set(), siblings=True) == Reuse(3)


def test_siblings_reuse_a_long_common_part_the_store_holds_and_a_store_is_capped() -> None:
    share = PrefixShare(min_tokens=16, max_tokens=50)
    share.place(0, prompt(1), unstarted=set())
    share.place(1, prompt(2), unstarted=set())
    share.progress(1, 50)
    # The store holds 50 tokens of the system prompt: copying beats rebuilding it.
    assert share.place(2, prompt(7, 8), unstarted=set(), siblings=True) == Reuse(50)
    share.admitted(2)
    # A sibling prompt that shares too little with the store replaces it (capped at 50).
    other = tuple(range(500, 600))
    assert share.place(3, other, unstarted=set(), siblings=True) == Build(builder=None, length=50)
    # While a build runs for another prompt, a sibling that cannot use it goes alone.
    assert share.place(4, (1, 2, 3), unstarted=set(), siblings=True) == Alone()
    # A one-token prompt has nothing to share: its only token is decoded for its logits.
    assert share.place(5, (7,), unstarted=set(), siblings=True) == Alone()


def test_common_prefix() -> None:
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix((), (1,)) == 0
    assert common_prefix((1, 2), (1, 2)) == 2


# -- properties ------------------------------------------------------------------------------

prefixes = st.sampled_from([SYSTEM, tuple(range(300, 340)), ()])
prompts = st.tuples(prefixes, st.lists(st.integers(0, 5), min_size=1, max_size=6)).map(
    lambda pair: (*pair[0], *pair[1])
)


@settings(max_examples=tries(200), deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(prompts, st.integers(0, 3), st.booleans(), st.integers(0, 24)),
        min_size=1,
        max_size=30,
    )
)
def test_a_reader_copies_only_what_the_store_holds_and_every_park_is_released(
    traffic: list[tuple[tuple[int, ...], int, bool, int]],
) -> None:
    """A stand-in engine: each arrival is placed; between arrivals a running sequence may
    prefill (a builder completes its part) or end. Checked: a Reuse names tokens that are in
    the store and match the prompt; a store changes only when no reader waits; a build's
    target is a prefix of its builder's prompt; parked prompts are released when the store
    is complete or its builder left, and then placed without parking again. Some arrivals
    are siblings (share_prompt), which may share fewer than min_tokens; some find a slot
    that kept the start of their prompt, and build only a longer prefix."""
    share = PrefixShare(min_tokens=16, max_tokens=64)
    prompts_by_id: dict[int, tuple[int, ...]] = {}
    unstarted: set[int] = set()
    parked: list[tuple[tuple[int, ...], bool, int]] = []
    next_id = 0

    def place(p: tuple[int, ...], sibling: bool, kept: int) -> None:
        nonlocal next_id
        before = (share.tokens, set(share.readers))
        placement = share.place(next_id, p, unstarted, siblings=sibling, kept=kept)
        if isinstance(placement, Build):
            assert not before[1], "the store changed under a waiting reader"
            assert placement.length <= 64
            assert sibling or placement.length > kept
        if isinstance(placement, Park) or (
            isinstance(placement, Build) and placement.builder is not None
        ):
            assert share.builder is not None
            if isinstance(placement, Park) and not sibling:
                assert common_prefix(p, share.target) > kept  # more than its slot holds
            if isinstance(placement, Build):
                assert placement.builder is not None
                owner = prompts_by_id[placement.builder]
                assert share.target == owner[: placement.length]
                assert placement.length < len(owner)
            parked.append((p, sibling, kept))
            return
        if isinstance(placement, Reuse):
            assert (1 if sibling else 16) <= placement.cached < len(p)
            assert p[: placement.cached] == share.tokens[: placement.cached]
        if isinstance(placement, Build):
            assert share.target == p[: placement.length]
            assert placement.length < len(p)
        prompts_by_id[next_id] = p
        unstarted.add(next_id)
        next_id += 1

    def release() -> None:
        again = list(parked)
        parked.clear()
        for p, sibling, kept in again:
            place(p, sibling, kept)

    for p, action, sibling, kept in traffic:
        place(p, sibling, kept)
        live = sorted(prompts_by_id)
        if not live:
            continue
        seq_id = live[action % len(live)]
        if action in (0, 1):  # the sequence is admitted and prefills its prompt
            unstarted.discard(seq_id)
            share.admitted(seq_id)
            if share.progress(seq_id, len(prompts_by_id[seq_id])):
                release()
        elif action == 2:  # it ends
            unstarted.discard(seq_id)
            del prompts_by_id[seq_id]
            if share.ended(seq_id):
                release()
    # Drain: every sequence prefills and ends; nothing stays parked.
    while prompts_by_id:
        seq_id = min(prompts_by_id)
        unstarted.discard(seq_id)
        share.admitted(seq_id)
        if share.progress(seq_id, len(prompts_by_id[seq_id])):
            release()
        del prompts_by_id[seq_id]
        if share.ended(seq_id):
            release()
    assert not parked
