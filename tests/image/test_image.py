"""The appliance image, flashed, booted and updated by the hub: built by `just image` (or kept
from the last build of the same inputs), provisioned with `kvl image configure`, booted under
QEMU with OVMF on a disk larger than the image, with a real hub in a network namespace
holding UPDATE, a signed bundle of the image's own root with another version. Its twin,
`test_rollback_image.py`, rolls out a broken release from the same start: the two boot side
by side on two workers.

1. Slot A, first boot: the first boot reads `kovenlab.json` from the EFI system partition,
   with the site's network in it: a static address, which the LAN API is forwarded to alone,
   and a proxy (tinyproxy on this machine). The appliance answers `/readyz` at that address,
   enrolls with the hub through the proxy (its log shows the CONNECT), and its heartbeats
   then arrive through the WireGuard tunnel; the health check marks slot A good,
   and the node reports the flashed version (os-release's IMAGE_VERSION).
2. A rollout of UPDATE with this node as its canary: RAUC streams the bundle from the hub
   through the appliance (which fetches each range through the tunnel) into slot B, taking
   the blocks the node holds from its own slots: the hub sends the node a small part of the
   bundle (UPDATE is the flashed root with one file changed). The appliance asks for the
   reboot (it runs without root: kovenlab-reboot.path reboots); slot B boots on trial and is
   marked good once the appliance serves, the node reports UPDATE good and the rollout is
   done. The node keeps its identity (no second enrollment) and serves HTTPS with the
   certificate the hub's CA issued: the data partition came across.

After the power-off, read from the disk: the data partition grew to the end of the disk, both
loader entries are good, and the health reports on the data partition say which slot ran
which version.
"""

from __future__ import annotations

import ipaddress
import json
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from image.configure import DATA_LABEL
from shared import __version__
from tests.image.vm import (
    GROW,
    HUB_PORT,
    LAN,
    Hub,
    Machine,
    copy_image,
    data_partition_end,
    first_boot,
    kvl,
    loader_entries,
    read_file,
    reported,
    start_rollout,
    wait_for,
)
from tests.site_proxy import tinyproxy

if TYPE_CHECKING:
    from concurrent.futures import Future

# The guest's LAN (QEMU's user-mode network): this machine at .2, QEMU's DNS at .3.
GATEWAY, DNS, STATIC = (str(ipaddress.ip_network(LAN)[n]) for n in (2, 3, 20))

pytestmark = pytest.mark.image

CURRENT = __version__
UPDATE = f"{__version__}+update"
RELEASES = {UPDATE: False}  # the bundles conftest.py makes


@pytest.mark.timeout(7200)  # a first build compiles llama.cpp; TCG boots take minutes
def test_the_hub_rolls_out_a_release_into_the_other_slot(
    manifest: dict[str, Any], bundles: Future[dict[str, Path]], hub: Hub, tmp_path: Path
) -> None:
    disk = copy_image(Path(manifest["image"]), tmp_path / "disk.img", GROW)
    context = ssl.create_default_context(cafile=str(hub.ca))

    with tinyproxy(tmp_path) as proxy:
        # The site's network in the provisioning file: a static address (the LAN API is
        # forwarded to it alone) and its proxy, which the node enrolls through.
        provisioning = json.loads(hub.provisioning.read_text())
        provisioning["network"] = {
            "addresses": [f"{STATIC}/24"], "gateways": [GATEWAY], "dns": [DNS],
            "https_proxy": f"http://{GATEWAY}:{proxy.port}",
        }  # fmt: skip
        written = tmp_path / "kovenlab.json"
        written.write_text(json.dumps(provisioning))
        kvl("image", "configure", str(disk), "--provisioning", str(written))

        with Machine(disk, tmp_path / "vm", guest=STATIC) as machine:
            # 1. slot A: ready, enrolled (through the proxy), heartbeating through its
            # tunnel, marked good
            enrolled = first_boot(machine, hub, bundles)
            assert f"CONNECT {hub.address}:{HUB_PORT}" in proxy.seen(), proxy.seen()

            # 2. UPDATE from the hub into slot B: on trial, then good; the same node,
            # serving HTTPS
            sent = hub.sent_bytes()
            rollout = start_rollout(hub, UPDATE, enrolled.node_id, soak="0s")
            assert reported(hub.rollout(rollout))["version"] == CURRENT  # the flashed one
            machine.wait_console("slot B marked good", bound_s=enrolled.update_bound_s)
            sent = hub.sent_bytes() - sent
            bundle = bundles.result()[UPDATE].stat().st_size
            # whole, the bundle would be sent once at least; streamed, RAUC fetches its
            # signature, index and the few blocks the node lacks
            assert sent < bundle // 4, f"the hub sent {sent} bytes of a {bundle}-byte bundle"
            machine.wait_ready("https", context)
            wait_for(
                lambda: hub.rollout(rollout)["state"] == "done",
                "the rollout to be done",
                enrolled.bound_s,
                enrolled.why,
            )
            image = reported(hub.rollout(rollout))
            assert (image["version"], image["state"], image["slot"]) == (
                UPDATE, "good", "rootfs.1",
            )  # fmt: skip
            assert [n["id"] for n in hub.nodes()] == [enrolled.node_id]  # enrolled once
            machine.power_off()

    end, size = data_partition_end(disk)
    assert size - end < 2 * 1024 * 1024, "the data partition did not grow to the end of the disk"
    assert loader_entries(disk) == ["kovenlab-a.conf", "kovenlab-b.conf"]
    reports = [
        json.loads(line)
        for line in read_file(disk, DATA_LABEL, "/update/health.jsonl").splitlines()
    ]
    seen_runs = [(r["slot"], r["version"], r["trial"], r["result"]) for r in reports]
    assert seen_runs == [("A", CURRENT, False, "good"), ("B", UPDATE, True, "good")]


def test_the_documented_sizes_are_the_built_image_s(manifest: dict[str, Any]) -> None:
    """docs/image.md states the image's sizes as this build measured them (within 10 %: a
    dependency's new version moves them a little)."""
    from tests.image.sizes import documented_sizes  # noqa: PLC0415

    measured = {
        "image file": manifest["size_bytes"],
        "data in it": manifest["allocated_bytes"],
        "root file system": manifest["root_used_bytes"],
        "download": manifest["compressed"]["size_bytes"],
        "update bundle": manifest["bundle"]["size_bytes"],
    }
    documented = documented_sizes()
    assert set(documented) == set(measured)
    for what, figure in documented.items():
        assert abs(figure - measured[what]) <= 0.1 * measured[what], (
            f"docs/image.md says the {what} is {figure / 2**20:.0f} MiB; "
            f"this build's is {measured[what] / 2**20:.0f} MiB"
        )
