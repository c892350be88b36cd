"""How far llama.cpp's logits may drift between two runs of one prompt before a test calls
it a fault (sharing a prompt's cells, batching, sampling)."""

from __future__ import annotations

# How far the first generated token's logits may move with and without the shared prefix
# (greedy text is no measure: a near-tie flips with rounding, and the rest of the answer
# follows). Measured with gemma-3-270m Q4_K_M on an x86-64 CPU, these prompts, one slot:
# - sharing vs not: prompts 0, 1 and 3 (of 0..4) bitwise equal, 2 and 4 max |d| 0.66 and
#   0.86, mean |d| 0.11 and 0.17 (logits up to ~22). Which rows of a prefill ubatch a token
#   sits in decides the kernels' rounding: without any sharing, prefilling in one 256-token
#   ubatch instead of 128-token ones moves them as much (max 0.90..1.06, mean 0.15..0.25),
#   and flips greedy's first pick where its margin is 0.2 logits.
# - a real fault, the copy missing the prompt's first cell: max 5.6..9.0, mean 0.85..1.5;
#   another question instead of this one: max 9.9..11.8, mean 1.0..2.7.
MAX_DRIFT = 2.5


MEAN_DRIFT = 0.5
