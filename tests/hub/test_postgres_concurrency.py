"""Two hub replicas on one PostgreSQL database, at once: two real aiohttp servers on
loopback (HTTPS), each with its own store thread and connection, called concurrently.
Enrollment never hands out an address twice nor spends a single-use token twice; the same
events ingested by both replicas are counted once; concurrent lease grants never promise
more than the budget."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from wireguard_tools import WireguardKey

from hub.app import create_app
from hub.fleet.heartbeats import HEARTBEATS_EVERY_S
from hub.identity import certificates, ssl_context
from hub.planning.quota import Budget
from hub.settings import HubSettings
from hub.state.store import open_store
from shared import pki, protocol
from tests.hubs import settings_for

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.postgres import Cluster

pytestmark = pytest.mark.postgres

BUDGET = 10_000


@pytest.fixture
def hub(tmp_path: Path, postgres: Cluster) -> HubSettings:
    return settings_for(
        tmp_path,
        {"database_url": postgres.create()},
        # Every grant takes all that is left: a grant made without seeing the one
        # before it would promise the whole budget a second time.
        quota={"share": 1.0, "min_slice_tokens": BUDGET, "max_slice_tokens": BUDGET},
    )


class Replicas:
    """The replicas' base URLs and one pinned client session for all of them."""

    def __init__(self, urls: list[str], session: aiohttp.ClientSession) -> None:
        self.urls = urls
        self.session = session
        self._next = itertools.cycle(urls)

    async def post(
        self, path: str, body: dict[str, Any], *, token: str | None = None, url: str | None = None
    ) -> tuple[int, Any]:
        headers = (
            {"Authorization": f"Bearer {token}", **protocol.HEADERS} if token else protocol.HEADERS
        )
        async with self.session.post(
            (url or next(self._next)) + path, json=body, headers=headers
        ) as response:
            return response.status, await response.json()


@pytest.fixture
async def replicas(aiohttp_server: AiohttpServer, hub: HubSettings) -> AsyncIterator[Replicas]:
    servers = [await aiohttp_server(create_app(hub), ssl=ssl_context(hub)) for _ in range(2)]
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pin)) as session:
        yield Replicas([f"https://127.0.0.1:{s.port}" for s in servers], session)


def _key() -> str:
    return str(WireguardKey.generate().public_key())


async def test_two_replicas_enrolling_at_once_hand_out_each_address_and_use_once(
    replicas: Replicas, hub: HubSettings
) -> None:
    store = open_store(hub)
    # Ten tokens of 7 uses: enrollments with different tokens race for the same address
    # (those with one token also queue on its row).
    many = [store.tokens.create("lab", uses=7, expires_in_s=600).plaintext for _ in range(10)]
    once = store.tokens.create("lab", uses=1, expires_in_s=600).plaintext
    store.close()
    keys = [_key() for _ in range(110)]

    async def enroll(index: int, token: str) -> tuple[int, Any]:
        body = {"token": token, "name": f"node-{index}", "wg_public_key": keys[index]}
        return await replicas.post("/v1/enroll", body)

    # 9 enrollments for each token's 7 uses, and 20 for the single use, interleaved and
    # alternating between the replicas.
    answers = await asyncio.gather(
        *(enroll(i, many[i % 10]) for i in range(90)), *(enroll(90 + i, once) for i in range(20))
    )
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {201, 401}, answers  # never a 500: no constraint broke
    for t in range(10):
        assert statuses[t:90:10].count(201) == 7
    assert statuses[90:].count(201) == 1
    addresses = [body["overlay_address"] for status, body in answers if status == 201]
    assert len(set(addresses)) == 71

    store = open_store(hub)
    try:
        nodes = store.nodes.all()
        assert len(nodes) == 71
        assert sorted(n.overlay_address for n in nodes) == sorted(addresses)
        assert {t.uses_left for t in store.tokens.all()} == {0}
        # Nothing was skipped either: the 71 addresses after the hub's.
        assert {int(a.rsplit(".", 1)[1]) for a in addresses} == set(range(2, 73))
    finally:
        store.close()


async def test_the_same_events_through_two_replicas_are_counted_once(
    replicas: Replicas, hub: HubSettings
) -> None:
    store = open_store(hub)
    store.accounts.put("acme", "S1")
    token = store.tokens.create("lab", uses=1, expires_in_s=600).plaintext
    node = store.nodes.enroll(
        token, name="n", wg_public_key=_key(), overlay_prefix=hub.overlay.prefix,
        labels={}, versions={},
    )  # fmt: skip
    store.close()
    events = [
        {"id": f"ev-{i:05d}", "kind": "usage",
         "body": {"account": "acme", "tokens_in": 3, "tokens_out": 4}}
        for i in range(600)
    ]  # fmt: skip
    # Batches that overlap, each sent to both replicas at the same moment, in both orders:
    # what a node resending after lost acknowledgements, to whichever replica, would do.
    batches = [events[start : start + 200] for start in range(0, 500, 100)]
    calls = []
    for batch in batches:
        for url, order in zip(replicas.urls, (batch, batch[::-1]), strict=True):
            calls.append(
                replicas.post("/v1/node/events", {"events": order}, token=node.node_token, url=url)
            )
    answers = await asyncio.gather(*calls)
    assert all(status == 200 for status, _ in answers), answers
    assert sum(body["new"] for _, body in answers) == len(events)
    store = open_store(hub)
    try:
        assert store.ledger.count() == len(events)
        assert store.leases.consumed("acme", 0, time.time() + 86_400) == 7 * len(events)
    finally:
        store.close()


async def test_a_node_revoked_through_one_replica_is_refused_by_both(
    replicas: Replicas, hub: HubSettings
) -> None:
    """Each replica remembers the node tokens it checked. The revoking replica refuses the
    node on its next call; the other within the second its heartbeat flusher reads the
    authentication revision in; neither ever accepts it again."""
    store = open_store(hub)
    token = store.tokens.create("lab", uses=1, expires_in_s=600).plaintext
    node = store.nodes.enroll(
        token, name="n", wg_public_key=_key(), overlay_prefix=hub.overlay.prefix,
        labels={}, versions={},
    )  # fmt: skip
    operator = store.operators.create("ops").plaintext
    store.close()
    first, second = replicas.urls
    for url in replicas.urls:  # both now remember the token
        assert (await replicas.post("/v1/node/heartbeat", {}, token=node.node_token, url=url))[
            0
        ] == 200
    status, _ = await replicas.post(
        f"/v1/admin/nodes/{node.node.id}/revoke", {}, token=operator, url=first
    )
    assert status == 200
    status, body = await replicas.post("/v1/node/heartbeat", {}, token=node.node_token, url=first)
    assert (status, body["error"]["code"]) == (403, "node_revoked")
    deadline = time.monotonic() + 3 * HEARTBEATS_EVERY_S
    while True:
        status, body = await replicas.post(
            "/v1/node/heartbeat", {}, token=node.node_token, url=second
        )
        if status != 200 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert (status, body["error"]["code"]) == (403, "node_revoked")
    for url in replicas.urls:
        status, _ = await replicas.post("/v1/node/heartbeat", {}, token=node.node_token, url=url)
        assert status == 403


async def test_concurrent_lease_grants_through_two_replicas_stay_within_the_budget(
    replicas: Replicas, hub: HubSettings
) -> None:
    store = open_store(hub)
    accounts = [f"acct-{i}" for i in range(10)]
    for account in accounts:
        store.accounts.put(account, "S1", budget=Budget(BUDGET, 86_400))
    tokens = []
    for i in range(4):
        enrollment = store.tokens.create("lab", uses=1, expires_in_s=600).plaintext
        tokens.append(
            store.nodes.enroll(
                enrollment, name=f"n{i}", wg_public_key=_key(),
                overlay_prefix=hub.overlay.prefix, labels={}, versions={},
            ).node_token
        )  # fmt: skip
    store.close()
    # A fresh replica learns (grants nothing) until the nodes holding leases have called
    # it; before any lease exists, one call ends that on each.
    for url in replicas.urls:
        status, body = await replicas.post("/v1/node/leases", {}, token=tokens[0], url=url)
        assert (status, body["learning"]) == (200, False)

    # Every node asks for a lease of every account on both replicas at once.
    calls = [
        replicas.post("/v1/node/leases", {"accounts": [account]}, token=token, url=url)
        for account in accounts
        for token in tokens
        for url in replicas.urls
    ]
    answers = await asyncio.gather(*calls)
    assert all(status == 200 for status, _ in answers), answers
    granted: dict[str, int] = dict.fromkeys(accounts, 0)
    for _, body in answers:
        for lease in body["leases"]:
            granted[lease["account"]] += lease["granted"]
    # Each grant took all that was left, so exactly one per account got the budget.
    assert granted == dict.fromkeys(accounts, BUDGET)
    store = open_store(hub)
    try:
        for account in accounts:
            quota = store.leases.quota(account, time.time())
            assert quota is not None
            assert quota.remaining == 0
            assert sum(quota.leased.values()) == BUDGET
    finally:
        store.close()


async def test_a_simulated_fleet_spread_over_two_replicas_lands_once(
    replicas: Replicas, hub: HubSettings
) -> None:
    from tests.benchmarks.simulate import Simulator  # noqa: PLC0415

    store = open_store(hub)
    token = store.tokens.create("simulated", uses=30, expires_in_s=600).plaintext
    store.accounts.put("simulated", "S1")  # the account its usage events are for
    store.close()
    fingerprint = certificates(hub)[1].fingerprint
    async with Simulator(replicas.urls, fingerprint, connections=8) as sim:
        nodes, enrolled = await sim.enroll(token, 30)
        assert enrolled.summary()["failed"] == {}
        assert {n.url for n in nodes} == set(replicas.urls)
        # Half the syncs are sent again to the other replica.
        load = await sim.run(nodes, interval_s=0.5, duration_s=1.0, events=4, resend=0.5)
    summary = load.summary()
    assert summary["heartbeats"]["failed"] == summary["sync"]["failed"] == {}
    assert summary["sync"]["resent"] > 0
    assert summary["sync"]["new"] == summary["sync"]["events"] == 30 * 2 * 4
    store = open_store(hub)
    try:
        assert store.ledger.count() == 240
        assert len({n.overlay_address for n in store.nodes.all()}) == 30
    finally:
        store.close()
