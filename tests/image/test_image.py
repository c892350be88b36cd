"""The appliance image, flashed, booted and updated by the hub: built by `just image` (or kept
from the last build of the same inputs), provisioned with `kvl image configure`, booted under
QEMU with OVMF on a disk larger than the image, in one QEMU session of five boots, with a real
hub in a network namespace holding three releases (signed bundles of the image's own root):
CURRENT (the flashed version), UPDATE (another version) and BROKEN (its appliance exits at once).

1. Slot A, first boot: the first boot reads `kovenlab.json` from the EFI system partition, the
   appliance answers `/readyz` through the forwarded port and enrolls with the hub, whose
   heartbeats then arrive through the WireGuard tunnel; the health check marks slot A good,
   and the node reports the flashed version (os-release's IMAGE_VERSION).
2. A rollout of UPDATE with this node as its canary: the appliance fetches the bundle from the
   hub through the tunnel, `rauc install`s it into slot B and asks for the reboot (it runs
   without root: kovenlab-reboot.path reboots); slot B boots on trial and is marked good once
   the appliance serves. The node keeps its identity (no second enrollment) and serves HTTPS
   with the certificate the hub's CA issued: the data partition came across.
3. The rollout aborted while its canary soaks: the node is given what it had before, CURRENT,
   and installs it into slot A: a rollback by the same path, marked good.
4. A rollout of BROKEN: its trial boot in slot B never becomes ready, so the health check marks
   it bad and the node reboots into slot A by itself; the node reports the rollback, and the
   hub halts the rollout on its own.

After the power-off, read from the disk: the data partition grew to the end of the disk, the
loader entries are slot A good and slot B bad, and the health reports on the data partition
say which slot ran which version and why slot B was given up.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from image.build import DEFAULT_BUILD_DIR, Paths, image_description
from image.bundle import development_signing, make_bundle
from image.configure import DATA_LABEL, ROOT_A_LABEL
from shared import __version__
from tests.image.vm import (
    ENROLLED_BOUND_S,
    NODE_NAME,
    READY_BOUND_S,
    SITE,
    Hub,
    Machine,
    build_image,
    copy_image,
    data_partition_end,
    extract_partition,
    hub_in_namespace,
    kvl,
    loader_entries,
    read_file,
    unavailable,
    wait_for,
    write_files,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.image

GROW = 2 * 1024**3  # the disk is this much larger than the image
CURRENT = __version__
UPDATE = f"{__version__}+update"
BROKEN = f"{__version__}+broken"
BROKEN_DROP_IN = b"[Service]\nExecStart=\nExecStart=/bin/false\n"
# Long enough that the canary is still soaking when the test aborts; the reboots take
# minutes under TCG, so a node unheard for a while is not a reason to halt.
LONG = "2h"


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"image test: {why}")
    return build_image()


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=1200)


@pytest.fixture(scope="module")
def bundles(manifest: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A bundle per release, of the image's own root, signed as `just image` signs."""
    folder = tmp_path_factory.mktemp("bundles")
    signing = development_signing(Paths(DEFAULT_BUILD_DIR).signing)
    rootfs = extract_partition(Path(manifest["image"]), ROOT_A_LABEL, folder / "rootfs.ext4")
    description = "/usr/lib/kovenlab/image.json"
    made: dict[str, Path] = {}
    for name, version in (("current", CURRENT), ("update", UPDATE), ("broken", BROKEN)):
        root = folder / f"{name}.ext4"
        subprocess.run(["cp", "--sparse=always", str(rootfs), str(root)], check=True)
        about = json.dumps({**image_description(), "version": version}).encode()
        if version == BROKEN:
            drop_in = "/etc/systemd/system/kovenlab-appliance.service.d/broken.conf"
            write_files(root, {description: about, drop_in: BROKEN_DROP_IN})
        elif version == UPDATE:
            write_files(root, {description: about})
        # zstd -1: a test's bundle is read once, over the tunnel
        made[version] = folder / f"{name}.raucb"
        make_bundle(_run, folder / "work", root, made[version], version=version,
                    build="test", signing=signing, level=1)  # fmt: skip
        root.unlink()
    rootfs.unlink()
    return made


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


def start_rollout(hub: Hub, version: str, node_id: str) -> str:
    out = hub.cli("rollouts", "start", "--release", version, "--canary-node", node_id,
                  "--soak", LONG, "--offline-after", LONG, "--no-burn-gate")  # fmt: skip
    found = re.match(r"rollout (\S+) ", out)
    assert found is not None, out
    return found.group(1)


def reported(view: dict[str, Any]) -> dict[str, Any]:
    """What the rollout's one node last reported of its image."""
    [wave] = view["waves"]
    [node] = wave["nodes"]
    image: dict[str, Any] = node.get("image") or {}
    return image


@pytest.mark.timeout(7200)  # a first build compiles llama.cpp; TCG boots take minutes
def test_the_hub_rolls_out_rolls_back_and_halts_on_a_broken_release(
    manifest: dict[str, Any], bundles: dict[str, Path], hub: Hub, tmp_path: Path
) -> None:
    disk = copy_image(Path(manifest["image"]), tmp_path / "disk.img", GROW)
    kvl("image", "configure", str(disk), "--provisioning", str(hub.provisioning))
    for version, bundle in bundles.items():
        hub.cli("releases", "add", str(bundle), "--version", version)
    context = ssl.create_default_context(cafile=str(hub.ca))

    with Machine(disk, tmp_path / "vm") as machine:
        _boots(machine, hub, context)

    end, size = data_partition_end(disk)
    assert size - end < 2 * 1024 * 1024, "the data partition did not grow to the end of the disk"
    assert loader_entries(disk) == ["kovenlab-a.conf", "kovenlab-b+0.conf"]
    reports = [
        json.loads(line)
        for line in read_file(disk, DATA_LABEL, "/update/health.jsonl").splitlines()
    ]
    seen_runs = [(r["slot"], r["version"], r["trial"], r["result"]) for r in reports]
    assert seen_runs == [
        ("A", CURRENT, False, "good"),
        ("B", UPDATE, True, "good"),
        ("A", CURRENT, True, "good"),
        ("B", BROKEN, True, "bad"),
        ("A", CURRENT, False, "good"),
    ]
    assert "restarted" in reports[3]["reason"], reports[3]


def _boots(machine: Machine, hub: Hub, context: ssl.SSLContext) -> None:
    """The five boots of one QEMU session."""
    # 1. slot A: ready, enrolled, heartbeating through its tunnel, marked good
    machine.wait_ready()
    bound = ENROLLED_BOUND_S[machine.accel]
    update_bound = 2 * READY_BOUND_S[machine.accel]  # a fetch, an install, a boot
    why = lambda: f"{hub.nodes()}\n{hub.log_tail()}\n{machine.diagnostics()}"  # noqa: E731
    wait_for(lambda: heartbeat_after(hub, 0.0), "a heartbeat", bound, why)
    node = hub.nodes()[0]
    assert (node["name"], node["site"]) == (NODE_NAME, SITE)
    machine.wait_console("slot A marked good")

    # 2. UPDATE from the hub into slot B: on trial, then good; the same node, serving HTTPS
    rollout = start_rollout(hub, UPDATE, node["id"])
    machine.wait_console("slot B marked good", bound_s=update_bound)
    machine.wait_ready("https", context)

    def runs(version: str) -> bool:
        image = reported(hub.rollout(rollout))
        return (image.get("version"), image.get("state")) == (version, "good")

    wait_for(lambda: runs(UPDATE), "the node to report UPDATE good", bound, why)
    assert [n["id"] for n in hub.nodes()] == [node["id"]]  # enrolled once
    assert hub.rollout(rollout)["state"] == "running"  # the canary soaks

    # 3. aborted: the node gets CURRENT back, installed into slot A by the same path
    hub.cli("rollouts", "abort", rollout)
    machine.wait_console("slot A marked good", count=2, bound_s=update_bound)
    machine.wait_ready("https", context)
    wait_for(lambda: runs(CURRENT), "the node to report CURRENT good", bound, why)
    wait_for(lambda: hub.rollout(rollout)["state"] == "aborted", "the abort to end", bound, why)

    # 4. BROKEN: its trial in slot B fails, the node falls back to slot A, the rollout halts
    rollout = start_rollout(hub, BROKEN, node["id"])
    machine.wait_console("slot B marked bad", bound_s=update_bound)
    machine.wait_console("slot A marked good", count=3)
    machine.wait_ready("https", context)
    wait_for(lambda: hub.rollout(rollout)["state"] == "halted", "the rollout to halt", bound, why)
    image = reported(hub.rollout(rollout))
    assert (image["version"], image["state"]) == (CURRENT, "rolled-back"), image
    machine.power_off()


def test_the_documented_sizes_are_the_built_image_s(manifest: dict[str, Any]) -> None:
    """docs/image.md states the image's sizes as this build measured them (within 10 %: a
    dependency's new version moves them a little)."""
    from tests.image.test_sizes import documented_sizes  # noqa: PLC0415

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
