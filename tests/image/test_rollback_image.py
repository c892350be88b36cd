"""A broken release rolled out to the appliance image: the same start as `test_image.py`
(built, provisioned, booted under QEMU, a real hub in a network namespace), whose hub holds
the flashed release (the build's bundle) and BROKEN, a signed bundle of the image's own root
whose appliance exits at once. A module of its own, so that it boots on another worker beside
`test_image.py`'s update.

1. Slot A, first boot: ready, enrolled, heartbeating through the tunnel, marked good.
2. A rollout of BROKEN with this node as its canary: the node installs it into slot B and
   reboots; the trial boot never becomes ready, so the health check marks slot B bad and the
   node reboots into slot A by itself, which serves again (HTTPS, with the certificate the
   hub's CA issued); the node reports the rollback and the hub halts the rollout on its own.
   Aborted, the rollout gives the node what it had before (the flashed version, which it runs
   again: nothing to install) and ends.

After the power-off, read from the disk: the loader entries are slot A good and slot B bad,
and the health reports on the data partition say which slot ran which version and why slot B
was given up.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from image.configure import DATA_LABEL
from shared import __version__
from tests.image.vm import (
    GROW,
    Hub,
    Machine,
    copy_image,
    first_boot,
    kvl,
    loader_entries,
    read_file,
    reported,
    start_rollout,
    wait_for,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

pytestmark = pytest.mark.image

CURRENT = __version__
BROKEN = f"{__version__}+broken"
RELEASES = {BROKEN: True}  # the bundles conftest.py makes


@pytest.mark.timeout(7200)  # a first build compiles llama.cpp; TCG boots take minutes
def test_a_broken_release_rolls_back_by_itself_and_halts_the_rollout(
    manifest: dict[str, Any], bundles: Future[dict[str, Path]], hub: Hub, tmp_path: Path
) -> None:
    disk = copy_image(Path(manifest["image"]), tmp_path / "disk.img", GROW)
    kvl("image", "configure", str(disk), "--provisioning", str(hub.provisioning))
    context = ssl.create_default_context(cafile=str(hub.ca))

    with Machine(disk, tmp_path / "vm") as machine:
        # 1. slot A: ready, enrolled, heartbeating through its tunnel, marked good
        enrolled = first_boot(machine, hub, bundles)

        def state(rollout: str) -> str:
            return str(hub.rollout(rollout)["state"])

        # The flashed release too, as a fleet's hub holds it: what an abort gives back.
        hub.cli("releases", "add", manifest["bundle"]["path"], "--version", CURRENT)

        # 2. BROKEN: its trial in slot B fails, the node falls back to A, the rollout halts
        rollout = start_rollout(hub, BROKEN, enrolled.node_id)
        machine.wait_console("slot B marked bad", bound_s=enrolled.update_bound_s)
        machine.wait_console("slot A marked good", count=2)
        machine.wait_ready("https", context)
        wait_for(lambda: state(rollout) == "halted", "the rollout to halt", enrolled.bound_s,
                 enrolled.why)  # fmt: skip
        image = reported(hub.rollout(rollout))
        assert (image["version"], image["state"]) == (CURRENT, "rolled-back"), image
        # Aborted: the node is given the flashed version again, which it runs.
        hub.cli("rollouts", "abort", rollout)
        wait_for(lambda: state(rollout) == "aborted", "the abort to end", enrolled.bound_s,
                 enrolled.why)  # fmt: skip

        # The node's report of the flashed version as good may come a heartbeat after the
        # rollback ended: waited for (bounded), not read once.
        def flashed_and_good() -> bool:
            image = reported(hub.rollout(rollout))
            return (image.get("version"), image.get("state")) == (CURRENT, "good")

        wait_for(flashed_and_good, "the node to report the flashed version good",
                 enrolled.bound_s, enrolled.why)  # fmt: skip
        assert [n["id"] for n in hub.nodes()] == [enrolled.node_id]  # enrolled once
        machine.power_off()

    assert loader_entries(disk) == ["kovenlab-a.conf", "kovenlab-b+0.conf"]
    reports = [
        json.loads(line)
        for line in read_file(disk, DATA_LABEL, "/update/health.jsonl").splitlines()
    ]
    seen_runs = [(r["slot"], r["version"], r["trial"], r["result"]) for r in reports]
    assert seen_runs == [
        ("A", CURRENT, False, "good"),
        ("B", BROKEN, True, "bad"),
        ("A", CURRENT, False, "good"),
    ]
    assert "restarted" in reports[1]["reason"], reports[1]
