"""The image's update bundles (image/bundle.py) made by this machine's `rauc bundle`: adaptive
(RAUC's block-hash index of the image inside, its squashfs in 64 KiB blocks), verity, signed
by the build's signer; and the indexes a flashed node's first update starts from, which must
be RAUC's own format: the index inside the bundle, as RAUC wrote it, is compared byte for
byte with ours for the same image."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from typing import TYPE_CHECKING

from image.bundle import (
    ROOTFS_NAME,
    ZERO_CHUNK_HASH,
    block_hash_index,
    development_signing,
    make_bundle,
    seed_indexes,
)
from tests.waiting import until_sync

if TYPE_CHECKING:
    from pathlib import Path


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=300)


def _image(path: Path) -> Path:
    """A small ext4 file system with files in it, and blocks of zeros."""
    content = path.with_suffix(".d")
    content.mkdir()
    (content / "random").write_bytes(os.urandom(300_000))
    (content / "text").write_text("a release\n" * 5000)
    _run(["/usr/sbin/mkfs.ext4", "-q", "-F", "-d", str(content), str(path), "16M"])
    return path


def test_a_bundle_carries_the_block_hash_index_ours_is_byte_for_byte(tmp_path: Path) -> None:
    image = _image(tmp_path / "root.ext4")
    signing = development_signing(tmp_path / "signing")
    bundle = make_bundle(
        _run, tmp_path / "work", image, tmp_path / "release.raucb",
        version="1.2", build="test", signing=signing, level=1,
    )  # fmt: skip
    info = subprocess.run(
        ["rauc", "info", f"--keyring={signing.keyring}", "--output-format=json", str(bundle)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert '"adaptive":["block-hash-index"]' in info.replace(" ", ""), info
    out = tmp_path / "unpacked"
    _run(["unsquashfs", "-no-progress", "-d", str(out), str(bundle)])
    raucs = (out / f"{ROOTFS_NAME}.block-hash-index").read_bytes()
    ours = block_hash_index(image)
    assert len(ours) == 32 * (16 << 20) // 4096
    assert ours == raucs
    assert ZERO_CHUNK_HASH in ours  # the image's free blocks


def test_a_flashed_node_starts_from_both_slots_indexes(tmp_path: Path) -> None:
    """The seeds as this machine's RAUC (its service, on a D-Bus bus of the test's own) reads
    them: slot A's checksum and version from the status file, and after RAUC marked A good
    (which rewrites the status and prunes every slot's index folder that is not its
    checksum's) both indexes are still where RAUC looks for them."""
    image = _image(tmp_path / "root.ext4")
    slots = {name: tmp_path / f"slot-{name}.img" for name in ("a", "b")}
    slots["a"].write_bytes(image.read_bytes())
    slots["b"].write_bytes(bytes(16 << 20))
    data = tmp_path / "rauc"
    seed_indexes(data, image, slot_size=16 << 20, version="1.2")
    first = data / "slot.rootfs.0" / f"hash-{hashlib.sha256(image.read_bytes()).hexdigest()}"
    second = data / "slot.rootfs.1" / f"hash-{hashlib.sha256(bytes(16 << 20)).hexdigest()}"
    assert (first / "block-hash-index").read_bytes() == block_hash_index(image)
    assert (second / "block-hash-index").read_bytes() == ZERO_CHUNK_HASH
    for folder in (first, first.parent, second):
        assert folder.stat().st_mode & 0o777 == 0o700
    conf = tmp_path / "system.conf"
    conf.write_text(
        "[system]\ncompatible=kovenlab-edge-x86_64\nbootloader=noop\n"
        f"data-directory={data}\nmountprefix={tmp_path / 'mnt'}\n\n"
        f"[keyring]\npath={tmp_path / 'none.pem'}\n\n"
        f"[slot.rootfs.0]\ndevice={slots['a']}\ntype=raw\nbootname=A\n\n"
        f"[slot.rootfs.1]\ndevice={slots['b']}\ntype=raw\nbootname=B\n"
    )
    bus = subprocess.Popen(
        ["dbus-daemon", "--session", "--nofork", "--print-address=1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert bus.stdout is not None
    env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": bus.stdout.readline().strip(),
           "DBUS_STARTER_BUS_TYPE": "session"}  # fmt: skip
    service = subprocess.Popen(
        ["rauc", f"--conf={conf}", "--override-boot-slot=A", "service"],
        env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def rauc(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["rauc", *args], env=env, capture_output=True, text=True,
                                  check=False, timeout=60)  # fmt: skip

        until_sync(lambda: rauc("status").returncode == 0, "the RAUC service answers", 30)
        done = rauc("status", "mark-good", "booted")
        assert done.returncode == 0, done.stderr
        status = json.loads(rauc("status", "--detailed", "--output-format=json").stdout)
        [a] = [s["rootfs.0"] for s in status["slots"] if "rootfs.0" in s]
        assert a["slot_status"]["bundle"]["version"] == "1.2"
        assert a["slot_status"]["checksum"]["sha256"] == first.name.removeprefix("hash-")
        assert (first / "block-hash-index").is_file()
        assert (second / "block-hash-index").is_file()
    finally:
        service.terminate()
        service.wait(10)
        bus.terminate()
        bus.wait(10)
        bus.stdout.close()
