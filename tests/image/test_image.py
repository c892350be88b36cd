"""The appliance image, flashed, booted and updated by the hub: built by `just image` (or kept
from the last build of the same inputs), provisioned with `kvl image configure`, booted under
QEMU with OVMF on a disk larger than the image, in one QEMU session of four boots, with a real
hub in a network namespace holding two releases (signed bundles of the image's own root):
UPDATE (another version) and BROKEN (its appliance exits at once).

1. Slot A, first boot: the first boot reads `kovenlab.json` from the EFI system partition, the
   appliance answers `/readyz` through the forwarded port and enrolls with the hub, whose
   heartbeats then arrive through the WireGuard tunnel; the health check marks slot A good,
   and the node reports the flashed version (os-release's IMAGE_VERSION).
2. A rollout of UPDATE with this node as its canary: the appliance fetches the bundle from the
   hub through the tunnel, `rauc install`s it into slot B and asks for the reboot (it runs
   without root: kovenlab-reboot.path reboots); slot B boots on trial and is marked good once
   the appliance serves, the node reports UPDATE good and the rollout is done. The node keeps
   its identity (no second enrollment) and serves HTTPS with the certificate the hub's CA
   issued: the data partition came across.
3. and 4. A rollout of BROKEN: its trial boot in slot A never becomes ready, so the health
   check marks it bad and the node reboots into slot B by itself; the node reports the
   rollback and the hub halts the rollout on its own. Aborted, the rollout gives the node
   what it had before (UPDATE, which it runs again) and ends.

After the power-off, read from the disk: the data partition grew to the end of the disk, the
loader entries are slot A bad and slot B good, and the health reports on the data partition
say which slot ran which version and why slot A was given up.
"""

from __future__ import annotations

import json
import ssl
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from image.configure import DATA_LABEL
from shared import __version__
from tests.image.vm import (
    ENROLLED_BOUND_S,
    GROW,
    NODE_NAME,
    READY_BOUND_S,
    SITE,
    Hub,
    Machine,
    copy_image,
    data_partition_end,
    hub_in_namespace,
    kvl,
    loader_entries,
    read_file,
    release_bundles,
    reported,
    start_rollout,
    wait_for,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.image

CURRENT = __version__
UPDATE = f"{__version__}+update"
BROKEN = f"{__version__}+broken"


@pytest.fixture(scope="module")
def bundles(
    manifest: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Future[dict[str, Path]]]:
    """The two releases' bundles, made in a thread while the first boot runs (under TCG the
    boot is minutes, the bundles most of one)."""
    releases = {UPDATE: False, BROKEN: True}
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(release_bundles, manifest, tmp_path_factory.mktemp("bundles"), releases)


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
def test_the_hub_rolls_out_rolls_back_and_halts_on_a_broken_release(
    manifest: dict[str, Any], bundles: Future[dict[str, Path]], hub: Hub, tmp_path: Path
) -> None:
    disk = copy_image(Path(manifest["image"]), tmp_path / "disk.img", GROW)
    kvl("image", "configure", str(disk), "--provisioning", str(hub.provisioning))
    context = ssl.create_default_context(cafile=str(hub.ca))

    with Machine(disk, tmp_path / "vm") as machine:
        _boots(machine, hub, context, bundles)

    end, size = data_partition_end(disk)
    assert size - end < 2 * 1024 * 1024, "the data partition did not grow to the end of the disk"
    assert loader_entries(disk) == ["kovenlab-a+0.conf", "kovenlab-b.conf"]
    reports = [
        json.loads(line)
        for line in read_file(disk, DATA_LABEL, "/update/health.jsonl").splitlines()
    ]
    seen_runs = [(r["slot"], r["version"], r["trial"], r["result"]) for r in reports]
    assert seen_runs == [
        ("A", CURRENT, False, "good"),
        ("B", UPDATE, True, "good"),
        ("A", BROKEN, True, "bad"),
        ("B", UPDATE, False, "good"),
    ]
    assert "restarted" in reports[2]["reason"], reports[2]


def _boots(
    machine: Machine, hub: Hub, context: ssl.SSLContext, bundles: Future[dict[str, Path]]
) -> None:
    """The four boots of one QEMU session."""
    # 1. slot A: ready, enrolled, heartbeating through its tunnel, marked good
    machine.wait_ready()
    for version, bundle in bundles.result().items():
        hub.cli("releases", "add", str(bundle), "--version", version)
    bound = ENROLLED_BOUND_S[machine.accel]
    update_bound = 2 * READY_BOUND_S[machine.accel]  # a fetch, an install, a boot
    why = lambda: f"{hub.nodes()}\n{hub.log_tail()}\n{machine.diagnostics()}"  # noqa: E731
    wait_for(lambda: heartbeat_after(hub, 0.0), "a heartbeat", bound, why)
    node = hub.nodes()[0]
    assert (node["name"], node["site"]) == (NODE_NAME, SITE)
    machine.wait_console("slot A marked good")

    # 2. UPDATE from the hub into slot B: on trial, then good; the same node, serving HTTPS
    rollout = start_rollout(hub, UPDATE, node["id"], soak="0s")
    assert reported(hub.rollout(rollout))["version"] == CURRENT  # the flashed image's
    machine.wait_console("slot B marked good", bound_s=update_bound)
    machine.wait_ready("https", context)

    def state(rollout: str) -> str:
        return str(hub.rollout(rollout)["state"])

    wait_for(lambda: state(rollout) == "done", "the rollout to be done", bound, why)
    image = reported(hub.rollout(rollout))
    assert (image["version"], image["state"], image["slot"]) == (UPDATE, "good", "rootfs.1")
    assert [n["id"] for n in hub.nodes()] == [node["id"]]  # enrolled once

    # 3. and 4. BROKEN: its trial in slot A fails, the node falls back to B, the rollout halts
    rollout = start_rollout(hub, BROKEN, node["id"])
    machine.wait_console("slot A marked bad", bound_s=update_bound)
    machine.wait_console("slot B marked good", count=2)
    machine.wait_ready("https", context)
    wait_for(lambda: state(rollout) == "halted", "the rollout to halt", bound, why)
    image = reported(hub.rollout(rollout))
    assert (image["version"], image["state"]) == (UPDATE, "rolled-back"), image
    # Aborted: the node is given UPDATE again, which it runs: nothing to install.
    hub.cli("rollouts", "abort", rollout)
    wait_for(lambda: state(rollout) == "aborted", "the abort to end", bound, why)
    image = reported(hub.rollout(rollout))
    assert (image["version"], image["state"]) == (UPDATE, "good"), image
    machine.power_off()


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
