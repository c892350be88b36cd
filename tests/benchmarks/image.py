"""The appliance image: how long it takes from power-on to serving, and how big it is.

The image is built (or kept from the last build of the same inputs, as `just image` does),
a copy is provisioned for a real hub in a network namespace with `kvl image configure`, and
booted under QEMU with OVMF, as in the `image` test. Measured from QEMU's start: `/readyz`
answering 200 through the forwarded port on the first boot (which also puts the model onto
the data partition and enrolls) and on later boots, and the hub's first heartbeat from the
node (through its WireGuard tunnel). The image's size is the file's, and the data in it
(the rest is holes: empty slot B, free space). Target: ready in under 30 s under KVM; under
TCG (emulation, where KVM cannot run a stock kernel) the figures are recorded, not judged.

Updates, from the hub as an operator makes them (`--updates`, on by default): a release
(a signed bundle of the image's own root under another version, with one package upgraded:
every file of the appliance's own written again) rolled out with the node as its canary,
then a broken one (its appliance exits at once). The node streams a release (RAUC's
adaptive update): the bytes the hub sent the node for it, against the whole bundle (target
at most 15 %). Measured while a client polls
the LAN API's `/readyz` every 100 ms: the seconds from the rollout's start to the node
serving the new version (answering again from the new slot), the seconds it answered no
200 (refused, reset, 5xx or no answer within a second), and, for the broken release, the
seconds from losing the LAN API for the trial boot to serving again from the previous slot
(the rollback: the trial, the health check giving up, the reboot), and from the rollout's
start to the hub halting it.

And a site's link (`--site-fetch`, on by default; tests/benchmarks/site_fetch.py, needs no
QEMU): two nodes of one site placed one model, the bytes the shaped WAN link carried with
the nodes sharing the file and without.

Run (as root): ``python -m tests.benchmarks.image [--boots 3] [--no-updates]
[--no-site-fetch]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import ssl
import tempfile
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

from image.configure import ROOT_A_LABEL
from shared import __version__
from tests.benchmarks import site_fetch
from tests.benchmarks.report import headline
from tests.benchmarks.serving import say, stamp
from tests.image.vm import (
    ENROLLED_BOUND_S,
    GROW,
    READY_BOUND_S,
    Machine,
    accelerator,
    build_image,
    copy_image,
    extract_partition,
    heartbeat_after,
    hub_in_namespace,
    kvl,
    package_files,
    release_bundles,
    reported,
    start_rollout,
    unavailable,
    wait_for,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "image.json"
TARGET_READY_S = 30.0
TARGET_ADAPTIVE_SHARE = 0.15  # of the full bundle, for a release that upgrades one package


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
                    partial(heartbeat_after, hub, seen),
                    "a heartbeat from the node",
                    ENROLLED_BOUND_S[machine.accel],
                    machine.diagnostics,
                )
                if boot == 0:
                    enrolled_s = time.monotonic() - machine.started
                machine.power_off()
            seen = hub.nodes()[0]["last_seen"]
        return {"ready_s": ready, "first_heartbeat_s": enrolled_s, "nodes": len(hub.nodes())}


class Poller(threading.Thread):
    """GET /readyz every `every_s`; the moments it answered 200 and those it did not. The
    node serves its LAN over HTTP until its first restart after enrolling, over HTTPS from
    then on (one port): a poll that the scheme in use does not answer tries the other."""

    def __init__(self, port: int, context: ssl.SSLContext, every_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.port, self.context, self.every_s = port, context, every_s
        self.polls: list[tuple[float, bool]] = []
        self.stop = threading.Event()
        self.scheme = "http"

    def _ready(self, scheme: str) -> bool:
        host = "localhost" if scheme == "https" else "127.0.0.1"
        url = f"{scheme}://{host}:{self.port}/readyz"
        context = self.context if scheme == "https" else None
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as answer:
                return int(answer.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def run(self) -> None:
        while not self.stop.is_set():
            at = time.monotonic()
            ok = self._ready(self.scheme)
            if not ok:
                other = "https" if self.scheme == "http" else "http"
                if self._ready(other):
                    ok, self.scheme = True, other
            self.polls.append((at, ok))
            self.stop.wait(max(0.0, self.every_s - (time.monotonic() - at)))

    def unavailable_s(self, since: float) -> float:
        """Seconds after `since` without a 200: each failed poll counts until the next poll."""
        polls = [p for p in self.polls if p[0] >= since]
        return sum(b[0] - a[0] for a, b in itertools.pairwise(polls) if not a[1])

    def outage(self, since: float) -> tuple[float, float] | None:
        """The first run of failed polls after `since`: when it began, when a 200 came back."""
        began = None
        for at, ok in self.polls:
            if at < since:
                continue
            if not ok and began is None:
                began = at
            elif ok and began is not None:
                return began, at
        return None

    def serving_since(self, since: float) -> float | None:
        """When the LAN API answered again after its first outage after `since`."""
        outage = self.outage(since)
        return None if outage is None else outage[1]


def updates(manifest: dict[str, Any], work: Path) -> dict[str, Any]:
    """A release rolled out to the node, then a broken one; see the module's docstring."""
    update, broken = f"{__version__}+update", f"{__version__}+broken"
    # as `just image` compresses a bundle; the update upgrades one package (the appliance's)
    bundles = release_bundles(manifest, work / "bundles", {update: False, broken: True},
                              upgraded=frozenset({update}), level=6)  # fmt: skip
    root = extract_partition(Path(manifest["image"]), ROOT_A_LABEL, work / "root.ext4")
    package = package_files(root, "kovenlab-edge")
    files, size = len(package), sum(len(content) for content in package.values())
    root.unlink()
    with hub_in_namespace(work) as hub:
        disk = copy_image(Path(manifest["image"]), work / "disk.img", GROW)
        kvl("image", "configure", str(disk), "--provisioning", str(hub.provisioning))
        for version, bundle in bundles.items():
            hub.cli("releases", "add", str(bundle), "--version", version)
        tls = ssl.create_default_context(cafile=str(hub.ca))
        with Machine(disk, work / "updates") as machine:
            machine.wait_ready()
            bound = ENROLLED_BOUND_S[machine.accel]
            update_bound = 2 * READY_BOUND_S[machine.accel]
            why = machine.diagnostics
            wait_for(partial(heartbeat_after, hub, 0.0), "a heartbeat", bound, why)
            machine.wait_console("slot A marked good")
            node = hub.nodes()[0]["id"]
            poller = Poller(machine.port, tls)
            poller.start()
            wait_for(lambda: bool(poller.polls) and poller.polls[-1][1], "polls", bound, why)
            try:
                say("image: rolling out an update")
                started = time.monotonic()
                sent = hub.sent_bytes()
                rollout = start_rollout(hub, update, node, soak="0s")
                machine.wait_console("slot B marked good", bound_s=update_bound)
                sent = hub.sent_bytes() - sent
                wait_for(lambda: hub.rollout(rollout)["state"] == "done", "the rollout", bound, why)
                done_s = time.monotonic() - started
                serving = poller.serving_since(started)
                assert serving is not None, "the LAN API never went away for the reboot"
                full = bundles[update].stat().st_size
                update_result = {
                    "serving_s": round(serving - started, 1),
                    "rollout_done_s": round(done_s, 1),
                    "unavailable_s": round(poller.unavailable_s(started), 1),
                    # everything the hub sent the node from the rollout's start to the new
                    # slot marked good, against the bundle a node without streaming fetches
                    "link_bytes": sent,
                    "bundle_bytes": full,
                    "adaptive_share": round(sent / full, 4),
                }
                say(f"image: update {update_result}")

                say("image: rolling out a broken release")
                started = time.monotonic()
                rollout = start_rollout(hub, broken, node)
                wait_for(lambda: hub.rollout(rollout)["state"] == "halted", "the halt",
                         update_bound, why)  # fmt: skip
                halted_s = time.monotonic() - started
                image = reported(hub.rollout(rollout))
                assert image.get("state") == "rolled-back", image
                wait_for(lambda: poller.polls[-1][1], "the LAN API again", bound, why)
                outage = poller.outage(started)
                assert outage is not None
                broken_result = {
                    "rollback_s": round(outage[1] - outage[0], 1),
                    "rollout_halted_s": round(halted_s, 1),
                    "unavailable_s": round(poller.unavailable_s(started), 1),
                }
                say(f"image: broken release {broken_result}")
            finally:
                poller.stop.set()
                poller.join()
            machine.power_off()
    return {
        "update": update_result,
        "broken_release": broken_result,
        "upgraded_package": {"name": "kovenlab-edge", "files": files, "bytes": size},
        "target_adaptive_share": TARGET_ADAPTIVE_SHARE,
        "poll_every_s": poller.every_s,
    }


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows, from a result (a test keeps them equal)."""
    accel = result["machine"]["accelerator"]
    later = result["later_boots_ready_s"]
    lines = [
        headline(result, f"QEMU with {accel.upper()}"),
        "",
        f"| | this machine ({accel.upper()}) | target (KVM) |",
        "|---|---|---|",
        (
            "| first boot to `/readyz` 200 (partition grown, provisioning file applied, model put "
            f"onto the data partition, enrolled) | {result['first_boot_ready_s']} s | **< 30 s** |"
        ),
    ]
    if later:
        lines.append(
            f"| later boot to `/readyz` 200 (HTTPS) | {', '.join(f'{s} s' for s in later)} | "
            "**< 30 s** |"
        )
    lines += [
        (
            "| first heartbeat at the hub, through the tunnel (at most) | "
            f"{result['first_heartbeat_s']} s | |"
        ),
        (
            f"| image file / data in it | {result['image']['size_bytes'] / 2**30:.2f} GiB / "
            f"{result['image']['allocated_bytes'] / 2**30:.2f} GiB | |"
        ),
        f"| update bundle (`just image`) | {result['bundle_bytes'] / 2**20:.0f} MiB | |",
    ]
    updates = result.get("updates")
    if updates:
        u, b = updates["update"], updates["broken_release"]
        lines += [
            (
                "| a release rolled out by the hub: rollout start to the LAN API serving the new "
                "version (streamed through the tunnel as RAUC installs it, reboot) | "
                f"{u['serving_s']} s | |"
            ),
            (
                "| the same: LAN API unavailable (polled every "
                f"{updates['poll_every_s'] * 1000:.0f} ms) | {u['unavailable_s']} s | |"
            ),
            (
                "| a broken release: rollback, from losing the LAN API for its trial boot to "
                f"serving from the previous slot | {b['rollback_s']} s | |"
            ),
            f"| the same: rollout start to the hub halting it | {b['rollout_halted_s']} s | |",
            f"| the same: LAN API unavailable | {b['unavailable_s']} s | |",
        ]
        if "link_bytes" in u:
            package = updates["upgraded_package"]
            lines.append(
                f"| a release upgrading one package ({package['name']}: {package['files']} "
                f"files, {package['bytes'] / 2**20:.1f} MiB), streamed: bytes the hub sent the "
                f"node, against the whole bundle | {u['link_bytes'] / 2**20:.1f} MiB of "
                f"{u['bundle_bytes'] / 2**20:.0f} MiB ({u['adaptive_share']:.1%}) | "
                f"**≤ {updates['target_adaptive_share']:.0%}** |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Boot-to-ready time and size of the image.")
    parser.add_argument("--boots", type=int, default=3, help="boots of one disk (3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    parser.add_argument(
        "--updates",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also roll out an update and a broken release from the hub (on)",
    )
    parser.add_argument(
        "--site-fetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also two nodes of a site fetching one model over a shaped link (on; "
        "tests/benchmarks/site_fetch.py, its own results file)",
    )
    args = parser.parse_args(argv)
    if args.site_fetch:
        site_fetch.main([])
    why = unavailable()
    if why is not None:
        say(f"image: skipped, {why}")
        return 0
    say("image: building (or keeping) the image")
    manifest = build_image()
    image = Path(manifest["image"])
    with tempfile.TemporaryDirectory(prefix="kvl-bench-image-") as tmp:
        measured = boots(image, Path(tmp) / "boots", max(1, args.boots))
        updated = updates(manifest, Path(tmp) / "updates") if args.updates else None
    ready = measured["ready_s"]
    accel = accelerator()
    result = {
        **stamp(accelerator=accel),
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
        "bundle_bytes": manifest["bundle"]["size_bytes"],
        "updates": updated,
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
