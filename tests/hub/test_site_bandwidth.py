"""A site's bandwidth (hub/fleet/bandwidth.py, `kvl hub releases bandwidth`): the files a
site's nodes fetch from a real hub share one bucket, so two nodes of a narrow site fetching
a model at once take at least as long as the site's rate allows, while the bucket's own
arithmetic holds on a clock of the test's."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING

import aiohttp
from wireguard_tools import WireguardKey

from appliance.fleet.client import HubClient
from hub.app import create_app
from hub.fleet.bandwidth import SiteBandwidth
from hub.identity import certificates, ssl_context
from hub.state.store import open_store
from shared import pki, protocol
from tests.conftest import kvl
from tests.hfhub import tiny_gguf
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings

RATE = 2_000_000  # bytes a second
SIZE = 3 * 2**20


async def test_the_bucket_lets_a_second_through_then_paces_each_chunk() -> None:
    now = [100.0]
    waited: list[float] = []

    async def sleep(seconds: float) -> None:
        waited.append(seconds)

    bandwidth = SiteBandwidth(clock=lambda: now[0], sleep=sleep)
    pace = bandwidth.pacer("lab", 1000)
    await pace(1000)  # a second's worth at once
    assert waited == []
    await pace(500)  # half a second more
    assert waited == [0.5]
    now[0] += 10  # idle: the bucket fills up to a second's worth, no more
    await pace(1000)
    assert waited == [0.5]
    await pace(2000)
    assert waited == [0.5, 2.0]
    # Another site has a bucket of its own.
    other = bandwidth.pacer("office", 1000)
    await other(1000)
    assert waited == [0.5, 2.0]


def _key() -> str:
    return str(WireguardKey.generate().public_key())


def _placed(hub: HubSettings) -> int:
    store = open_store(hub)
    try:
        return len(store.deployments.placements())
    finally:
        store.close()


async def test_two_nodes_of_a_site_share_its_bandwidth(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path, fleet={"placement_every_s": 0.3})
    blob = tiny_gguf("shared", SIZE)
    source = tmp_path / "weights.gguf"
    source.write_bytes(blob)
    data = str(hub.data_dir)
    kvl("hub", "models", "add", str(source), "--name", "tiny", "--version", "1", "--data-dir", data)
    kvl("hub", "deploy", "tiny@1", "--replicas", "2", "--data-dir", data)
    said = kvl("hub", "releases", "bandwidth", "lab", "--rate", "2M", "--data-dir", data)
    assert said.stdout.strip() == f"site lab: {RATE} bytes a second"
    store = open_store(hub)
    tokens = [store.tokens.create("lab", uses=1, expires_in_s=60).plaintext for _ in range(2)]
    nodes = [
        store.nodes.enroll(token, name=f"n{i}", wg_public_key=_key(),
                           overlay_prefix="100.64.0.0/10", labels={}, versions={})
        for i, token in enumerate(tokens)
    ]  # fmt: skip
    assert store.rollouts.bandwidths() == {"lab": RATE}
    store.close()
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    clients = [HubClient(f"https://127.0.0.1:{server.port}", pin, n.node_token) for n in nodes]
    sha256 = hashlib.sha256(blob).hexdigest()
    try:
        for client in clients:
            await client.heartbeat({}, protocol.Capacity(model_memory_mib=10_000))
        await until(lambda: _placed(hub) == 2, "both replicas placed", 60)

        async def fetch(client: HubClient) -> bytes:
            response = await client.artifact(sha256)
            try:
                assert response.status == 200
                return await response.read()
            finally:
                response.release()

        started = time.monotonic()
        got = await asyncio.gather(*(fetch(c) for c in clients))
        took = time.monotonic() - started
        assert got == [blob, blob]
        # Two files through one bucket: all but its first second's worth at its rate.
        assert took >= (2 * SIZE - RATE) / RATE * 0.95, took
    finally:
        for client in clients:
            await client.close()
    # Unlimited again.
    assert "no limit" in kvl("hub", "releases", "bandwidth", "lab", "--unlimited",
                             "--data-dir", data).stdout  # fmt: skip
