"""The node's side of quota leases (appliance/quotas/leases.py), without I/O: what is
admitted under a lease, what is asked of the hub, and what a partition allows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.quotas.leases import LeaseBook, LeaseCall
from shared import protocol
from shared.errors import AccountLimit, ErrorCode
from tests.budget import tries

NOW = 1_000_000.0


def book(safe: int = 0) -> tuple[LeaseBook, list[int]]:
    nudges: list[int] = []
    leases = LeaseBook(lambda klass: safe, on_demand=lambda: nudges.append(1))
    return leases, nudges


def grant(
    leases: LeaseBook,
    account: str = "acme",
    tokens: int = 100,
    lease_id: str = "L1",
    now: float = NOW,
) -> None:
    call = leases.call(now)
    leases.apply(
        call,
        protocol.LeaseAnswer.model_validate(
            {"leases": [{"account": account, "lease_id": lease_id, "granted": tokens,
                         "expires_at": now + 60, "period_ends_at": now + 86_400}]}),
        now,
    )  # fmt: skip


def refused(leases: LeaseBook, cost: int = 10, now: float = NOW) -> str:
    with pytest.raises(AccountLimit) as caught:
        leases.take("acme", "S1", "r-refused", cost, now)
    assert caught.value.code in {ErrorCode.rate_limit_exceeded, ErrorCode.insufficient_quota}
    assert caught.value.retry_after is not None
    return str(caught.value)


def test_no_lease_yet_asks_the_hub_at_once_and_refuses_for_now() -> None:
    leases, nudges = book()
    assert "waiting for a quota lease" in refused(leases)
    assert nudges == [1]
    assert leases.call(NOW) == LeaseCall(("acme",), {})
    grant(leases)
    assert leases.take("acme", "S1", "r1", 10, NOW) == "L1"
    assert leases.call(NOW) == LeaseCall((), {})  # nothing due


def test_a_lease_admits_while_anything_is_unreserved_and_charges_what_was_used() -> None:
    leases, _ = book()
    grant(leases, tokens=100)
    assert leases.take("acme", "S1", "r1", 60, NOW) == "L1"
    # 40 unreserved: a request of 60 is admitted (it may overrun by its own worst case).
    assert leases.take("acme", "S1", "r2", 60, NOW) == "L1"
    refused(leases)  # nothing unreserved
    leases.settle("L1", "r1", 15)  # r1 used 15 of its 60
    lease = leases.current["acme"]
    assert (lease.spent, lease.room()) == (15, 25)
    assert leases.take("acme", "S1", "r3", 60, NOW) == "L1"


def test_a_lease_half_used_is_renewed_ahead_and_the_old_one_reported_final() -> None:
    leases, nudges = book()
    grant(leases, tokens=100)
    leases.take("acme", "S1", "r1", 10, NOW)
    leases.settle("L1", "r1", 10)
    assert leases.call(NOW).accounts == ()
    leases.take("acme", "S1", "r2", 45, NOW)  # 55 of 100 spent or reserved: due
    assert nudges
    assert leases.call(NOW).accounts == ("acme",)
    grant(leases, tokens=100, lease_id="L2")
    assert leases.current["acme"].id == "L2"
    # The old lease waits for its request in flight before its final spend is reported.
    assert leases.call(NOW).finals == {}
    leases.settle("L1", "r2", 30)
    call = leases.call(NOW)
    assert call.finals == {"L1": 40}
    leases.apply(call, protocol.LeaseAnswer(leases=[]), NOW)
    assert leases.retired == {}


def test_an_expired_lease_admits_nothing_and_is_reported() -> None:
    leases, _ = book()
    grant(leases, tokens=100)
    later = NOW + 61
    refused(leases, now=later)
    assert leases.call(later) == LeaseCall(("acme",), {"L1": 0})


def test_a_spent_budget_refuses_until_the_period_ends() -> None:
    leases, _ = book()
    grant(leases, tokens=0)
    message = refused(leases)
    assert "spent until the period ends" in message


def test_partitioned_the_node_spends_its_lease_then_only_safe_capacity() -> None:
    leases, _ = book(safe=0)
    grant(leases, tokens=20)
    leases.failed()  # the hub is unreachable
    assert leases.take("acme", "S1", "r1", 10, NOW) == "L1"
    assert leases.take("acme", "S1", "r2", 10, NOW) == "L1"
    assert "no safe capacity" in refused(leases)

    generous, _ = book(safe=30)
    generous.failed()
    assert generous.take("acme", "S1", "r1", 20, NOW) is None  # on safe capacity
    with pytest.raises(AccountLimit, match="safe capacity"):
        generous.take("acme", "S1", "r2", 20, NOW)


def test_lapsed_are_the_accounts_asked_for_without_a_live_lease_while_lease_calls_fail() -> None:
    leases, _ = book(safe=30)
    grant(leases, account="acme", tokens=20, lease_id="L1")
    grant(leases, account="globex", tokens=100, lease_id="L2")
    grant(leases, account="spent", tokens=0, lease_id="L3")  # its budget: spent till period end
    grant(leases, account="idle", tokens=100, lease_id="L4")  # never asked for again
    leases.failed(lease_call=True)
    assert leases.take("acme", "S1", "r1", 10, NOW) == "L1"  # half used: renewal asked
    assert leases.lapsed(NOW) == []  # but its lease still admits
    assert leases.take("acme", "S1", "r2", 10, NOW) == "L1"  # now it has no room left
    assert leases.lapsed(NOW) == ["acme"]
    assert leases.take("acme", "S1", "r3", 10, NOW) is None  # on safe capacity
    with pytest.raises(AccountLimit, match="spent until the period ends"):
        leases.take("spent", "S1", "r4", 10, NOW)  # refused for its budget, not a lease
    assert leases.take("globex", "S1", "r5", 10, NOW) == "L2"
    assert (leases.failures, leases.lapsed(NOW)) == (1, ["acme"])
    leases.failed()  # a heartbeat failed: not a lease call
    assert leases.failures == 1
    leases.failed(lease_call=True)
    assert leases.failures == 2
    # The leases run out of time while the hub stays away: globex is asked for again and
    # counts; idle, not asked for since, does not.
    later = NOW + 61
    assert leases.take("globex", "S1", "r6", 1, later) is None
    assert leases.lapsed(later) == ["acme", "globex"]
    # The hub answers: no failure in a row, nothing lapsed (whatever it granted).
    leases.apply(leases.call(later), protocol.LeaseAnswer(leases=[]), later)
    assert (leases.failures, leases.lapsed(later)) == (0, [])


def test_a_learning_hub_is_waited_for() -> None:
    leases, _ = book()
    call = leases.call(NOW)
    leases.apply(call, protocol.LeaseAnswer(leases=[], learning=True, retry_after_s=30), NOW)
    with pytest.raises(AccountLimit) as caught:
        leases.take("acme", "S1", "r1", 10, NOW)
    assert caught.value.retry_after == pytest.approx(30)
    assert leases.call(NOW).accounts == ("acme",)  # still wanted


def test_an_account_without_a_budget_on_the_hub_is_not_asked_again() -> None:
    leases, _ = book()
    refused(leases)
    call = leases.call(NOW)
    leases.apply(call, protocol.LeaseAnswer(leases=[]), NOW)
    assert leases.call(NOW) == LeaseCall((), {})


@settings(max_examples=tries(300), deadline=None)
@given(
    granted=st.integers(1, 500),
    steps=st.lists(st.tuples(st.booleans(), st.integers(1, 80), st.floats(0, 1)), max_size=80),
)
def test_a_lease_is_overrun_by_less_than_one_request(
    granted: int, steps: list[tuple[bool, int, float]]
) -> None:
    """Whatever the order of requests and their ends: spent + reserved stays below the
    grant plus the largest request's worst case, so the spend does too."""
    leases, _ = book()
    grant(leases, tokens=granted)
    lease = leases.current["acme"]
    in_flight: dict[str, int] = {}
    largest = 0
    for n, (start, cost, used) in enumerate(steps):
        if start:
            largest = max(largest, cost)
            try:
                assert leases.take("acme", "S1", f"r{n}", cost, NOW) == "L1"
                in_flight[f"r{n}"] = cost
            except AccountLimit:
                pass
        elif in_flight:
            request, worst = next(iter(in_flight.items()))
            del in_flight[request]
            leases.settle("L1", request, int(worst * used))
        assert lease.spent + sum(lease.reserved.values()) < granted + max(largest, 1)
