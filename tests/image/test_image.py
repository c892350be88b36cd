"""The appliance image, flashed, booted and updated: built by `just image` (or kept from the
last build of the same inputs), provisioned with `kvl image configure`, booted under QEMU
with OVMF on a disk larger than the image, in one QEMU session of four boots.

1. Slot A, first boot: the first boot reads `kovenlab.json` from the EFI system partition,
   the appliance answers `/readyz` through the forwarded port and enrolls with a real hub
   (in a network namespace), whose heartbeats then arrive through the WireGuard tunnel; the
   health check marks slot A good.
2. An update: the test offers a signed bundle of another version (the image's own root with
   another version string); the node installs it into slot B with `rauc install`, reboots
   into it on trial, and the health check marks it good once the appliance serves. The node
   keeps its identity (no second enrollment) and serves HTTPS with the certificate the hub's
   CA issued: the data partition came across.
3. A broken update: a bundle whose appliance exits at once goes into slot A; its trial boot
   never becomes ready, so the health check marks it bad and the node reboots into slot B by
   itself, and serves again.

After the power-off, read from the disk: the data partition grew to the end of the disk, the
loader entries are slot B good and slot A bad, and the health reports on the data partition
say which slot ran which version and why slot A was given up.

The node fetches the bundles from the test (a small HTTP server at 10.0.2.2, this machine's
loopback seen from QEMU's user-mode network) with a test-only installer that the test writes
into its copy of the image and into the update's root: the appliance's own fetch-and-install
is not part of the image's tests.
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from image.build import DEFAULT_BUILD_DIR, Paths, image_description
from image.bundle import development_signing, make_bundle
from image.configure import DATA_LABEL, ROOT_A_LABEL, partitions
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
    symlink,
    unavailable,
    wait_for,
    write_files,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.image

GROW = 2 * 1024**3  # the disk is this much larger than the image
UPDATE = f"{__version__}+update"
BROKEN = f"{__version__}+broken"
INSTALLER_NAME = "kvl-test-update.service"
INSTALLER_UNIT = f"/etc/systemd/system/{INSTALLER_NAME}"
STATE = "test-update"  # on the data partition: the server's address, what was installed
# A test-only installer: asks the test for a bundle, installs each once, reboots.
INSTALLER = f'''#!/usr/bin/python3
"""Test only (tests/image/test_image.py): installs the bundle the test offers, once."""
import json, os, subprocess, time, urllib.request
state = "/var/lib/kovenlab/{STATE}"
url = open(state + "/url").read().strip()
while True:
    try:
        with urllib.request.urlopen(url + "/next", timeout=10) as answer:
            name = json.load(answer)["name"]
    except (OSError, ValueError, KeyError):
        name = None
    if name is None or os.path.exists(f"{{state}}/{{name}}.done"):
        time.sleep(2)
        continue
    path = f"{{state}}/{{name}}"
    with urllib.request.urlopen(f"{{url}}/{{name}}", timeout=60) as answer:
        with open(path, "wb") as out:
            while chunk := answer.read(1 << 20):
                out.write(chunk)
    open(path + ".done", "w").close()
    print("installing", name, flush=True)
    subprocess.run(["rauc", "install", path], check=True)
    os.remove(path)
    subprocess.run(["systemctl", "reboot", "--no-block"], check=True)
    break
'''.encode()
# After the health check passed, so a slot is marked good before it installs the next.
INSTALLER_SERVICE = b"""[Unit]
Description=Test only: install the bundles the test offers
After=kovenlab-health.service
Requires=kovenlab-health.service

[Service]
ExecStart=/usr/local/sbin/kvl-test-update
StandardOutput=journal+console
StandardError=journal+console
"""
BROKEN_DROP_IN = b"[Service]\nExecStart=\nExecStart=/bin/false\n"


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"image test: {why}")
    return build_image()


def _installer(image: Path, offset: int = 0) -> None:
    """The test's installer into a root file system (an image file, or a disk at offset)."""
    files = {"/usr/local/sbin/kvl-test-update": INSTALLER, INSTALLER_UNIT: INSTALLER_SERVICE}
    write_files(image, files, offset)
    wants = f"/etc/systemd/system/multi-user.target.wants/{INSTALLER_NAME}"
    symlink(image, wants, INSTALLER_UNIT, offset)


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=1200)


@pytest.fixture(scope="module")
def bundles(manifest: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two bundles of the image's own root, signed as `just image` signs: UPDATE (another
    version, and the test's installer) and BROKEN (its appliance exits at once)."""
    folder = tmp_path_factory.mktemp("bundles")
    signing = development_signing(Paths(DEFAULT_BUILD_DIR).signing)
    rootfs = extract_partition(Path(manifest["image"]), ROOT_A_LABEL, folder / "rootfs.ext4")
    description = "/usr/lib/kovenlab/image.json"
    for name, version in (("update.raucb", UPDATE), ("broken.raucb", BROKEN)):
        root = folder / f"{name}.ext4"
        subprocess.run(["cp", "--sparse=always", str(rootfs), str(root)], check=True)
        about = json.dumps({**image_description(), "version": version}).encode()
        if version == UPDATE:
            write_files(root, {description: about})
            _installer(root)
        else:
            drop_in = "/etc/systemd/system/kovenlab-appliance.service.d/broken.conf"
            write_files(root, {description: about, drop_in: BROKEN_DROP_IN})
        # zstd -1: a test's bundle is read once, over the loopback
        make_bundle(_run, folder / "work", root, folder / name, version=version,
                    build="test", signing=signing, level=1)  # fmt: skip
        root.unlink()
    rootfs.unlink()
    return folder


class Offers(ThreadingHTTPServer):
    """GET /next: {"name": the bundle offered now, or null}; GET /NAME: the bundle."""

    def __init__(self, folder: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folder = folder
        self.offer: str | None = None

    @property
    def url(self) -> str:
        return f"http://{Machine.host_address}:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Offers

    def do_GET(self) -> None:
        if self.path == "/next":
            body = json.dumps({"name": self.server.offer}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        path = self.server.folder / self.path.lstrip("/")
        if not re.fullmatch(r"/[a-z]+\.raucb", self.path) or not path.is_file():
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.end_headers()
        with path.open("rb") as bundle:
            shutil.copyfileobj(bundle, self.wfile, 1024 * 1024)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


@contextmanager
def offering(folder: Path) -> Iterator[Offers]:
    server = Offers(folder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


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
def test_the_image_boots_enrolls_updates_and_falls_back(
    manifest: dict[str, Any], bundles: Path, hub: Hub, tmp_path: Path
) -> None:
    disk = copy_image(Path(manifest["image"]), tmp_path / "disk.img", GROW)
    kvl("image", "configure", str(disk), "--provisioning", str(hub.provisioning))
    offsets = {p.name: p.offset for p in partitions(disk)}
    _installer(disk, offsets[ROOT_A_LABEL])
    context = ssl.create_default_context(cafile=str(hub.ca))

    with offering(bundles) as server:
        write_files(disk, {f"/{STATE}/url": server.url.encode()}, offsets[DATA_LABEL])
        with Machine(disk, tmp_path / "vm") as machine:
            _boots(machine, server, hub, context)

    end, size = data_partition_end(disk)
    assert size - end < 2 * 1024 * 1024, "the data partition did not grow to the end of the disk"
    assert loader_entries(disk) == ["kovenlab-a+0.conf", "kovenlab-b.conf"]
    reports = [
        json.loads(line)
        for line in read_file(disk, DATA_LABEL, "/update/health.jsonl").splitlines()
    ]
    seen_runs = [(r["slot"], r["version"], r["trial"], r["result"]) for r in reports]
    assert seen_runs == [
        ("A", __version__, False, "good"),
        ("B", UPDATE, True, "good"),
        ("A", BROKEN, True, "bad"),
        ("B", UPDATE, False, "good"),
    ]
    assert "restarted" in reports[2]["reason"], reports[2]


def _boots(machine: Machine, server: Offers, hub: Hub, context: ssl.SSLContext) -> None:
    """The four boots of one QEMU session."""
    # 1. slot A: ready, enrolled, heartbeating through its tunnel, marked good
    machine.wait_ready()
    bound = ENROLLED_BOUND_S[machine.accel]
    why = lambda: f"{hub.nodes()}\n{hub.log_tail()}\n{machine.diagnostics()}"  # noqa: E731
    wait_for(lambda: heartbeat_after(hub, 0.0), "a heartbeat", bound, why)
    node = hub.nodes()[0]
    assert (node["name"], node["site"]) == (NODE_NAME, SITE)
    machine.wait_console("slot A marked good")

    # 2. the update into slot B: on trial, then good; the same node, serving HTTPS
    seen = hub.nodes()[0]["last_seen"]
    server.offer = "update.raucb"
    machine.wait_console("slot B marked good", bound_s=2 * READY_BOUND_S[machine.accel])
    machine.wait_ready("https", context)
    wait_for(lambda: heartbeat_after(hub, seen), "a heartbeat from slot B", bound, why)
    assert [n["id"] for n in hub.nodes()] == [node["id"]]  # enrolled once

    # 3. the broken update into slot A: its trial fails, the node falls back to slot B
    server.offer = "broken.raucb"
    machine.wait_console("slot A marked bad", bound_s=2 * READY_BOUND_S[machine.accel])
    machine.wait_console("slot B marked good", count=2)
    machine.wait_ready("https", context)
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
