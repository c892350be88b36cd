"""First boot of the appliance image: the provisioning file from the EFI system partition.

`kvl image configure` writes `kovenlab.json` onto the image's EFI system partition (FAT,
mounted at /boot/efi). `kovenlab-firstboot.service` runs this before the appliance, at every
boot until the node has enrolled:

- a valid file is copied onto the data partition (mode 0600, the appliance's own), the
  appliance is pointed at it (`fleet.provisioning_file`, in `appliance.env`) and the host name
  becomes the node's name; the appliance enrolls when it starts, or, on a site without a
  hub (a file with a bootstrap key), takes that admin key;
- with no file the appliance serves its LAN alone (a private site), and the journal says how
  to join a fleet; a file copied at an earlier boot stays in force;
- a file that is there but not valid fails closed, as Ignition does: nothing is copied, the
  unit fails, so the appliance does not start, and the console and the journal name every
  problem; the next boot tries again.

It runs with the appliance's own Python (`/opt/kovenlab/venv`), so the file is checked by
the model the appliance reads it with.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.files import write_private
from shared.provisioning import Provisioning, ProvisioningError

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("kovenlab-firstboot")

FILE_NAME = "kovenlab.json"
MAX_BYTES = 64 * 1024  # a provisioning file is a few hundred bytes


@dataclass(frozen=True)
class Layout:
    """Where the image keeps things (the tests point it at temporary folders)."""

    esp: Path = Path("/boot/efi")
    data: Path = Path("/var/lib/kovenlab")
    etc: Path = Path("/etc")

    @property
    def source(self) -> Path:
        return self.esp / FILE_NAME

    @property
    def target(self) -> Path:
        return self.data / FILE_NAME

    @property
    def env_file(self) -> Path:
        """Read by kovenlab-appliance.service (`EnvironmentFile=`)."""
        return self.data / "appliance.env"

    @property
    def appliance_data(self) -> Path:
        return self.data / "appliance"


def hostname_for(name: str) -> str | None:
    """The node's name as a host name (one DNS label), or None when nothing is left of it."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].rstrip("-")
    return label or None


def _set_hostname(name: str) -> None:
    socket.sethostname(name)


def first_boot(layout: Layout, set_hostname: Callable[[str], None] = _set_hostname) -> str:
    """Apply the provisioning file on the EFI system partition, if any; what was done.

    Raises ProvisioningError (nothing changed) when the file is there but not valid.
    """
    if not layout.source.is_file():
        if layout.target.is_file():
            return (
                f"no {FILE_NAME} on the EFI system partition; the one copied at an earlier "
                f"boot ({layout.target}) stays in force until the node has enrolled"
            )
        return (
            f"no {FILE_NAME} on the EFI system partition: the appliance serves its LAN "
            "without a hub. To join a fleet, write one with `kvl hub provision` and "
            "`kvl image configure`, or copy it onto the EFI system partition, and reboot"
        )
    if layout.source.stat().st_size > MAX_BYTES:
        raise ProvisioningError(
            f"{layout.source} is larger than {MAX_BYTES} bytes: not a provisioning file"
        )
    document = Provisioning.load(layout.source)  # raises with every problem named
    hub, key = document.hub, document.bootstrap_key
    if hub is not None:
        then = f"hub {hub.url}; the appliance enrolls when it starts"
    elif key is not None:
        then = (
            f"no hub; the appliance takes the bootstrap admin key {key.prefix} of account "
            f"{key.account} when it starts (once)"
        )
    else:  # pragma: no cover - the model refuses a file with neither
        raise ProvisioningError(f"{layout.source} names neither a hub nor a bootstrap key")
    write_private(layout.target, document.text())
    owner = layout.appliance_data.stat() if layout.appliance_data.is_dir() else None
    if owner is not None:  # the appliance runs as its own user, and reads the file
        os.chown(layout.target, owner.st_uid, owner.st_gid)
    _write_env(layout.env_file, appliance_environment(layout.target))
    hostname = hostname_for(document.name)
    if hostname is not None:
        _write_env(layout.etc / "hostname", hostname + "\n")
        set_hostname(hostname)
    return f"provisioned from {layout.source}: node {document.name} (host name {hostname}), {then}"


def appliance_environment(target: Path) -> str:
    """The appliance's settings from the provisioning file (`appliance.env`): where it is
    kept (`target`). The site's network, its proxy included, is the network agent's
    (image/network.py, `proxy.env`)."""
    return f"KVL_FLEET__PROVISIONING_FILE={target}\n"


def _write_env(path: Path, text: str) -> None:
    """Replace a small file whole, so a power cut leaves the old one or the new one."""
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    partial.chmod(0o644)
    partial.replace(path)


def main(layout: Layout | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="kovenlab-firstboot: %(message)s")
    layout = layout or Layout()
    try:
        log.info(first_boot(layout))
    except ProvisioningError as err:
        log.error(  # noqa: TRY400 - the message is the whole story, a traceback is noise
            "%s. Failing closed: the appliance does not start until the file on the EFI "
            "system partition is fixed (`kvl image configure`), then the node is rebooted",
            err,
        )
        return 1
    except OSError as err:
        log.error("could not apply %s: %s", layout.source, err)  # noqa: TRY400
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
