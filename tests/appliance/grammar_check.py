"""llama.cpp's own grammar engine as a test oracle: does a grammar compile against the real
vocabulary, does it accept a text, and what does it let a random walk produce.

The walk samples random logits over the vocabulary's short tokens, masked by the grammar
exactly as decoding masks them, with end-of-generation made likely: what comes out is
text the grammar accepts whole, without the model (tests of what the model does with a
grammar use the real model, test_structured_output.py and test_tools.py).
"""

from __future__ import annotations

import ctypes
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import llama_cpp
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator

    from appliance.serving.engine import LlamaVocabulary

_TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


@contextmanager
def grammar_sampler(vocab: LlamaVocabulary, grammar: str) -> Iterator[Any]:
    sampler = llama_cpp.llama_sampler_init_grammar(vocab.handle, grammar.encode(), b"root")
    assert sampler, f"llama.cpp refused the grammar:\n{grammar}"
    try:
        yield sampler
    finally:
        llama_cpp.llama_sampler_free(sampler)


def compiles(vocab: LlamaVocabulary, grammar: str) -> bool:
    sampler = llama_cpp.llama_sampler_init_grammar(vocab.handle, grammar.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


def _allowed(sampler: Any, token: int) -> bool:
    single = llama_cpp.llama_token_data(token, 1.0, 0.0)
    array = llama_cpp.llama_token_data_array(
        data=ctypes.pointer(single), size=1, selected=-1, sorted=False
    )
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    return not math.isinf(single.logit)


def accepts(vocab: LlamaVocabulary, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` whole (and then allows the end)."""
    eos = int(llama_cpp.llama_vocab_eos(vocab.handle))
    with grammar_sampler(vocab, grammar) as sampler:
        for token in vocab.tokenize(text, chat=False):
            if token == llama_cpp.llama_vocab_bos(vocab.handle):
                continue
            if not _allowed(sampler, token):
                return False
            llama_cpp.llama_sampler_accept(sampler, token)
        return _allowed(sampler, eos)


class Walker:
    """Random walks through a grammar over the vocabulary's tokens of 1-3 bytes."""

    def __init__(self, vocab: LlamaVocabulary) -> None:
        self.vocab = vocab
        self.eos = int(llama_cpp.llama_vocab_eos(vocab.handle))
        ids = [t for t in range(vocab.n_vocab) if 0 < len(vocab.piece(t)) <= 3]
        self.ids = np.array([*ids, self.eos], dtype=np.intc)
        # Closing characters are made likelier, so walks through open-ended repetitions
        # (a string's characters, a list's items) end in reasonable time.
        closing = {b'"', b"}", b"]", b"\n</tool_call>"}
        self.bias = np.array(
            [4.0 if vocab.piece(t) in closing else 0.0 for t in ids] + [0.0], dtype=np.single
        )
        # A long walk is then pushed towards punctuation (an "@", a ".", a quote), which
        # is what moves a grammar from one part to the next.
        self.late = np.array(
            [6.0 if _punctuation(vocab.piece(t)) else 0.0 for t in ids] + [0.0], dtype=np.single
        )

    def walk(self, grammar: str, rng: np.random.Generator, max_steps: int = 300) -> str | None:
        """A text the grammar accepts, or None if the walk did not end in ``max_steps``."""
        data = np.zeros(len(self.ids), dtype=_TOKEN_DATA)
        out = b""
        with grammar_sampler(self.vocab, grammar) as sampler:
            for step in range(max_steps):
                data["id"] = self.ids
                data["logit"] = rng.normal(size=len(self.ids)) + self.bias
                if step > 30:
                    data["logit"] += self.late
                data["p"] = 0.0
                if rng.random() < 0.3:
                    data["logit"][-1] = 50.0  # end here if the grammar allows it
                array = llama_cpp.llama_token_data_array(
                    data=data.ctypes.data_as(llama_cpp.llama_token_data_p),
                    size=len(self.ids),
                    selected=-1,
                    sorted=False,
                )
                llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
                logits = data["logit"].astype(np.float64)
                finite = np.isfinite(logits)
                assert finite.any(), f"the grammar allows no token after {out!r}"
                weights = np.exp(np.where(finite, logits - logits[finite].max(), -np.inf))
                token = int(data["id"][rng.choice(len(self.ids), p=weights / weights.sum())])
                if token == self.eos:
                    return out.decode("utf-8")
                llama_cpp.llama_sampler_accept(sampler, token)
                out += self.vocab.piece(token)
        return None


def _punctuation(piece: bytes) -> bool:
    return len(piece) == 1 and 0x20 < piece[0] < 0x7F and not chr(piece[0]).isalnum()
