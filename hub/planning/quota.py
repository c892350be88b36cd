"""Quota leases: how much of an account's global budget a node may spend on its own.

An account's budget is a number of tokens per period (a day by default, periods aligned
to the epoch). Nodes spend it through leases: a slice of tokens, valid until an expiry,
that the node charges locally without asking the hub each time, and goes on charging
while the link is cut. The hub's promise is that the slices it hands out never exceed
what is left:

    consumed + Σ outstanding(lease) ≤ budget          (after every grant)

- `consumed` is every token of the account's usage events in the period that reached the
  hub's ledger (the ledger is idempotent, so a resend counts once);
- a lease is *outstanding* for the part of it the ledger has not seen yet: its grant
  while the node may still spend it, or, once the node reported its final spend, that
  spend; less what the ledger has seen of it (events carry their lease's id). Usage
  that reaches the ledger moves from outstanding to consumed, so nothing counts twice.

A grant is at most what is left. A node overspends its lease only by the requests that
were in flight when it ran out (each admitted request reserves its prompt plus its
max_tokens first, so in practice not even that), so the fleet's overspend is bounded by
the in-flight requests times the largest request cost, and by the safe capacity the
operator allows partitioned nodes (0 by default).

Grants are sized so that the remainder is shared: a node gets at most `share` of what
is left divided among the nodes spending from the account, and at least `min_slice`
(unless less than that is left), and at most `max_slice`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    tokens: int  # per period
    period_s: float

    def period(self, now: float) -> tuple[float, float]:
        """(start, end) of the period `now` falls in, aligned to the epoch."""
        start = math.floor(now / self.period_s) * self.period_s
        return start, start + self.period_s


@dataclass(frozen=True)
class LeaseView:
    """A lease as the planner sees it."""

    id: str
    node_id: str
    granted: int
    seen: int  # tokens the ledger holds that were charged to it
    final: int | None  # the node's final spend, once reported; None while it may spend

    @property
    def outstanding(self) -> int:
        """The part of the lease that may still become usage the ledger has not seen."""
        limit = self.granted if self.final is None else self.final
        return max(0, limit - self.seen)


@dataclass(frozen=True)
class Sizing:
    share: float = 0.5  # of the remainder divided among the spending nodes
    min_slice: int = 1_000
    max_slice: int = 1_000_000


def remaining(budget: Budget, consumed: int, leases: tuple[LeaseView, ...]) -> int:
    """Tokens neither consumed nor promised to a lease (never negative)."""
    return max(0, budget.tokens - consumed - sum(lease.outstanding for lease in leases))


def grant(
    budget: Budget,
    consumed: int,
    leases: tuple[LeaseView, ...],
    *,
    spenders: int,
    sizing: Sizing,
) -> int:
    """The slice for a new lease of one node (0: nothing is left).

    `leases` are the account's leases of the period, the renewing node's old one
    included (its outstanding part still counts until its final spend is reported);
    `spenders` counts the nodes spending from the account, the renewing one included.
    """
    left = remaining(budget, consumed, leases)
    fair = math.floor(left * sizing.share / max(1, spenders))
    return min(left, sizing.max_slice, max(fair, sizing.min_slice))
