"""Shared prompt prefixes: compute a common system prompt once, copy its KV to every sequence.

Pure policy, no llama.cpp: the batching engine asks :meth:`PrefixShare.place` what to do
with each arriving prompt and tells it what happened; it keeps the KV of one prefix in a
llama.cpp sequence of its own (the *store*) and copies it into a slot with
``llama_memory_seq_cp``. In a unified KV cache that copy only adds a sequence id to the
cells: the prefix is held once however many sequences use it.

How a prefix gets into the store costs nothing extra: when two prompts share at least
``min_tokens``, one of them (the *builder*) prefills the common part into both its own slot
and the store, in the same batch entries. Prompts that need the prefix while it is being
built wait for it (*park*) rather than compute it again; once it is there they start with it
(:class:`Reuse`), and their prefill begins after it.

A slot that kept the cells of an earlier request (a conversation's previous turn, see
appliance.serving.scheduler) may already hold the start of a prompt: ``kept`` says how much.
A build or a wait that would give no more than that is not worth it, and the prompt goes
alone to that slot; without this a chat's next turn, which starts with its previous prompt,
would build a store of that prompt and compute it all again.

Sliding-window models: a prefix that is longer than the window would be partly dropped from
the sliding-window layers' cache, so the store holds at most ``window - 1`` tokens of it
(the rest is prefilled per sequence). A store that is only ever read never leaves its window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Reuse:
    """Copy the store's first ``cached`` tokens into the sequence's slot at admission."""

    cached: int


@dataclass(frozen=True)
class Build:
    """Sequence ``builder`` prefills the first ``length`` prompt tokens into the store too.
    The arriving prompt is the builder itself when ``builder`` is None; else it waits like
    :class:`Park`, for the prefix an older, unstarted sequence now builds."""

    builder: int | None
    length: int


@dataclass(frozen=True)
class Park:
    """Wait: the prefix this prompt needs is being built; place it again once it is."""


@dataclass(frozen=True)
class Alone:
    """Nothing to share: prefill the whole prompt."""


PrefixPlan = Reuse | Build | Park | Alone


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class PrefixShare:
    """Which prefix the store holds, who builds it, and the recent prompts to match against.

    ``min_tokens``: a shared prefix shorter than this is not worth a store (0: never share).
    ``max_tokens``: the longest prefix the store may hold (its KV room; for sliding-window
    models, less than the window).
    """

    min_tokens: int
    max_tokens: int
    history: int = 16  # recent prompts a new one is compared with
    tokens: tuple[int, ...] = ()  # in the store, ready to copy
    target: tuple[int, ...] = ()  # being built by ``builder``
    builder: int | None = None
    # Waiting sequences that will copy from the store at admission: it must not change
    # under them, so no new build starts while any is left.
    readers: set[int] = field(default_factory=set)
    _recent: deque[tuple[int, tuple[int, ...]]] = field(default_factory=deque)

    @property
    def enabled(self) -> bool:
        return self.min_tokens > 0 and self.max_tokens >= self.min_tokens

    def place(
        self,
        seq_id: int,
        prompt: tuple[int, ...],
        unstarted: set[int],
        *,
        siblings: bool = False,
        kept: int = 0,
    ) -> PrefixPlan:
        """Decide for an arriving prompt. ``unstarted``: sequences that have not prefilled a
        token yet (one of them may become the builder instead of the newcomer). Call
        :meth:`admitted`, :meth:`ended` and :meth:`progress` as the engine goes on.

        ``siblings``: the same prompt comes again at once (OpenAI's ``n``), so all of it but
        its last token is worth a store, however short, and even when ``min_tokens`` is 0.
        ``kept``: how many of its first tokens a free slot already holds; no build or wait
        for a prefix that is not longer (siblings ignore it: the others need the store).
        """
        if not (self.enabled or (siblings and self.max_tokens > 0)):
            return Alone()
        if siblings:
            where = self._place_sibling(seq_id, prompt, unstarted)
        else:
            where = self._place(seq_id, prompt, unstarted, kept)
        if isinstance(where, Park) or (isinstance(where, Build) and where.builder is not None):
            # It waits, so it is not remembered: a waiting prompt gets no sequence id until
            # it is placed again.
            return where
        self._remember(seq_id, prompt)
        if isinstance(where, Reuse):
            self.readers.add(seq_id)
        return where

    def _shares(self, n: int) -> bool:
        return self.enabled and n >= self.min_tokens

    def _place(
        self, seq_id: int, prompt: tuple[int, ...], unstarted: set[int], kept: int
    ) -> PrefixPlan:
        if self.tokens:
            n = min(common_prefix(prompt, self.tokens), len(prompt) - 1)
            if self._shares(n):
                return Reuse(n)  # the scheduler takes the larger of this and kept
        if self.builder is not None:
            n = common_prefix(prompt, self.target)
            return Park() if self._shares(n) and n > kept else Alone()
        if self.readers:
            return Alone()
        return self._build(seq_id, prompt, unstarted, kept)

    def _place_sibling(
        self, seq_id: int, prompt: tuple[int, ...], unstarted: set[int]
    ) -> PrefixPlan:
        """As :meth:`_place`, but the whole prompt (less its last token, capped by the store)
        is the prefix to share: a store that holds it is reused, a build of it is waited for,
        and with neither the first sibling builds it (the others are on their way). A store
        that holds a common part long enough for ordinary sharing is reused as it is: copying
        that beats computing it again for a store of the whole prompt."""
        whole = min(len(prompt) - 1, self.max_tokens)
        if whole < 1:
            return Alone()
        if self.tokens:
            n = min(common_prefix(prompt, self.tokens), len(prompt) - 1)
            if n == whole or self._shares(n):
                return Reuse(n)
        if self.builder is not None:
            mine = self.target == prompt[:whole]
            return Park() if mine or self._shares(common_prefix(prompt, self.target)) else Alone()
        if self.readers:
            return Alone()
        # An unstarted sibling that came first builds (its prefill writes the store too);
        # else this one does.
        builder = next(
            (
                other_id
                for other_id, other in self._recent
                if other_id in unstarted and other[:whole] == prompt[:whole] and len(other) > whole
            ),
            seq_id,
        )
        self.builder, self.target, self.tokens = builder, prompt[:whole], ()
        return Build(None if builder == seq_id else builder, whole)

    def _build(
        self, seq_id: int, prompt: tuple[int, ...], unstarted: set[int], kept: int
    ) -> PrefixPlan:
        """Start a store for the longest prefix this prompt shares with a recent one."""
        best, partner = 0, None
        for other_id, other in self._recent:
            n = common_prefix(prompt, other)
            if n > best:
                best, partner = n, (other_id, other)
        if partner is None:
            return Alone()
        other_id, other = partner
        # Everyone who reads the store decodes at least its own last prompt token.
        length = min(best, len(prompt) - 1, len(other) - 1, self.max_tokens)
        if not self._shares(length) or length <= kept:
            return Alone()
        builder = other_id if other_id in unstarted else seq_id
        self.builder, self.target, self.tokens = builder, prompt[:length], ()
        return Build(None if builder == seq_id else builder, length)

    def _remember(self, seq_id: int, prompt: tuple[int, ...]) -> None:
        self._recent.append((seq_id, prompt))
        while len(self._recent) > self.history:
            self._recent.popleft()

    def progress(self, seq_id: int, prefilled: int) -> bool:
        """The builder has ``prefilled`` prompt tokens in its slot (and the store); True when
        that completes the store, so parked prompts can be placed again."""
        if seq_id != self.builder or prefilled < len(self.target):
            return False
        self.tokens, self.target, self.builder = self.target, (), None
        return True

    def admitted(self, seq_id: int) -> None:
        """A reader's copy is done; the store may change after this."""
        self.readers.discard(seq_id)

    def rejected(self, seq_id: int) -> bool:
        """The engine did not take the sequence after all: its id will be given again, so it
        leaves the history too. Returns what :meth:`ended` returns."""
        self._recent = deque((i, p) for i, p in self._recent if i != seq_id)
        return self.ended(seq_id)

    def ended(self, seq_id: int) -> bool:
        """A sequence ended (or never started). True when it was the builder and the store
        is now empty: parked prompts must be placed again (one of them builds)."""
        self.readers.discard(seq_id)
        if seq_id != self.builder:
            return False
        self.tokens, self.target, self.builder = (), (), None
        return True
