"""The appliance image: how long it takes from power-on to serving, and how big it is.

The image is built (or kept from the last build of the same inputs, as `just image` does),
a copy is provisioned for a real hub in a network namespace with `kvl image configure`, and
booted under QEMU with OVMF, as in the `image` test. Measured from QEMU's start: `/readyz`
answering 200 through the forwarded port on the first boot (which also puts the model onto
the data partition and enrolls) and on later boots, and the hub's first heartbeat from the
node (through its WireGuard tunnel). The image's size is the file's, and the data in it
(the rest is holes: empty slot B, free space). Target: ready in under 30 s under KVM; under
TCG (emulation, where KVM cannot run a stock kernel) the figures are recorded, not judged.

Run (as root): ``python -m tests.benchmarks.image [--boots 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from tests.benchmarks.serving import cpu_model, say
from tests.image.vm import (
    ENROLLED_BOUND_S,
    Hub,
    Machine,
    accelerator,
    build_image,
    copy_image,
    hub_in_namespace,
    kvl,
    unavailable,
    wait_for,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "image.json"
TARGET_READY_S = 30.0
GROW = 2 * 1024**3


def _heartbeat_after(hub: Hub, seen: float) -> bool:
    nodes = hub.nodes()
    return bool(nodes) and nodes[0]["status"] == "online" and nodes[0]["last_seen"] > seen


def boots(image: Path, work: Path, count: int) -> dict[str, Any]:
    with hub_in_namespace(work) as hub:
        disk = copy_image(image, work / "disk.img", GROW)
        kvl("image", "configure", str(disk), "--provisioning", str(hub.provisioning))
        tls = ssl.create_default_context(cafile=str(hub.ca))
        ready: list[float] = []
        enrolled_s = 0.0
        seen = 0.0
        for boot in range(count):
            say(f"image: boot {boot + 1} of {count} ({accelerator()})")
            with Machine(disk, work / f"boot-{boot + 1}") as machine:
                # Enrolled, the node serves its LAN over HTTPS from the next start.
                if boot == 0:
                    ready.append(machine.wait_ready())
                else:
                    ready.append(machine.wait_ready("https", tls))
                wait_for(
                    partial(_heartbeat_after, hub, seen),
                    "a heartbeat from the node",
                    ENROLLED_BOUND_S[machine.accel],
                    machine.diagnostics,
                )
                if boot == 0:
                    enrolled_s = time.monotonic() - machine.started
                machine.power_off()
            seen = hub.nodes()[0]["last_seen"]
        return {"ready_s": ready, "first_heartbeat_s": enrolled_s, "nodes": len(hub.nodes())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Boot-to-ready time and size of the image.")
    parser.add_argument("--boots", type=int, default=3, help="boots of one disk (3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    why = unavailable()
    if why is not None:
        say(f"image: skipped, {why}")
        return 0
    say("image: building (or keeping) the image")
    manifest = build_image()
    image = Path(manifest["image"])
    with tempfile.TemporaryDirectory(prefix="kvl-bench-image-") as tmp:
        measured = boots(image, Path(tmp), max(1, args.boots))
    ready = measured["ready_s"]
    accel = accelerator()
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "accelerator": accel},
        "settings": {"guest_cpus": 2, "guest_memory_mib": 3072, "boots": len(ready)},
        "image": {
            "size_bytes": manifest["size_bytes"],
            "allocated_bytes": manifest["allocated_bytes"],
            "root_used_bytes": manifest["root_used_bytes"],
            "debian": manifest["debian"],
            "kernel": manifest["kernel"],
            "partitions": manifest["partitions"],
        },
        "first_boot_ready_s": round(ready[0], 1),
        "later_boots_ready_s": [round(s, 1) for s in ready[1:]],
        "first_heartbeat_s": round(measured["first_heartbeat_s"], 1),
        "nodes_enrolled": measured["nodes"],
        "target_ready_s": TARGET_READY_S,
        "target_applies": accel == "kvm",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(json.dumps({k: v for k, v in result.items() if k != "image"}, indent=2))
    say(
        f"image: {manifest['size_bytes'] / 2**30:.2f} GiB file, "
        f"{manifest['allocated_bytes'] / 2**30:.2f} GiB of data"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
