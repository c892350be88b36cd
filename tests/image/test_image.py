"""The appliance image, flashed and booted: built by `just image` (or kept from the last build
of the same inputs), provisioned with `kvl image configure`, booted under QEMU with OVMF on a
disk larger than the image. The first boot reads `kovenlab.json` from the EFI system
partition, the appliance answers `/readyz` through the forwarded port and enrolls with a real
hub (in a network namespace), whose heartbeats then arrive through the WireGuard tunnel; the
data partition has grown to the end of the disk. The second boot keeps the node's identity
(no second enrollment) and serves the LAN over HTTPS with the certificate the hub's CA issued.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

import pytest

from tests.image.vm import (
    ENROLLED_BOUND_S,
    NODE_NAME,
    SITE,
    Hub,
    Machine,
    build_image,
    copy_image,
    data_partition_end,
    hub_in_namespace,
    kvl,
    unavailable,
    wait_for,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.image

GROW = 2 * 1024**3  # the disk is this much larger than the image


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"image test: {why}")
    return build_image()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    with hub_in_namespace(tmp_path) as made:
        yield made


def heartbeat_after(hub: Hub, seen: float) -> bool:
    """The one node is online, with a heartbeat later than `seen` (through its tunnel: the
    hub takes heartbeats only from a node's overlay address)."""
    nodes = hub.nodes()
    assert len(nodes) <= 1, nodes
    return bool(nodes) and nodes[0]["status"] == "online" and nodes[0]["last_seen"] > seen


@pytest.mark.timeout(7200)  # a first build compiles llama.cpp; TCG boots take minutes
def test_the_image_boots_enrolls_and_keeps_its_identity(
    manifest: dict[str, Any], hub: Hub, tmp_path: Path
) -> None:
    from pathlib import Path  # noqa: PLC0415

    disk = copy_image(Path(manifest["image"]), tmp_path / "disk.img", GROW)
    kvl("image", "configure", str(disk), "--provisioning", str(hub.provisioning))

    with Machine(disk, tmp_path / "boot-1") as machine:
        machine.wait_ready()
        bound = ENROLLED_BOUND_S[machine.accel]
        why = lambda: f"{hub.nodes()}\n{hub.log_tail()}\n{machine.diagnostics()}"  # noqa: E731
        wait_for(lambda: heartbeat_after(hub, 0.0), "a heartbeat", bound, why)
        node = hub.nodes()[0]
        assert (node["name"], node["site"]) == (NODE_NAME, SITE)
        machine.power_off()
    seen = hub.nodes()[0]["last_seen"]
    end, size = data_partition_end(disk)
    assert size - end < 2 * 1024 * 1024, "the data partition did not grow to the end of the disk"

    context = ssl.create_default_context(cafile=str(hub.ca))
    with Machine(disk, tmp_path / "boot-2") as machine:
        machine.wait_ready("https", context)
        why = lambda: f"{hub.nodes()}\n{machine.diagnostics()}"  # noqa: E731
        wait_for(lambda: heartbeat_after(hub, seen), "a heartbeat after the reboot", bound, why)
        assert [n["id"] for n in hub.nodes()] == [node["id"]]  # enrolled once
        machine.power_off()
