"""The image's update bundles (image/bundle.py) made by this machine's `rauc bundle`: adaptive
(RAUC's block-hash index of the image inside, its squashfs in 64 KiB blocks), verity, signed
by the build's signer; and the indexes a flashed node's first update starts from, which must
be RAUC's own format: the index inside the bundle, as RAUC wrote it, is compared byte for
byte with ours for the same image."""

from __future__ import annotations

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
    image = _image(tmp_path / "root.ext4")
    data = tmp_path / "rauc"
    seed_indexes(data, image)
    first = data / "slot.rootfs.0" / "hash-unknown" / "block-hash-index"
    second = data / "slot.rootfs.1" / "hash-unknown" / "block-hash-index"
    assert first.read_bytes() == block_hash_index(image)
    assert second.read_bytes() == ZERO_CHUNK_HASH
    for folder in (first.parent, first.parent.parent, second.parent):
        assert folder.stat().st_mode & 0o777 == 0o700
