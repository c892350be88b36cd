"""The node's side of quota leases (hub/planning/quota.py has the hub's).

An account with a global budget on the hub (`budget_tokens` in the desired state) is
served here only under a lease: a slice of its budget the hub granted this node until an
expiry. A request is admitted while some of the lease is unreserved; it reserves its
worst case (prompt plus max_tokens) and charges what it really used when it ends, so
the node overruns a lease by at most the requests in flight when it ran out. Leases are
renewed ahead of time (when half their time or half their tokens are gone), on demand
when one runs out, and the ones this node has stopped using are reported back with their
final spend, which frees the rest for other nodes.

When the hub is unreachable the node spends what its lease holds, then falls back to
its class's safe capacity (`classes.sN.safe_tokens_per_minute`, 0 = refuse): the
operator chooses how much a partitioned site may overspend. Usage events carry their
lease's id, so the hub reconciles each lease from its ledger. Heartbeats report the
trouble (`lapsed`, `failures`): the accounts served without a live lease since lease calls
began to fail, which the hub alerts on (`lease_lapsed`) once it has lasted.

No I/O here: the fleet link calls the hub and persists the leases; the admission control
asks `take` and `settle`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from appliance.quotas.buckets import TokenBucket
from shared.errors import QuotaExhausted, RateLimited

if TYPE_CHECKING:
    from collections.abc import Callable

    from shared import protocol

MINUTE_S = 60.0
RENEW_AT = 0.5  # renew when this share of a lease's time or tokens is gone
FINAL_GRACE_S = (
    120.0  # a retired lease with requests still reserved is final this long after expiry
)


@dataclass
class HeldLease:
    id: str
    account: str
    granted: int
    granted_at: float
    expires_at: float
    period_ends_at: float
    spent: int = 0  # committed usage charged to it
    reserved: dict[str, int] = field(default_factory=dict)  # request id -> worst case

    def room(self) -> int:
        return self.granted - self.spent - sum(self.reserved.values())

    def due(self, now: float) -> bool:
        """Half of its time or half of its tokens are gone: time to ask for the next."""
        lifetime = max(1e-9, self.expires_at - self.granted_at)
        return (now - self.granted_at) / lifetime >= RENEW_AT or self.room() <= self.granted * (
            1 - RENEW_AT
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "account": self.account,
            "granted": self.granted,
            "granted_at": self.granted_at,
            "expires_at": self.expires_at,
            "period_ends_at": self.period_ends_at,
        }


@dataclass(frozen=True)
class LeaseCall:
    """What to send the hub: accounts wanting a new lease, and final spends."""

    accounts: tuple[str, ...]
    finals: dict[str, int]

    def __bool__(self) -> bool:
        return bool(self.accounts or self.finals)


class LeaseBook:
    def __init__(
        self,
        safe_tokens_per_minute: Callable[[str], int],
        *,
        on_demand: Callable[[], None] | None = None,
    ) -> None:
        self._safe = safe_tokens_per_minute  # class name -> tokens per minute
        self.on_demand = on_demand  # ask the hub now (set by the fleet link)
        self.current: dict[str, HeldLease] = {}  # account -> the lease it spends
        self.retired: dict[str, HeldLease] = {}  # lease id -> awaiting its final report
        self._wanted: set[str] = set()  # accounts refused for want of a lease
        self._exhausted: dict[str, float] = {}  # account -> end of its spent period
        self._buckets: dict[str, TokenBucket] = {}  # account -> safe capacity
        self.reachable: bool | None = None  # the last call to the hub: None before the first
        self.learning_until = 0.0
        # Lease calls failed in a row (a heartbeat's failure is not counted: the hub may
        # take heartbeats and still fail lease calls, and only these renew leases).
        self.failures = 0

    # -- admission -----------------------------------------------------------------------

    def take(self, account: str, klass: str, request_id: str, cost: int, now: float) -> str | None:
        """Reserve `cost` tokens for a request: the lease's id, or None when it runs on the
        class's safe capacity (the hub unreachable). Raises QuotaExhausted (the
        budget is spent) or RateLimited (waiting for a lease, or safe capacity)."""
        lease = self.current.get(account)
        # Admitted while anything of the lease is unreserved: a request may then overrun
        # it by at most its own worst case, which bounds the overspend by the requests in
        # flight (never by time, and never by a lease too small for one request).
        if lease is not None and now < lease.expires_at and lease.room() > 0:
            lease.reserved[request_id] = cost
            if lease.due(now):
                self._demand(account)
            return lease.id
        self._demand(account)
        if self._exhausted.get(account, 0.0) > now:
            wait = self._exhausted[account] - now
            raise QuotaExhausted(
                f"the account's budget across the fleet is spent until the period ends "
                f"(in {math.ceil(wait)} s)",
                retry_after=wait,
            )
        if self.reachable is False:
            self._safe_capacity(account, klass, cost, now)
            return None
        wait = max(1.0, self.learning_until - now)
        raise RateLimited(
            "this node is waiting for a quota lease from the hub for the account's budget",
            retry_after=wait,
        )

    def _safe_capacity(self, account: str, klass: str, cost: int, now: float) -> None:
        per_minute = self._safe(klass)
        if per_minute <= 0:
            raise RateLimited(
                "the hub is unreachable and this node's lease for the account's budget is "
                f"spent; class {klass} has no safe capacity (classes.{klass.lower()}"
                ".safe_tokens_per_minute)",
                retry_after=5,
            )
        bucket = self._buckets.get(account)
        if bucket is None or bucket.capacity != per_minute:
            bucket = TokenBucket.full(per_minute, MINUTE_S, now)
            self._buckets[account] = bucket
        if (wait := bucket.take(cost, now)) > 0:
            raise RateLimited(
                f"the hub is unreachable; class {klass}'s safe capacity ({per_minute} tokens "
                f"a minute) is spent; retry after {math.ceil(wait)} s",
                retry_after=wait,
            )

    def settle(self, lease_id: str | None, request_id: str, tokens: int) -> None:
        """The request ended having used `tokens` (0: it failed before any)."""
        if lease_id is None:
            return
        lease = self.retired.get(lease_id) or next(
            (held for held in self.current.values() if held.id == lease_id), None
        )
        if lease is None:
            return  # reported final already (expired long ago)
        lease.reserved.pop(request_id, None)
        lease.spent += tokens

    def _demand(self, account: str) -> None:
        if account not in self._wanted:
            self._wanted.add(account)
            if self.on_demand is not None:
                self.on_demand()

    # -- the link ------------------------------------------------------------------------

    def call(self, now: float) -> LeaseCall:
        """What the next call to the hub should carry."""
        accounts = set(self._wanted)
        for account, lease in self.current.items():
            # Leases in use are renewed ahead; an idle one just runs out.
            if lease.due(now) and (lease.spent or lease.reserved):
                accounts.add(account)
        finals = {
            lease.id: lease.spent
            for lease in self.retired.values()
            if not lease.reserved or now >= lease.expires_at + FINAL_GRACE_S
        }
        # An expired lease is spent: retire it, so its final goes with the next call.
        for lease in self.current.values():
            if now >= lease.expires_at and not lease.reserved:
                finals[lease.id] = lease.spent
        return LeaseCall(tuple(sorted(accounts)), finals)

    def apply(self, call: LeaseCall, answer: protocol.LeaseAnswer, now: float) -> None:
        """The hub answered `call`."""
        self.reachable = True
        self.failures = 0
        for lease_id in call.finals:
            self.retired.pop(lease_id, None)
            for account, held in list(self.current.items()):
                if held.id == lease_id:
                    del self.current[account]
        if answer.learning:
            self.learning_until = now + (answer.retry_after_s or 5.0)
            return
        for granted in answer.leases:
            account = granted.account
            self._wanted.discard(account)
            if granted.granted <= 0:
                self._exhausted[account] = granted.period_ends_at
                continue
            self._exhausted.pop(account, None)
            old = self.current.get(account)
            if old is not None:
                self.retired[old.id] = old
            self.current[account] = HeldLease(
                id=granted.lease_id,
                account=account,
                granted=granted.granted,
                granted_at=now,
                expires_at=granted.expires_at,
                period_ends_at=granted.period_ends_at,
            )
        # Accounts the hub knows no budget for need no lease.
        asked = set(call.accounts)
        answered = {g.account for g in answer.leases}
        self._wanted -= asked - answered

    def failed(self, *, lease_call: bool = False) -> None:
        """The hub could not be reached (`lease_call`: by a lease call, counted in
        `failures`)."""
        self.reachable = False
        if lease_call:
            self.failures += 1

    def lapsed(self, now: float) -> list[str]:
        """The accounts served without a live lease because the hub could not renew it:
        asked for (a request came) while the last lease call failed, with no lease that
        admits. Not an account whose budget is spent for the period (refused for its
        budget, not for want of a lease), nor one idle since its lease ran out."""
        if not self.failures:
            return []
        return sorted(
            account
            for account in self._wanted
            if not self._live(account, now) and self._exhausted.get(account, 0.0) <= now
        )

    def _live(self, account: str, now: float) -> bool:
        lease = self.current.get(account)
        return lease is not None and now < lease.expires_at and lease.room() > 0

    # -- persistence (the fleet link stores these) ---------------------------------------

    def held(self) -> list[tuple[HeldLease, bool]]:
        """Every lease with whether it is current."""
        return [(lease, True) for lease in self.current.values()] + [
            (lease, False) for lease in self.retired.values()
        ]

    def restore(self, leases: list[tuple[HeldLease, bool]]) -> None:
        """After a restart: the leases kept, their spend already summed from usage."""
        for lease, current in leases:
            if current:
                self.current[lease.account] = lease
            else:
                self.retired[lease.id] = lease
