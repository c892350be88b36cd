"""Site bundles from a USB stick (as root): a site without a hub, or whose link is down, is
brought its models, release and packages on a stick.

udev starts `kovenlab-usb-import@DEVICE.service` for each file system on a USB disk, at
boot (a stick left in) and whenever one is plugged in. This mounts it read-only (nosuid,
nodev, noexec), copies each `*.kvlbundle` at its top into the appliance's bundle inbox
(`/var/lib/kovenlab/appliance/bundles/inbox`, the appliance's own), and unmounts it. The
appliance checks each offline against its keyring and applies it as an upload
(appliance/bundles.py), once: the same file on the stick at the next boot is not applied
again. `GET /v1/admin/bundles` lists them (`source`: `usb NAME`).

A stick is anyone's: nothing on it is trusted here but its bytes, which the appliance
checks. At most `MAX_FILES` bundles are taken, a name that is not a plain one is passed
over, a link or anything but a plain file is not followed, and a copy that would leave
the data disk with less than `SPARE_BYTES` free is not made.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kovenlab-usb-import")

SUFFIX = ".kvlbundle"
MAX_FILES = 8
SPARE_BYTES = 1 << 30
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,200}$")
_DEVICE = re.compile(r"^/dev/[A-Za-z0-9]+$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Layout:
    """Where the appliance's inbox is, and how a stick is mounted (tests: a folder)."""

    data: Path = Path("/var/lib/kovenlab/appliance")
    mounts: Path = Path("/run/kovenlab/usb")

    @property
    def inbox(self) -> Path:
        return self.data / "bundles" / "inbox"


def bundles_on(root: Path) -> list[Path]:
    """The stick's bundles: plain files with plain names at its top, at most MAX_FILES."""
    found = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not entry.name.lower().endswith(SUFFIX) or not _NAME.match(entry.name):
            continue
        if not entry.is_file(follow_symlinks=False):
            continue
        found.append(Path(entry.path))
    if len(found) > MAX_FILES:
        log.warning("%d bundles on the stick: the first %d taken", len(found), MAX_FILES)
    return found[:MAX_FILES]


def copy_into(inbox: Path, bundles: list[Path], owner: tuple[int, int] | None) -> list[str]:
    """Each bundle into the inbox, whole or not at all (a partial name, then renamed);
    the names copied."""
    _own_folders(inbox, owner)
    copied = []
    for source in bundles:
        size = source.stat(follow_symlinks=False).st_size
        if shutil.disk_usage(inbox).free - size < SPARE_BYTES:
            log.error("%s (%d bytes) would leave the data disk too full: not copied",
                      source.name, size)  # fmt: skip
            continue
        target = inbox / source.name
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as src:
            if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                continue
            with tempfile.NamedTemporaryFile(dir=inbox, prefix=".", delete=False) as out:
                partial = Path(out.name)
                try:
                    while block := src.read(_CHUNK):
                        out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
                except BaseException:
                    partial.unlink(missing_ok=True)
                    raise
        if owner is not None:
            os.chown(partial, *owner)
        partial.chmod(0o600)
        partial.replace(target)
        copied.append(source.name)
        log.info("%s copied to the appliance (%d bytes): it checks and applies it",
                 source.name, size)  # fmt: skip
    return copied


def _own_folders(inbox: Path, owner: tuple[int, int] | None) -> None:
    """The inbox, and the appliance's bundles folder above it, made where missing and the
    appliance's own (it moves the files out of the one into the other; made as root, a
    folder the appliance cannot write would refuse its own uploads too)."""
    for folder in (inbox.parent, inbox):
        if folder.is_dir():
            continue
        folder.mkdir(mode=0o700, parents=True)
        if owner is not None:
            os.chown(folder, *owner)


def import_device(device: str, layout: Layout) -> list[str]:
    """Mount `device` read-only, copy its bundles, unmount; the names copied."""
    if not _DEVICE.match(device):
        raise ValueError(f"{device!r} is not a block device's path")
    point = layout.mounts / device.rsplit("/", 1)[1]
    point.mkdir(parents=True, exist_ok=True)
    subprocess.run(  # noqa: S603 - fixed argv; the device's path checked above
        ["/usr/bin/mount", "-o", "ro,nosuid,nodev,noexec", device, str(point)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        bundles = bundles_on(point)
        if not bundles:
            log.info("no %s file at the top of %s", SUFFIX, device)
            return []
        owner_stat = layout.data.stat()
        return copy_into(layout.inbox, bundles, (owner_stat.st_uid, owner_stat.st_gid))
    finally:
        subprocess.run(  # noqa: S603 - fixed argv
            ["/usr/bin/umount", str(point)], check=False, capture_output=True, timeout=120
        )
        point.rmdir()


def main(argv: list[str] | None = None, layout: Layout | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="kovenlab-usb-import: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        log.error("usage: usb_import.py /dev/DEVICE")
        return 2
    try:
        import_device(args[0], layout or Layout())
    except (OSError, ValueError, subprocess.SubprocessError) as err:
        log.error("%s: %s", args[0], err)  # noqa: TRY400 - the message is the story
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
