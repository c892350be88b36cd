"""The image release the hub gives a node, on the node's side (appliance/fleet/release.py):
a real hub on loopback rolls a release out to the node (protocol 6), the node's updater
fetches the bundle through the node API (a cut download resumed, a damaged one refused),
and installs it with the real `rauc` (Debian's, which `just setup-system` installs) into
file-backed slots of a test system.conf (`bootloader=noop`), signed by a test CA; the
reboot is the test's (the boot id, and the slot the RAUC service is told is booted),
after which the node marks the new slot good, or reports the rollback. Where the updater
is absent the node refuses the release, saying why, and reports no image."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import aiohttp
import pytest
from wireguard_tools import WireguardKey

from appliance.fleet.client import HubClient
from appliance.fleet.release import Updater, image_version
from appliance.state.store import AsyncStore
from appliance.update.installer import Rauc, parse_status
from hub.app import create_app as create_hub
from hub.identity import certificates, ssl_context
from hub.planning.rollout import Strategy
from hub.rollouts import begin
from hub.settings import HubSettings
from hub.state.store import open_store
from shared import pki, protocol
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer


class Given:
    """A hub that has given this test's node release 1.1 (`bundle`), and the node's side:
    its client and its store, holding that desired state."""

    def __init__(self, hub: HubSettings, client: HubClient, store: AsyncStore, bundle: bytes):
        self.hub = hub
        self.client = client
        self.store = store
        self.bundle = bundle
        self.sha256 = hashlib.sha256(bundle).hexdigest()


def _targeted(hub: HubSettings) -> bool:
    store = open_store(hub)
    try:
        return bool(store.node_release_versions())
    finally:
        store.close()


def _speaks_6(hub: HubSettings) -> bool:
    store = open_store(hub)
    try:
        return all(n.versions.get("protocol") == "6" for n in store.nodes())
    finally:
        store.close()


async def give_release(
    aiohttp_server: AiohttpServer, tmp_path: Path, bundle: bytes
) -> AsyncIterator[Given]:
    hub = HubSettings.model_validate(
        {"data_dir": tmp_path / "hub", "server": {"require_overlay_source": False},
         "overlay": {"interface": None}, "fleet": {"rollout_every_s": 0.05}}
    )  # fmt: skip
    hub.artifacts_dir.mkdir(parents=True)
    sha256 = hashlib.sha256(bundle).hexdigest()
    (hub.artifacts_dir / sha256).write_bytes(bundle)
    store = open_store(hub)
    token = store.create_token("lab", uses=1, expires_in_s=60).plaintext
    node = store.enroll(token, name="edge", wg_public_key=str(WireguardKey.generate().public_key()),
                        overlay_prefix="100.64.0.0/10", labels={}, versions={})  # fmt: skip
    store.add_release("1.1", "", sha256, len(bundle))
    store.close()
    server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    client = HubClient(f"https://127.0.0.1:{server.port}", pin, node.node_token)
    local = AsyncStore(tmp_path / "node" / "appliance.db")
    await local.open()
    try:
        await client.heartbeat({}, protocol.Capacity())
        await until(lambda: _speaks_6(hub), "the node's heartbeat stored")
        store = open_store(hub)
        begin(store, "release", {"release": "1.1"}, Strategy(max_burn_rate=None), "test")
        store.close()
        await until(lambda: _targeted(hub), "the release given to the node")
        state = await client.state(-1)
        assert state is not None
        assert state.release is not None
        assert (state.release.version, state.release.sha256) == ("1.1", sha256)
        await local.run(local.sync.apply_desired_state, state)
        yield Given(hub, client, local, bundle)
    finally:
        await client.close()
        await local.close()


@pytest.fixture
async def given(aiohttp_server: AiohttpServer, tmp_path: Path) -> AsyncIterator[Given]:
    async for g in give_release(aiohttp_server, tmp_path, b"not a real bundle" * 4096):
        yield g


async def test_a_node_without_the_updater_refuses_the_release_saying_why(
    given: Given, tmp_path: Path
) -> None:
    updater = Updater(
        given.store, Rauc("kvl-no-such-updater"), tmp_path / "updates",
        os_release=tmp_path / "os-release",
    )  # fmt: skip
    await updater.converge(given.client)
    assert updater.image is None
    assert updater.release_error is not None
    assert "no image updater" in updater.release_error
    assert "1.1" in updater.release_error
    assert not (tmp_path / "updates").exists()  # nothing fetched
    # No release given: nothing to refuse.
    await given.store.run(given.store.sync.set_meta, "desired_release", json.dumps(None))
    await updater.converge(given.client)
    assert updater.release_error is None
    # What the heartbeat carries, within the protocol's bounds.
    protocol.Capacity(image=updater.image, release_error=updater.release_error)


def test_the_updaters_status_is_read_from_raucs_json(tmp_path: Path) -> None:
    raw = {
        "compatible": "kovenlab-edge", "booted": "B", "boot_primary": "rootfs.1",
        "slots": [
            {"rootfs.0": {"class": "rootfs", "bootname": "A", "state": "inactive",
                          "boot_status": "good",
                          "slot_status": {"bundle": {"version": "1.0"}, "status": "ok"}}},
            {"rootfs.1": {"class": "rootfs", "bootname": "B", "state": "booted",
                          "boot_status": "good",
                          "slot_status": {"bundle": {"version": "1.1"}, "status": "ok"}}},
        ],
    }  # fmt: skip
    status = parse_status(raw)
    assert status.booted_slot is not None
    assert (status.booted_slot.name, status.booted_slot.version) == ("rootfs.1", "1.1")
    assert status.primary == "rootfs.1"
    os_release = tmp_path / "os-release"
    os_release.write_text('ID=debian\nIMAGE_ID=kovenlab-edge\nIMAGE_VERSION="1.0"\n')
    assert image_version(os_release) == "1.0"
    assert image_version(tmp_path / "missing") is None
