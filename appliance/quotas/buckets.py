"""Token buckets: rate limits and quotas, pure (the caller passes the time)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """Holds up to ``capacity``; refills ``capacity`` per ``period_s``, continuously.

    ``take`` spends before the work (a request against requests per minute); ``charge``
    spends after it (the tokens a request actually used), and may leave the bucket in debt,
    which later requests wait out. Not thread-safe; one event loop uses it.
    """

    capacity: float
    period_s: float
    level: float
    updated: float

    @classmethod
    def full(cls, capacity: float, period_s: float, now: float) -> TokenBucket:
        return cls(capacity, period_s, capacity, now)

    def _refill(self, now: float) -> None:
        if now > self.updated:
            rate = self.capacity / self.period_s
            self.level = min(self.capacity, self.level + (now - self.updated) * rate)
        self.updated = max(self.updated, now)

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be spent (0: now); infinite if it never fits."""
        self._refill(now)
        if self.level >= amount:
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) * self.period_s / self.capacity

    def take(self, amount: float, now: float) -> float:
        """Spend ``amount`` if there is that much; else spend nothing and return the wait."""
        wait = self.wait_s(amount, now)
        if wait == 0:
            self.level -= amount
        return wait

    def charge(self, amount: float, now: float) -> None:
        """Spend ``amount`` whatever the level (work already done)."""
        self._refill(now)
        self.level -= amount
