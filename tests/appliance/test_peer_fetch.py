"""A site's nodes share model files (protocol 10): a real hub and two real appliances on
loopback, one site. A model placed on both crosses the site's link to the hub once: the
node with the lower id fetches it from the hub, the other waits for it and fetches it from
there with the hub's ticket. A peer asked without a ticket, with a forged one, one for
another file or site, or an expired one, sends nothing."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from appliance.gateway.appkeys import METRICS, REGISTRY
from hub.app import create_app as create_hub
from hub.appkeys import METRICS as HUB_METRICS
from hub.identity import ssl_context
from shared import peer_tickets, pki
from shared.errors import ErrorCode
from tests.appliance.fleet_nodes import FleetNode, join, placement_hub
from tests.conftest import kvl, write_script
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from aiohttp import web
    from pytest_aiohttp import AiohttpServer

    from appliance.state.records import ModelRecord
    from hub.settings import HubSettings


def _placed_on(node: FleetNode) -> Callable[[], bool]:
    return lambda: "placed@1" in {r.ref for r in node.app[REGISTRY].served()}


@dataclass
class Site:
    """A hub with `placed@1` (a model script of `kib` KiB) deployed on two replicas."""

    hub: HubSettings
    app: web.Application
    port: int
    placed: Path

    def sent(self) -> float | None:
        """What the hub sent of its files to the site `site` (its nodes' tokens' site)."""
        return self.app[HUB_METRICS].registry.get_sample_value(
            "kvl_hub_artifact_bytes_total", {"site": "site"}
        )

    async def join(
        self, aiohttp_server: AiohttpServer, tmp_path: Path, record: ModelRecord, name: str
    ) -> FleetNode:
        return await join(
            aiohttp_server, tmp_path, record, self.hub, self.port, name=name,
            model={"n_ctx": 512, "n_threads": 1, "n_slots": 1},
            fleet={"peer_addresses": ["127.0.0.1"], "peer_wait_s": 120},
        )  # fmt: skip


async def _site(aiohttp_server: AiohttpServer, tmp_path: Path, kib: int) -> Site:
    hub = placement_hub(tmp_path)
    data = str(hub.data_dir)
    placed = write_script(tmp_path / "placed.json", reply="Placed. " + "x" * (kib << 10))
    kvl("hub", "models", "add", str(placed), "--name", "placed", "--version", "1",
        "--data-dir", data)  # fmt: skip
    kvl("hub", "deploy", "placed@1", "--replicas", "2", "--data-dir", data)
    app = create_hub(hub)
    server = await aiohttp_server(app, ssl=ssl_context(hub))
    assert server.port is not None
    return Site(hub, app, server.port, placed)


async def test_a_model_placed_on_two_nodes_of_a_site_crosses_its_link_once(
    aiohttp_server: AiohttpServer, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    # As large as a model script may be (a megabyte): a file worth not fetching twice.
    site = await _site(aiohttp_server, tmp_path, 1000)
    nodes = [
        await site.join(aiohttp_server, tmp_path, scripted_model, "node-a"),
        await site.join(aiohttp_server, tmp_path, scripted_model, "node-b"),
    ]
    for node in nodes:
        await until(_placed_on(node), "placed@1 on both nodes", timeout_s=90)

    size = site.placed.stat().st_size
    sent = site.sent()
    assert sent == size, f"the hub sent {sent} bytes of a {size}-byte file to the site"
    served = [
        node.app[METRICS].registry.get_sample_value("kvl_fleet_peer_bytes_served_total") or 0
        for node in nodes
    ]
    # One node sent it to the other (and the byte of its first ask, whether it held it).
    assert sorted(served) == [0, size + 1], served
    await _hostile_asks(nodes, site.hub, hashlib.sha256(site.placed.read_bytes()).hexdigest())


async def _hostile_asks(nodes: list[FleetNode], hub: HubSettings, sha256: str) -> None:
    """Tickets that are missing, forged, or not for this file, site or time: refused."""
    holder = nodes[0]
    url = f"{holder.base_url}{peer_tickets.PEER_ARTIFACTS}/{sha256}"
    signing = _signing(hub)
    node_id = "n-1"
    now = int(time.time())
    good = peer_tickets.issue(signing, peer_tickets.Claims(sha256, "site", node_id, now + 60))
    forger = pki.new_ca("not the hub")
    wrong: list[tuple[str | None, str]] = [
        (None, "ticket"),
        ("garbage", "not a peer ticket"),
        (good[:-4] + "AAAA", "not signed"),
        (peer_tickets.issue(forger.key_pem, peer_tickets.Claims(sha256, "site", node_id,
                                                                now + 60)), "not signed"),
        (peer_tickets.issue(signing, peer_tickets.Claims("0" * 64, "site", node_id, now + 60)),
         "another file"),
        (peer_tickets.issue(signing, peer_tickets.Claims(sha256, "elsewhere", node_id,
                                                         now + 60)), "another site"),
        (peer_tickets.issue(signing, peer_tickets.Claims(sha256, "site", node_id, now - 1)),
         "expired"),
    ]  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for ticket, why in wrong:
            headers = {} if ticket is None else {peer_tickets.PEER_TICKET_HEADER: ticket}
            async with session.get(url, headers=headers) as answer:
                body = await answer.json()
                assert answer.status == 403, (why, body)
                assert body["error"]["code"] == ErrorCode.peer_ticket_refused
                assert why in body["error"]["message"], (why, body)
        async with session.get(url, headers={peer_tickets.PEER_TICKET_HEADER: good}) as answer:
            assert answer.status == 200
            assert hashlib.sha256(await answer.read()).hexdigest() == sha256
        other = f"{holder.base_url}{peer_tickets.PEER_ARTIFACTS}/{'1' * 64}"
        ticket = peer_tickets.issue(
            signing, peer_tickets.Claims("1" * 64, "site", node_id, now + 60)
        )
        async with session.get(other, headers={peer_tickets.PEER_TICKET_HEADER: ticket}) as answer:
            assert answer.status == 404
        async with session.get(f"{holder.base_url}{peer_tickets.PEER_ARTIFACTS}/nothex") as answer:
            assert answer.status == 404


def _signing(hub: HubSettings) -> bytes:
    from hub.certificates import Authority  # noqa: PLC0415

    return Authority(hub).phase().signing.key_pem


async def test_a_peer_that_is_gone_is_passed_over_for_the_hub(
    aiohttp_server: AiohttpServer, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    site = await _site(aiohttp_server, tmp_path, 100)
    first = await site.join(aiohttp_server, tmp_path, scripted_model, "node-a")
    await until(_placed_on(first), "placed@1 on the first node", timeout_s=90)
    await first.server.close()  # gone, though the hub still counts it in the site
    second = await site.join(aiohttp_server, tmp_path, scripted_model, "node-b")
    await until(_placed_on(second), "placed@1 on the second node", timeout_s=90)
    # The second fetched it from the hub too.
    assert site.sent() == 2 * site.placed.stat().st_size
