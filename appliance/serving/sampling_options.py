"""What a sequence's sampling is, apart from the sampler that does it
(appliance/serving/sampling.py): the gateway builds these from requests and sends them to
the model workers, and importing them costs it neither llama.cpp's library nor NumPy
(about 20 MiB of the gateway's memory, for a process that never samples)."""

from __future__ import annotations

from dataclasses import dataclass


class GrammarError(Exception):
    """llama.cpp refused the grammar of a structured-output request."""


@dataclass(frozen=True)
class Sampling:
    """How one sequence picks its tokens. Every default means "off"; callers validate ranges.

    ``top_k`` 0: no cut. ``repeat_last_n``: the window of the repeat, presence and frequency
    penalties, in generated tokens (0: off, -1: the whole sequence). ``logit_bias``: (token
    id, value added to its logit) as in OpenAI's API: -100 effectively bans the token, +100
    effectively forces it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()
