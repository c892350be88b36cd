"""The boot's health check: the slot is marked good only once the appliance serves.

`kovenlab-health.service` runs this at every boot, after the appliance has started. It waits
for the appliance to answer `/healthz` and `/readyz` with 200 on its LAN port (HTTP, or
HTTPS once the node has its certificate; a local probe, so the certificate is not checked),
then runs `rauc status mark-good`. It gives up when the appliance has restarted
`KVL_HEALTH_MAX_RESTARTS` times (a crash loop: it will not get better) or after
`KVL_HEALTH_READY_S` seconds.

A slot on trial (systemd-boot counted this boot: it sets the `LoaderBootCountPath` EFI
variable only for an entry with a counter) that fails is marked bad (`rauc status
mark-bad`) and the node reboots into the previous slot, by itself. A slot that was good
already stays as it is (no slot is better to go back to), and the failure is reported.

Every outcome is appended to `/var/lib/kovenlab/update/health.jsonl` on the data partition,
which both slots share: after a fallback the previous slot can tell why (one JSON object a
line: time, slot, version, trial, result `good|bad|unhealthy`, reason).

Only the standard library: it runs with Debian's Python, whatever the appliance's state.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("kovenlab-health")

LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"  # systemd-boot's EFI variables
UNIT = "kovenlab-appliance.service"


@dataclass(frozen=True)
class Checks:
    """What is checked, how long for, and where things are (the tests change them)."""

    port: int = 8080
    ready_s: float = 900.0
    max_restarts: int = 5
    interval_s: float = 2.0
    report: Path = Path("/var/lib/kovenlab/update/health.jsonl")
    cmdline: Path = Path("/proc/cmdline")
    efivars: Path = Path("/sys/firmware/efi/efivars")
    image_json: Path = Path("/usr/lib/kovenlab/image.json")
    paths: tuple[str, ...] = field(default=("/healthz", "/readyz"))

    @classmethod
    def from_environment(cls) -> Checks:
        return cls(
            ready_s=float(os.environ.get("KVL_HEALTH_READY_S", cls.ready_s)),
            max_restarts=int(os.environ.get("KVL_HEALTH_MAX_RESTARTS", cls.max_restarts)),
        )


class Appliance:
    """The appliance as the check sees it: its answers and its restarts."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.context = ssl.create_default_context()
        self.context.check_hostname = False
        self.context.verify_mode = ssl.CERT_NONE  # a probe of this machine, over loopback

    def answers(self, path: str) -> bool:
        # HTTPS first: plain HTTP to the TLS port gets an answer (nginx's 400), not an error.
        for scheme in ("https", "http"):
            url = f"{scheme}://127.0.0.1:{self.port}{path}"
            try:
                with urllib.request.urlopen(  # noqa: S310 - a fixed loopback URL
                    url, timeout=5, context=self.context if scheme == "https" else None
                ) as answer:
                    return int(answer.status) == 200
            except urllib.error.HTTPError:
                return False
            except (urllib.error.URLError, OSError):
                continue
        return False

    def restarts(self) -> int:
        shown = subprocess.run(  # noqa: S603 - fixed argv
            ["/usr/bin/systemctl", "show", "--property=NRestarts", "--value", UNIT],
            capture_output=True,
            text=True,
            check=False,
        )
        return int(shown.stdout.strip() or 0)


def wait_healthy(
    checks: Checks,
    appliance: Appliance,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """None once every path answers 200; otherwise why not."""
    started = clock()
    while True:
        if all(appliance.answers(path) for path in checks.paths):
            return None
        restarts = appliance.restarts()
        if restarts >= checks.max_restarts:
            return f"the appliance restarted {restarts} times without becoming ready"
        if clock() - started > checks.ready_s:
            return f"the appliance was not ready after {checks.ready_s:g} s"
        sleep(checks.interval_s)


def trial(checks: Checks) -> str | None:
    """The entry systemd-boot counted this boot, if it did (the slot is on trial)."""
    variable = checks.efivars / f"LoaderBootCountPath-{LOADER_GUID}"
    try:
        raw = variable.read_bytes()
    except OSError:
        return None
    # 4 bytes of attributes, then UTF-16, NUL-terminated
    return raw[4:].decode("utf-16-le", errors="replace").rstrip("\0") or None


def booted_slot(checks: Checks) -> str | None:
    for word in checks.cmdline.read_text().split():
        if word.startswith("rauc.slot="):
            return word.removeprefix("rauc.slot=")
    return None


def version(checks: Checks) -> str | None:
    try:
        return str(json.loads(checks.image_json.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


RAUC_TRIES = 5
RAUC_RETRY_S = 5.0


def rauc(
    *args: str,
    run: Callable[..., object] = subprocess.run,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """`rauc status ARGS`, tried again after a failure (5, 10, 20, 40 s): its command line
    asks RAUC's D-Bus service, which a boot busy with the appliance's start can leave
    unanswered past the client's timeout; a slot left unmarked for that would be rolled
    back at the next boot though it served."""
    for attempt in range(RAUC_TRIES):
        try:
            run(["/usr/bin/rauc", "status", *args], check=True)
        except subprocess.CalledProcessError as err:
            if attempt == RAUC_TRIES - 1:
                raise
            wait = RAUC_RETRY_S * 2**attempt
            log.warning("`rauc status %s` failed (exit %d); again in %g s",
                        " ".join(args), err.returncode, wait)  # fmt: skip
            sleep(wait)
        else:
            return


def reboot() -> None:
    # --no-block: this unit is part of the boot the reboot ends.
    subprocess.run(["/usr/bin/systemctl", "reboot", "--no-block"], check=True)


def check(
    checks: Checks,
    appliance: Appliance,
    mark: Callable[..., None] = rauc,
    restart: Callable[[], None] = reboot,
) -> int:
    """One boot's check: mark good, or mark bad and reboot (a trial), or report."""
    counted = trial(checks)
    why = wait_healthy(checks, appliance)
    record: dict[str, object] = {
        "time": time.time(),
        "slot": booted_slot(checks),
        "version": version(checks),
        "trial": counted is not None,
        "result": "good",
        "reason": why,
    }
    if why is None:
        mark("mark-good")
        _append(checks.report, record)
        log.info("the appliance is ready: slot %s marked good", record["slot"])
        return 0
    if counted is None:
        record["result"] = "unhealthy"
        log.error("%s; this slot was good already, so it stays", why)
        _append(checks.report, record)
        return 1
    record["result"] = "bad"
    _append(checks.report, record)
    mark("mark-bad")
    log.error("%s: slot %s marked bad, rebooting into the previous slot", why, record["slot"])
    restart()
    return 1


def _append(report: Path, record: dict[str, object]) -> None:
    report.parent.mkdir(parents=True, exist_ok=True)
    with report.open("a") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="kovenlab-health: %(message)s")
    checks = Checks.from_environment()
    try:
        return check(checks, Appliance(checks.port))
    except subprocess.CalledProcessError as err:
        # Not marked good: a slot on trial has used its try, so the next boot is the other.
        log.error("`%s` failed (exit %d)", " ".join(err.cmd), err.returncode)  # noqa: TRY400
        return 1


if __name__ == "__main__":
    sys.exit(main())
