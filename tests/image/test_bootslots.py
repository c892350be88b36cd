"""RAUC's bootloader backend (image/bootslots.py) on an EFI system partition in a folder: the
loader entries it writes are the ones systemd-boot picks from, in systemd-boot's order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from image.bootslots import Layout, entries, get_primary, get_state, main, set_primary, set_state
from image.build import image_description

MACHINE_ID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    """Slot A booted, as the image is first flashed: its entry good, generation 1; both slots'
    trees with a kernel, an initrd and image.json."""
    made = Layout(
        esp=tmp_path / "esp",
        cmdline=tmp_path / "cmdline",
        etc=tmp_path / "etc",
        trees=tmp_path / "trees",
    )
    made.entries.mkdir(parents=True)
    (made.entries / "kovenlab-a.conf").write_text("sort-key kovenlab\nversion 1\n")
    made.cmdline.write_text("root=PARTUUID=x rw quiet rauc.slot=A\n")
    made.etc.mkdir()
    (made.etc / "machine-id").write_text(MACHINE_ID + "\n")
    (made.etc / "hostname").write_text("lab-server\n")
    assert made.trees is not None
    for slot in ("A", "B"):
        boot = made.trees / slot / "boot"
        boot.mkdir(parents=True)
        (boot / "vmlinuz-6.1.0-1-amd64").write_text(f"kernel of {slot}")
        (boot / "initrd.img-6.1.0-1-amd64").write_text(f"initrd of {slot}")
        description = made.trees / slot / "usr/lib/kovenlab/image.json"
        description.parent.mkdir(parents=True)
        description.write_text(json.dumps(image_description()))
    return made


def names(layout: Layout) -> list[str]:
    return [entry.path.name for entry in entries(layout)]


def test_an_install_puts_the_new_slot_on_trial_first(layout: Layout) -> None:
    # RAUC marks the target bad before writing it (no entry yet: nothing to do), then makes it
    # primary once written.
    set_state(layout, "B", "bad")
    set_primary(layout, "B")

    assert names(layout) == ["kovenlab-b+1.conf", "kovenlab-a.conf"]
    assert get_primary(layout) == "B"
    assert (layout.esp / "kovenlab-b/vmlinuz").read_text() == "kernel of B"
    assert (layout.esp / "kovenlab-b/initrd.img").read_text() == "initrd of B"
    text = (layout.entries / "kovenlab-b+1.conf").read_text()
    assert "sort-key kovenlab\nversion 2\n" in text
    assert "linux /kovenlab-b/vmlinuz\ninitrd /kovenlab-b/initrd.img\n" in text
    options = text.split("options ", 1)[1].split()
    # B's root and name from B's own image.json; the machine's identity carried over
    assert "rauc.slot=B" in options
    assert any(o.startswith("root=PARTUUID=") for o in options)
    assert f"systemd.machine_id={MACHINE_ID}" in options
    assert "systemd.hostname=lab-server" in options


def test_a_trial_that_used_its_try_falls_back_to_the_previous_slot(layout: Layout) -> None:
    set_primary(layout, "B")
    # systemd-boot counts the boot before starting it: +1 becomes +0-1
    (layout.entries / "kovenlab-b+1.conf").rename(layout.entries / "kovenlab-b+0-1.conf")

    assert get_state(layout, "B") == "bad"
    assert get_primary(layout) == "A"
    assert names(layout) == ["kovenlab-a.conf", "kovenlab-b+0-1.conf"]


def test_marked_good_on_its_trial_boot_the_new_slot_stays_primary(layout: Layout) -> None:
    set_primary(layout, "B")
    (layout.entries / "kovenlab-b+1.conf").rename(layout.entries / "kovenlab-b+0-1.conf")
    layout.cmdline.write_text("rauc.slot=B\n")

    set_state(layout, "B", "good")

    assert names(layout) == ["kovenlab-b.conf", "kovenlab-a.conf"]
    assert (get_primary(layout), get_state(layout, "B"), get_state(layout, "A")) == (
        "B",
        "good",
        "good",
    )


def test_marked_bad_a_slot_goes_last_and_the_next_install_replaces_its_entry(
    layout: Layout,
) -> None:
    set_primary(layout, "B")
    set_state(layout, "B", "bad")
    assert names(layout) == ["kovenlab-a.conf", "kovenlab-b+0.conf"]
    assert get_primary(layout) == "A"

    set_primary(layout, "B")  # the next version, into the same slot
    assert names(layout) == ["kovenlab-b+1.conf", "kovenlab-a.conf"]
    assert "version 3\n" in (layout.entries / "kovenlab-b+1.conf").read_text()


def test_the_newest_generation_is_primary_among_good_slots(layout: Layout) -> None:
    set_primary(layout, "B")
    set_state(layout, "B", "good")
    set_primary(layout, "A")  # A is running: made primary without a trial
    assert names(layout) == ["kovenlab-a.conf", "kovenlab-b.conf"]
    assert get_primary(layout) == "A"
    assert "version 3\n" in (layout.entries / "kovenlab-a.conf").read_text()


def test_the_command_line_rauc_calls(layout: Layout, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["get-primary"], layout) == 0
    assert main(["get-state", "B"], layout) == 0
    assert main(["set-primary", "B"], layout) == 0
    assert main(["get-primary"], layout) == 0
    assert main(["set-state", "B", "good"], layout) == 0
    assert capsys.readouterr().out.split() == ["A", "bad", "B"]
    assert main(["set-state", "C", "good"], layout) == 2
    assert main(["get-current"], layout) == 2
    # a slot with no entry cannot be marked good: RAUC hears why
    (layout.entries / "kovenlab-a.conf").unlink()
    assert main(["set-state", "A", "good"], layout) == 1
    assert "slot A has no loader entry" in capsys.readouterr().err
