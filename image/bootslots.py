#!/usr/bin/python3 -I
"""RAUC's bootloader backend for the image: slots A and B as systemd-boot entries.

RAUC (`bootloader=custom` in /etc/rauc/system.conf) runs this as
`bootslots.py get-primary | set-primary SLOT | get-state SLOT | set-state SLOT good|bad`,
SLOT being a bootname, `A` or `B`. The boot order lives in the loader entries on the EFI
system partition, in the names systemd-boot's boot counting reads and writes itself:

- `kovenlab-a.conf`: a good slot (no counter);
- `kovenlab-b+1.conf`: a slot on trial, one boot left. systemd-boot renames it to
  `kovenlab-b+0-1.conf` before it boots it, so a boot that never gets as far as being
  marked good has used its try;
- `kovenlab-b+0.conf` (or `+0-N`): a bad slot. systemd-boot sorts an entry with no tries
  left after every other, so the next boot is the other slot's, with nothing running.

Every entry has `sort-key kovenlab` and, as its `version`, a generation: set-primary gives the
slot one more than any entry has. With no `default` in loader.conf, systemd-boot boots the
first entry in its order (entries with tries left first, then the highest version), which is
the newest primary that is not bad; get-primary reads the same order.

set-primary copies the slot's kernel and initrd (from the slot's own /boot) onto the EFI
system partition and takes the slot's kernel options from the slot's own image.json, so a
new version can change them. The running system's machine ID and host name go on the new
slot's command line: a node keeps both across an update (its fleet identity is on the data
partition, which no update touches).

Only the standard library: RAUC runs it with Debian's Python, before and after the
appliance's environment is replaced.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

SLOTS = ("A", "B")
SORT_KEY = "kovenlab"
ENTRY = re.compile(r"^kovenlab-(?P<slot>[ab])(?:\+(?P<left>\d+)(?:-(?P<done>\d+))?)?\.conf$")
# Where the build puts the image's own description in every slot's tree.
IMAGE_JSON = "usr/lib/kovenlab/image.json"
TRIES = 1  # a new slot gets one boot to prove itself


class SlotError(Exception):
    """A slot operation that cannot be done; the message says why."""


@dataclass(frozen=True)
class Layout:
    """Where things are on a node (the tests point it at temporary folders)."""

    esp: Path = Path("/boot/efi")
    cmdline: Path = Path("/proc/cmdline")
    etc: Path = Path("/etc")
    devices: Path = Path("/dev/disk/by-partlabel")
    # The slots' trees as folders, SLOT/ each, instead of mounted devices (the tests).
    trees: Path | None = None

    @property
    def entries(self) -> Path:
        return self.esp / "loader" / "entries"

    def device(self, slot: str) -> Path:
        return self.devices / f"kvl-root-{slot.lower()}"


@dataclass(frozen=True)
class Entry:
    """One loader entry: its slot, its boot counter (None: no counting, good) and version."""

    path: Path
    slot: str
    left: int | None
    done: int
    generation: int

    @property
    def bad(self) -> bool:
        return self.left == 0

    @property
    def trial(self) -> bool:
        return self.left is not None and self.left > 0


def entries(layout: Layout) -> list[Entry]:
    """The slots' entries in systemd-boot's order: bad ones last, then the newest first."""
    found: list[Entry] = []
    if not layout.entries.is_dir():
        return found
    for path in layout.entries.iterdir():
        match = ENTRY.match(path.name.lower())
        if match is None:
            continue
        left = match.group("left")
        found.append(
            Entry(
                path=path,
                slot=match.group("slot").upper(),
                left=None if left is None else int(left),
                done=int(match.group("done") or 0),
                generation=_generation(path),
            )
        )
    return sorted(found, key=lambda e: (e.bad, -e.generation, e.slot))


def _generation(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.strip().partition(" ")
        if key == "version" and value.strip().isdigit():
            return int(value.strip())
    return 0


def entry_of(layout: Layout, slot: str) -> Entry | None:
    return next((e for e in entries(layout) if e.slot == slot), None)


def get_primary(layout: Layout) -> str:
    """The slot the next boot starts."""
    order = entries(layout)
    if not order:
        raise SlotError(f"no slot has a loader entry in {layout.entries}")
    return order[0].slot


def get_state(layout: Layout, slot: str) -> str:
    entry = entry_of(layout, slot)
    return "bad" if entry is None or entry.bad else "good"


def set_state(layout: Layout, slot: str, state: str) -> None:
    """Good: the counter goes (systemd-boot counts no more). Bad: no tries left, so systemd-boot
    orders it last. A slot with no entry is bad already (RAUC marks the target of an install
    bad before writing it, also the first time)."""
    entry = entry_of(layout, slot)
    if entry is None:
        if state == "bad":
            return
        raise SlotError(f"slot {slot} has no loader entry to mark good")
    suffix = "" if state == "good" else "+0"
    target = entry.path.with_name(f"kovenlab-{slot.lower()}{suffix}.conf")
    if target != entry.path:
        entry.path.rename(target)
        _sync(target.parent)


def booted(layout: Layout) -> str | None:
    """The slot this system booted from (`rauc.slot=` on the kernel's command line)."""
    for word in layout.cmdline.read_text().split():
        if word.startswith("rauc.slot="):
            return word.removeprefix("rauc.slot=")
    return None


def set_primary(layout: Layout, slot: str) -> None:
    """The slot boots next: its kernel onto the EFI system partition, and an entry of the
    highest generation, on trial unless it is the slot running now (it booted already)."""
    running = booted(layout) == slot
    with _slot_tree(layout, slot, running) as tree:
        description = json.loads((tree / IMAGE_JSON).read_text())
        folder = layout.esp / f"kovenlab-{slot.lower()}"
        folder.mkdir(exist_ok=True)
        for pattern, name in (("vmlinuz-*", "vmlinuz"), ("initrd.img-*", "initrd.img")):
            found = sorted((tree / "boot").glob(pattern))
            if len(found) != 1:
                raise SlotError(f"slot {slot} has {len(found)} {pattern} in /boot, not one")
            _copy(found[0], folder / name)
    options = [description["slots"][slot]["options"], *_carried(layout)]
    generation = max((e.generation for e in entries(layout)), default=0) + 1
    text = (
        f"title Kovenlab Edge {description['version']} (slot {slot})\n"
        f"sort-key {SORT_KEY}\n"
        f"version {generation}\n"
        f"linux /kovenlab-{slot.lower()}/vmlinuz\n"
        f"initrd /kovenlab-{slot.lower()}/initrd.img\n"
        f"options {' '.join(options)}\n"
    )
    suffix = "" if running else f"+{TRIES}"
    target = layout.entries / f"kovenlab-{slot.lower()}{suffix}.conf"
    _write(target, text)
    for old in entries(layout):
        if old.slot == slot and old.path != target:
            old.path.unlink()
    _sync(layout.entries)


def _carried(layout: Layout) -> list[str]:
    """The running system's machine ID and host name, for the slot that boots next."""
    carried = []
    machine_id = _read(layout.etc / "machine-id")
    if re.fullmatch(r"[0-9a-f]{32}", machine_id):
        carried.append(f"systemd.machine_id={machine_id}")
    hostname = _read(layout.etc / "hostname")
    if re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", hostname):
        carried.append(f"systemd.hostname={hostname}")
    return carried


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


@contextmanager
def _slot_tree(layout: Layout, slot: str, running: bool) -> Iterator[Path]:
    """The slot's root file system: `/` for the running one, else mounted read-only."""
    if layout.trees is not None:
        yield layout.trees / slot
        return
    if running:
        yield Path("/")
        return
    mountpoint = Path(tempfile.mkdtemp(prefix="kovenlab-slot-", dir="/run"))
    device = layout.device(slot)
    try:
        subprocess.run(  # noqa: S603 - fixed argv
            ["/usr/bin/mount", "-o", "ro,noload", str(device), str(mountpoint)],
            check=True,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as err:
        mountpoint.rmdir()
        raise SlotError(f"cannot mount slot {slot} ({device}): {err.stderr.strip()}") from err
    try:
        yield mountpoint
    finally:
        subprocess.run(["/usr/bin/umount", str(mountpoint)], check=False)  # noqa: S603
        mountpoint.rmdir()


def _copy(source: Path, target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    with source.open("rb") as src, partial.open("wb") as out:
        shutil.copyfileobj(src, out, 1024 * 1024)
        out.flush()
        os.fsync(out.fileno())
    partial.replace(target)


def _write(target: Path, text: str) -> None:
    partial = target.with_name(target.name + ".partial")
    with partial.open("w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    partial.replace(target)


def _sync(folder: Path) -> None:
    """Renames on FAT reach the disk when the folder is synced."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def main(argv: list[str], layout: Layout | None = None) -> int:
    layout = layout or Layout()
    command, *args = argv or [""]
    try:
        if command == "get-primary" and not args:
            print(get_primary(layout))  # noqa: T201 - RAUC reads the answer from stdout
        elif command == "set-primary" and len(args) == 1 and args[0] in SLOTS:
            set_primary(layout, args[0])
        elif command == "get-state" and len(args) == 1 and args[0] in SLOTS:
            print(get_state(layout, args[0]))  # noqa: T201
        elif (
            command == "set-state"
            and len(args) == 2
            and args[0] in SLOTS
            and args[1] in ("good", "bad")
        ):
            set_state(layout, args[0], args[1])
        else:
            sys.stderr.write(
                "usage: bootslots.py get-primary | set-primary A|B | get-state A|B | "
                "set-state A|B good|bad\n"
            )
            return 2
    except (SlotError, OSError, KeyError, ValueError) as err:
        sys.stderr.write(f"bootslots: {command} {' '.join(args)}: {err}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
