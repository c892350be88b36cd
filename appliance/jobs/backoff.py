"""Exponential backoff with jitter, for the job runner and webhook delivery."""

from __future__ import annotations

import random

# Jitter spreads retries out; it guards no secret.
_RANDOM = random.Random()  # noqa: S311


def backoff_s(failures: int, initial_s: float, max_s: float) -> float:
    """The wait after the `failures`-th failure in a row: `initial_s` doubling each time, at
    most `max_s`, of which a random half ("equal jitter", so clients that failed together do
    not retry together, and no wait is shorter than half its step)."""
    step = min(max_s, initial_s * 2.0 ** min(max(failures - 1, 0), 64))
    return step / 2 + _RANDOM.uniform(0.0, step / 2)
