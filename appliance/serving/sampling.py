"""Per-sequence token sampling on llama.cpp's sampler API.

With a grammar (structured output), the token is first sampled without it and only then
checked against the grammar; the full grammar pass over the vocabulary runs only when that
token is rejected. This is what llama.cpp's own common sampler does: Gemma 3's vocabulary
has 262,144 tokens, and running the grammar over all of them at every step costs more
than the model itself. Both passes run the whole chain (logit bias, penalties, cuts), so a
bias that forces a token the grammar forbids costs only the second pass.
"""

from __future__ import annotations

import ctypes
import math
import secrets
from typing import Any

import llama_cpp
import numpy as np

from appliance.serving.sampling_options import GrammarError, Sampling

_TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


class Sampler:
    """The sampler chain of one sequence, and its grammar if it has one. Not thread-safe."""

    def __init__(
        self,
        vocab: Any,
        n_vocab: int,
        sampling: Sampling,
        grammar: str | None,
        n_ctx: int = 4096,
    ) -> None:
        """``n_ctx``: the sequence's context, the penalty window when ``repeat_last_n`` is -1."""
        self._n_vocab = n_vocab
        self._grammar: Any = None
        if grammar is not None:
            self._grammar = llama_cpp.llama_sampler_init_grammar(
                vocab, grammar.encode("utf-8"), b"root"
            )
            if not self._grammar:
                raise GrammarError("llama.cpp could not compile the grammar for this schema")
        self._chain = _chain(sampling, n_vocab, n_ctx)
        # A plain greedy chain (no bias, no penalties, no grammar) is the first largest logit,
        # which numpy finds in a tenth of the time llama_sampler_sample takes: that call
        # copies the whole vocabulary (262,144 entries for Gemma 3) into a fresh array each
        # token, and with many streams that is the largest cost between two decodes.
        self._argmax = grammar is None and _plain_greedy(sampling, n_ctx)
        if self._grammar is not None:
            self._ids = np.arange(n_vocab, dtype=np.intc)
            self._data = np.zeros(n_vocab, dtype=_TOKEN_DATA)

    def sample(self, ctx: Any, idx: int = -1) -> int:
        """Sample the next token from the logits of batch position ``idx`` (default: the
        last) of ``ctx``, and accept it."""
        if self._argmax:
            # np.argmax returns the first of equal maxima, as llama.cpp's greedy sampler;
            # the chain has nothing to accept (greedy keeps no state).
            return int(np.argmax(logits_at(ctx, idx, self._n_vocab)))
        if self._grammar is None:
            return int(llama_cpp.llama_sampler_sample(self._chain, ctx, idx))
        logits = logits_at(ctx, idx, self._n_vocab)
        token = self._apply(logits, with_grammar=False)
        if not self._grammar_accepts(token):
            token = self._apply(logits, with_grammar=True)
        llama_cpp.llama_sampler_accept(self._grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def _apply(self, logits: np.ndarray[Any, Any], *, with_grammar: bool) -> int:
        data = self._data
        data["id"] = self._ids
        data["logit"] = logits
        data["p"] = 0.0
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=self._n_vocab,
            selected=-1,
            sorted=False,
        )
        if with_grammar:
            llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(array))
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))
        if array.selected < 0:
            raise GrammarError("no token satisfies the grammar")
        return int(array.data[array.selected].id)

    def _grammar_accepts(self, token: int) -> bool:
        single = llama_cpp.llama_token_data(token, 1.0, 0.0)
        array = llama_cpp.llama_token_data_array(
            data=ctypes.pointer(single), size=1, selected=-1, sorted=False
        )
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(array))
        return not math.isinf(single.logit)

    def free(self) -> None:
        llama_cpp.llama_sampler_free(self._chain)
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None


def _penalised(s: Sampling, n_ctx: int) -> bool:
    window = n_ctx if s.repeat_last_n < 0 else s.repeat_last_n
    return bool(window) and (
        s.repeat_penalty != 1.0 or bool(s.presence_penalty) or bool(s.frequency_penalty)
    )


def _plain_greedy(s: Sampling, n_ctx: int) -> bool:
    """Whether :func:`_chain` makes the greedy sampler alone."""
    return s.temperature == 0.0 and not s.logit_bias and not _penalised(s, n_ctx)


def _chain(s: Sampling, n_vocab: int, n_ctx: int) -> Any:
    """llama.cpp's usual order (its common sampler's): logit bias, penalties, then greedy,
    or top-k, top-p, min-p, temperature and the seeded draw. Each stage is added only when
    it changes something: a default request runs the shortest chain."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = llama_cpp.llama_sampler_chain_add
    if s.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(s.logit_bias))(
            *(llama_cpp.llama_logit_bias(token, bias) for token, bias in s.logit_bias)
        )
        # llama.cpp copies the array; it need not outlive this call.
        add(chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(s.logit_bias), biases))
    window = n_ctx if s.repeat_last_n < 0 else s.repeat_last_n
    if _penalised(s, n_ctx):
        # The penalties see the tokens the chain accepts: the generated ones, not the prompt
        # (as OpenAI's presence and frequency penalties count the completion only).
        add(
            chain,
            llama_cpp.llama_sampler_init_penalties(
                n_vocab, window, s.repeat_penalty, s.frequency_penalty, s.presence_penalty
            ),
        )
    if s.temperature == 0.0:
        add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    seed = s.seed if s.seed is not None else secrets.randbelow(2**32 - 1)
    if s.top_k > 0:
        add(chain, llama_cpp.llama_sampler_init_top_k(s.top_k))
    if s.top_p < 1.0:
        add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
    if s.min_p > 0.0:
        add(chain, llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
    add(chain, llama_cpp.llama_sampler_init_temp(s.temperature))
    add(chain, llama_cpp.llama_sampler_init_dist(seed % 2**32))
    return chain


def logits_at(ctx: Any, idx: int, n_vocab: int) -> np.ndarray[Any, Any]:
    """The raw logits of batch position ``idx``, as a view (valid until the next decode)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))


def token_logprobs(
    logits: np.ndarray[Any, Any], token: int, k: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-probability of ``token`` and the ``k`` most likely tokens (descending), from the
    model's own distribution: a log-softmax of the raw logits, before any sampler (as vLLM
    reports by default). One pass for the log-sum-exp and a partial sort for the top k: the
    vocabulary may have 262,144 tokens."""
    peak = float(logits.max())
    total = float(np.exp(logits - peak).sum(dtype=np.float64))
    norm = peak + math.log(total)
    # Rounding may put a near-certain token a hair above 0; a probability is at most 1.
    chosen = min(0.0, float(logits[token]) - norm)
    if k <= 0:
        return chosen, ()
    k = min(k, logits.shape[0])
    best = np.argpartition(logits, -k)[-k:]
    values = logits[best]
    order = np.lexsort((best, -values))  # most likely first; ties by id, so stable
    top = tuple((int(best[i]), min(0.0, float(values[i]) - norm)) for i in order)
    return chosen, top
