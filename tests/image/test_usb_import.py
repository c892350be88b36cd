"""Site bundles from a USB stick (image/usb_import.py), on a folder standing in for the
mounted stick: the bundles at its top copied into the appliance's inbox whole, and nothing
else: not a link, a pipe, a folder, a name that is not a plain one, nor more than eight.
The QEMU test (tests/image/test_hubless_image.py) has udev and systemd run it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from image.usb_import import MAX_FILES, Layout, bundles_on, copy_into, main


def test_the_bundles_at_the_top_are_copied_whole_and_nothing_else(tmp_path: Path) -> None:
    stick = tmp_path / "stick"
    stick.mkdir()
    (stick / "term-2.kvlbundle").write_bytes(b"bundle one")
    (stick / "TERM-3.KVLBUNDLE").write_bytes(b"bundle two")
    (stick / "notes.txt").write_text("not a bundle")
    (stick / "nested").mkdir()
    (stick / "nested" / "deep.kvlbundle").write_bytes(b"not at the top")
    (stick / "dir.kvlbundle").mkdir()
    secret = tmp_path / "secret"
    secret.write_text("the node's own file")
    (stick / "link.kvlbundle").symlink_to(secret)
    os.mkfifo(stick / "pipe.kvlbundle")
    (stick / "-rf.kvlbundle").write_bytes(b"an odd name")

    found = bundles_on(stick)
    assert [p.name for p in found] == ["TERM-3.KVLBUNDLE", "term-2.kvlbundle"]

    inbox = tmp_path / "data" / "bundles" / "inbox"
    owner = (os.getuid(), os.getgid())
    copied = copy_into(inbox, found, owner)
    assert copied == ["TERM-3.KVLBUNDLE", "term-2.kvlbundle"]
    assert (inbox / "term-2.kvlbundle").read_bytes() == b"bundle one"
    assert stat.S_IMODE((inbox / "term-2.kvlbundle").stat().st_mode) == 0o600
    assert sorted(p.name for p in inbox.iterdir()) == ["TERM-3.KVLBUNDLE", "term-2.kvlbundle"]
    # Made where missing, the bundles folder too, as the appliance makes it (its own).
    for folder in (inbox, inbox.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert folder.stat().st_uid == os.getuid()


def test_at_most_eight_are_taken(tmp_path: Path) -> None:
    for n in range(MAX_FILES + 3):
        (tmp_path / f"b{n:02d}.kvlbundle").write_bytes(b"x")
    assert len(bundles_on(tmp_path)) == MAX_FILES


@pytest.mark.parametrize("device", ["/dev/../etc/passwd", "sdb1", "/dev/sd b1", "/dev/"])
def test_what_is_not_a_device_path_is_refused(tmp_path: Path, device: str) -> None:
    layout = Layout(data=tmp_path / "data", mounts=tmp_path / "mounts")
    assert main([device], layout) == 1
    assert not (tmp_path / "mounts").exists()
