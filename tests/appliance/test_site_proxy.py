"""A site's HTTPS proxy (`fleet.https_proxy`, from the provisioning file's `network` on the
image): a node behind a real proxy (Debian's tinyproxy, on loopback) enrolls with its hub
and sends its heartbeats through it, the proxy's log shows each call's tunnel to the hub,
and with the proxy gone the node cannot reach its hub; `no_proxy` sends a host direct."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import pytest

from appliance.fleet.client import Proxy
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from hub.state.store import open_store
from image.network import proxy_environment
from shared.provisioning import Provisioning
from tests.appliance.fleet_nodes import join, placement_hub
from tests.site_proxy import SiteProxy, tinyproxy
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from appliance.state.records import ModelRecord
    from hub.settings import HubSettings


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[SiteProxy]:
    with tinyproxy(tmp_path) as running:
        yield running


def _heard(hub: HubSettings) -> float:
    store = open_store(hub)
    try:
        seen = [n.last_seen for n in store.nodes.all()]
    finally:
        store.close()
    return max((s for s in seen if s is not None), default=0.0)


async def test_a_node_reaches_its_hub_through_the_sites_proxy_and_not_without_it(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    proxy: SiteProxy,
    scripted_models: list[ModelRecord],
) -> None:
    port = proxy.port
    hub = placement_hub(tmp_path)
    server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert server.port is not None
    await join(
        aiohttp_server, tmp_path, scripted_models[0], hub, server.port, name="behind-proxy",
        model={"n_ctx": 512}, fleet={"https_proxy": f"http://127.0.0.1:{port}"},
    )  # fmt: skip
    await until(lambda: _heard(hub) > 0, "a heartbeat through the proxy", 60)
    tunnel = f"127.0.0.1:{server.port}"
    await until(lambda: tunnel in proxy.seen(), "the proxy's log", 30)
    assert "CONNECT" in proxy.seen()

    # The proxy gone, the node's calls go nowhere (they never went direct).
    proxy.process.kill()
    proxy.process.wait()
    last = _heard(hub)
    await until(lambda: time.time() - _heard(hub) > 3, "heartbeats to stop", 30)
    assert _heard(hub) - last < 2


def test_no_proxy_sends_a_host_direct_and_the_network_agent_hands_the_proxy_on(
    tmp_path: Path,
) -> None:
    via = Proxy("http://proxy.school.lan:3128", ("hub.lan", ".internal", "10.0.0.0/8", "::1"))
    assert via.for_url("https://hub.example.org:8443/v1/enroll") == via.url
    for direct in (
        "https://hub.lan/v1", "https://api.hub.lan/v1", "https://a.b.internal/",
        "https://10.2.3.4:8443/", "https://[::1]:8443/",
    ):  # fmt: skip
        assert via.for_url(direct) is None, direct
    assert Proxy("http://p:3128", ("*",)).for_url("https://anything/") is None

    provisioning = Provisioning.model_validate({
        "hub_url": "https://hub.example.org:8443", "token": "t", "name": "n1",
        "hub_fingerprint": "sha256:" + "ab" * 32,
        "network": {"https_proxy": "http://proxy.school.lan:3128", "no_proxy": [".lan"]},
    })  # fmt: skip
    assert provisioning.network is not None
    env = proxy_environment(provisioning.network)
    assert "KVL_FLEET__HTTPS_PROXY='http://proxy.school.lan:3128'\n" in env
    assert f"KVL_FLEET__NO_PROXY='{json.dumps(['.lan'])}'\n" in env
    with pytest.raises(ValueError, match="not a host"):
        Provisioning.model_validate({
            "hub_url": "https://h:1", "token": "t", "name": "n1",
            "hub_fingerprint": "sha256:" + "ab" * 32,
            "network": {"https_proxy": "http://p:3128", "no_proxy": ["a b"]},
        })  # fmt: skip
