"""How many cases a randomised test tries: its whole budget in `just test` (what CI runs), a
quarter of it in `just test-fast`, the edit loop's tier (KVL_TESTS=quick, which the recipe
sets). Hypothesis' own advice is the same: a short profile while editing, the long one in CI.
Every test still runs in both tiers; the quick one explores less of each input space, with
the same derandomized first cases.
"""

from __future__ import annotations

import os

QUICK = os.environ.get("KVL_TESTS") == "quick"
# A property below this many cases checks little more than its examples do.
FLOOR = 10


def tries(full: int) -> int:
    """`full`, or in the quick tier a quarter of it (never fewer than FLOOR, never more than
    `full`)."""
    return min(full, max(FLOOR, full // 4)) if QUICK else full
