"""Quota leases: the pure planner's promise under random histories (hypothesis), and the
hub's lease API over a real SQLite ledger, learning mode included."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st
from wireguard_tools import WireguardKey

from hub.app import create_app
from hub.identity import certificates, ssl_context
from hub.planning.quota import Budget, LeaseView, Sizing, grant, remaining
from hub.settings import HubSettings
from hub.state.store import HubStore, open_store
from shared import pki, protocol
from tests.budget import tries
from tests.conftest import kvl
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase

# -- the planner ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Lease:
    node: int
    granted: int
    spent: int = 0  # what the node really spent
    seen: int = 0  # what reached the ledger
    final: bool = False

    def view(self, index: int) -> LeaseView:
        return LeaseView(
            str(index), str(self.node), self.granted, self.seen, self.spent if self.final else None
        )


# An operation: (kind, node or lease pick, amount pick)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["grant", "spend", "sync", "final"]),
        st.integers(0, 7),
        st.floats(0, 1),
    ),
    max_size=60,
)


@settings(max_examples=tries(300), deadline=None)
@given(
    budget=st.integers(0, 100_000),
    share=st.floats(0.05, 1.0),
    min_slice=st.integers(1, 5_000),
    max_slice=st.integers(1, 200_000),
    ops=OPS,
)
def test_leases_never_promise_more_than_is_left(
    budget: int,
    share: float,
    min_slice: int,
    max_slice: int,
    ops: list[tuple[str, int, float]],
) -> None:
    """Nodes spend within their leases, the ledger catches up in any order, finals come
    whenever: after every step, consumed + outstanding ≤ budget, and the real spend
    never exceeds the budget."""
    plan = Budget(budget, 86_400)
    sizing = Sizing(share, min_slice, max(min_slice, max_slice))
    leases: list[_Lease] = []
    for kind, pick, amount in ops:
        if kind == "grant":
            views = tuple(lease.view(i) for i, lease in enumerate(leases))
            consumed = sum(lease.seen for lease in leases)
            spenders = len({v.node_id for v in views if v.outstanding > 0} | {str(pick)})
            before = remaining(plan, consumed, views)
            tokens = grant(plan, consumed, views, spenders=spenders, sizing=sizing)
            assert 0 <= tokens <= before
            assert tokens <= sizing.max_slice
            if before >= sizing.min_slice:
                assert tokens >= min(sizing.min_slice, sizing.max_slice)
            if tokens:
                leases.append(_Lease(pick, tokens))
        elif leases:
            index = pick % len(leases)
            lease = leases[index]
            if kind == "spend" and not lease.final:
                more = int((lease.granted - lease.spent) * amount)
                leases[index] = replace(lease, spent=lease.spent + more)
            elif kind == "sync":
                leases[index] = replace(
                    lease, seen=lease.seen + int((lease.spent - lease.seen) * amount)
                )
            elif kind == "final":
                leases[index] = replace(lease, final=True)
        views = tuple(lease.view(i) for i, lease in enumerate(leases))
        consumed = sum(lease.seen for lease in leases)
        assert consumed + sum(v.outstanding for v in views) <= budget
        assert sum(lease.spent for lease in leases) <= budget


def test_a_lease_is_a_fair_share_of_what_is_left() -> None:
    plan = Budget(10_000, 86_400)
    sizing = Sizing(share=0.5, min_slice=1_000, max_slice=1_000_000)
    assert grant(plan, 0, (), spenders=1, sizing=sizing) == 5_000
    first = LeaseView("a", "n1", 5_000, 0, None)
    # Half of the 5,000 left, split between two spenders; never below the minimum.
    assert grant(plan, 0, (first,), spenders=2, sizing=sizing) == 1_250
    assert grant(plan, 0, (first,), spenders=9, sizing=sizing) == 1_000
    # The node reported a final spend of 800 and the ledger saw 300 of it: 500 still
    # outstanding, 300 consumed.
    done = LeaseView("a", "n1", 5_000, 300, 800)
    assert remaining(plan, 300, (done,)) == 9_200
    # Less than the minimum left: what is left.
    assert grant(Budget(600, 86_400), 0, (), spenders=1, sizing=sizing) == 600
    assert grant(Budget(600, 86_400), 600, (), spenders=1, sizing=sizing) == 0


def test_periods_are_aligned_to_the_epoch() -> None:
    day = Budget(1, 86_400)
    assert day.period(86_400 * 3 + 5) == (86_400 * 3, 86_400 * 4)


# -- the hub's lease API -------------------------------------------------------------------


def _hub(tmp_path: Path, database: HubDatabase) -> HubSettings:
    return settings_for(
        tmp_path, database, quota={"lease_s": 30, "share": 0.5, "min_slice_tokens": 100}
    )


def _enroll(store: HubStore, name: str) -> tuple[str, str]:
    token = store.tokens.create("s", uses=1, expires_in_s=60).plaintext
    enrolled = store.nodes.enroll(
        token,
        name=name,
        wg_public_key=str(WireguardKey.generate().public_key()),
        overlay_prefix="100.64.0.0/10",
        labels={},
        versions={},
    )
    return enrolled.node.id, enrolled.node_token


def _usage(
    event_id: str, lease_id: str | None, tokens: int, account: str = "acme"
) -> dict[str, Any]:
    return {
        "id": event_id,
        "kind": "usage",
        "body": {"account": account, "lease_id": lease_id, "tokens_in": tokens, "tokens_out": 0,
                 "created_at": "2026-11-30T10:00:00+00:00"},
    }  # fmt: skip


async def test_nodes_lease_slices_of_a_budget_and_the_ledger_reconciles_them(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = _hub(tmp_path, hub_database)
    store = open_store(hub)
    store.accounts.put("acme", "S1", budget=Budget(10_000, 86_400))
    store.accounts.put("free", "S1")  # no budget: no lease
    a, a_token = _enroll(store, "node-a")
    b, b_token = _enroll(store, "node-b")
    store.close()
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    url = f"https://127.0.0.1:{server.port}"

    async def call(token: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with aiohttp.ClientSession() as client:
            answer = await client.post(
                url + path,
                json=body,
                headers={"Authorization": f"Bearer {token}", **protocol.HEADERS},
                ssl=pin,
            )
            assert answer.status == 200, await answer.text()
            result: dict[str, Any] = await answer.json()
            return result

    first = await call(a_token, "/v1/node/leases", {"accounts": ["acme", "free"]})
    assert first["learning"] is False  # a fresh hub has no lease to learn about
    [lease_a] = first["leases"]  # only the budgeted account
    assert (lease_a["account"], lease_a["granted"]) == ("acme", 5_000)
    assert lease_a["expires_at"] <= time.time() + 30.5
    [lease_b] = (await call(b_token, "/v1/node/leases", {"accounts": ["acme"]}))["leases"]
    assert lease_b["granted"] == 1_250  # half of the 5,000 left, between two spenders

    # Node A spent 700 and synced 400 of it; it retires its lease with a final of 700.
    await call(a_token, "/v1/node/events", {"events": [_usage("e1", lease_a["lease_id"], 400)]})
    await call(a_token, "/v1/node/leases", {"finals": {lease_a["lease_id"]: 700}})
    store = open_store(hub)
    try:
        quota = store.leases.quota("acme", time.time())
        assert quota is not None
        assert quota.consumed == 400
        assert quota.leased == {a: 300, b: 1_250}  # A's unsynced 300, B's whole lease
        assert quota.remaining == 10_000 - 400 - 300 - 1_250
        assert store.leases.quota("free", time.time()) is None
    finally:
        store.close()
    # The rest of A's usage arrives, and again (a lost acknowledgement): counted once.
    for _ in range(2):
        await call(a_token, "/v1/node/events", {"events": [_usage("e2", lease_a["lease_id"], 300)]})
    store = open_store(hub)
    try:
        quota = store.leases.quota("acme", time.time())
        assert quota is not None
        assert (quota.consumed, quota.leased) == (700, {b: 1_250})
    finally:
        store.close()
    view = kvl("hub", "accounts", "quota", "acme", "--data-dir", str(hub.data_dir)).stdout
    assert "consumed 700, leased 1250, remaining 8050" in view
    assert "node-b" in view
    await server.close()

    # A restarted hub learns first: B may still be spending its lease, so nothing new
    # until B reports (or a lease period passes).
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    url = f"https://127.0.0.1:{server.port}"
    learning = await call(a_token, "/v1/node/leases", {"accounts": ["acme"]})
    assert learning["learning"] is True
    assert learning["leases"] == []
    assert learning["retry_after_s"] > 0
    reported = await call(b_token, "/v1/node/leases", {"finals": {lease_b["lease_id"]: 1_000}})
    assert reported["learning"] is False
    [again] = (await call(a_token, "/v1/node/leases", {"accounts": ["acme"]}))["leases"]
    # 10,000 - 700 consumed - B's 1,000 unsynced = 8,300 left; half of it, two spenders.
    assert again["granted"] == 8_300 * 0.5 // 2
