"""The image updater's command line, RAUC's: the one module that runs it.

RAUC installs a signed bundle into the slot not booted, makes that slot the one to boot
next, and counts boot attempts in the bootloader; a slot that never gets marked good runs
out of attempts and the previous one boots again (the image's system.conf, keyring and
bootloader set this up). This module only calls the CLI, with the options the settings
give before each command (`update.rauc_options`: another system.conf, say):

- `rauc status --detailed --output-format=json`: the booted slot, and each slot's state,
  boot status and the version of the bundle installed in it;
- `rauc install BUNDLE`: the verified bundle into the other slot (a file, or a loopback URL
  RAUC streams it from);
- `rauc status mark-good booted`: the running release confirmed once it reached the hub (a
  failed boot is marked bad by the boot's own health check, image/health.py).

Where there is no `rauc` (a development machine), `Rauc.available()` is false and nothing
is run. Blocking: call it on a thread.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

ERROR_CHARS = 2000  # what an error keeps of the updater's output (the protocol's bound)
STATUS_TIMEOUT_S = 60.0
INSTALL_TIMEOUT_S = 3600.0


class InstallerError(Exception):
    """The updater failed, or said what it cannot be read from; the message holds the end
    of its output, bounded."""


@dataclass(frozen=True)
class Slot:
    name: str  # RAUC's slot name: `rootfs.0`
    bootname: str | None  # the bootloader's name for it: `A`
    state: str  # booted, active or inactive
    boot_status: str | None  # good or bad, as the bootloader says
    version: str | None  # the version of the bundle installed in it, if RAUC installed one


@dataclass(frozen=True)
class Status:
    booted: str | None  # the booted slot's bootname
    primary: str | None  # the slot to boot next (RAUC's boot_primary)
    slots: tuple[Slot, ...]

    @property
    def booted_slot(self) -> Slot | None:
        return next(
            (s for s in self.slots if s.state == "booted"),
            next((s for s in self.slots if self.booted and s.bootname == self.booted), None),
        )


class Rauc:
    """RAUC's CLI, `binary` with `options` before each command."""

    def __init__(self, binary: str = "rauc", options: Sequence[str] = ()) -> None:
        self.binary = binary
        self.options = tuple(options)

    def available(self) -> bool:
        return shutil.which(self.binary) is not None

    def status(self) -> Status:
        out = self._run(["status", "--detailed", "--output-format=json"], STATUS_TIMEOUT_S)
        try:
            return parse_status(json.loads(out))
        except (ValueError, TypeError, AttributeError) as err:
            raise InstallerError(f"`rauc status` answered what is not its JSON: {err}") from err

    def install(self, bundle: Path | str) -> None:
        """A bundle file, or a URL RAUC streams it from (appliance/update/stream.py)."""
        self._run(["install", str(bundle)], INSTALL_TIMEOUT_S)

    def mark_good(self) -> None:
        self._run(["status", "mark-good", "booted"], STATUS_TIMEOUT_S)

    def _run(self, args: list[str], timeout_s: float) -> str:
        binary = shutil.which(self.binary)
        if binary is None:
            raise InstallerError(f"no updater: `{self.binary}` is not installed")
        command = [binary, *self.options, *args]
        try:
            done = subprocess.run(  # noqa: S603 - our own binary and arguments, no shell
                command, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as err:
            raise InstallerError(f"`rauc {args[0]}` ran past {timeout_s:.0f} s") from err
        except OSError as err:
            raise InstallerError(f"`rauc {args[0]}` could not run: {err}") from err
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            raise InstallerError(
                f"`rauc {' '.join(args[:2])}` failed ({done.returncode}): "
                + said[-(ERROR_CHARS - 100) :]
            )
        return done.stdout


def parse_status(raw: Any) -> Status:
    """`rauc status --detailed --output-format=json` as a Status: `slots` is a list of
    one-key objects, slot name → its fields."""
    slots: list[Slot] = []
    for entry in raw.get("slots") or []:
        for name, fields in dict(entry).items():
            bundle = ((fields.get("slot_status") or {}).get("bundle")) or {}
            slots.append(
                Slot(
                    name=str(name),
                    bootname=_text(fields.get("bootname")),
                    state=str(fields.get("state") or ""),
                    boot_status=_text(fields.get("boot_status")),
                    version=_text(bundle.get("version")),
                )
            )
    return Status(
        booted=_text(raw.get("booted")), primary=_text(raw.get("boot_primary")), slots=tuple(slots)
    )


def _text(value: object) -> str | None:
    return None if value is None or value == "" else str(value)
