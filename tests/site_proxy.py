"""A site's HTTPS proxy for tests: Debian's tinyproxy on loopback, in the foreground, its
log at `Connect` level (each CONNECT's target). QEMU's user-mode network brings a guest's
calls to its LAN's .2 here."""

from __future__ import annotations

import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.conftest import free_port

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@dataclass
class SiteProxy:
    port: int
    log: Path
    process: subprocess.Popen[bytes]

    def seen(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


@contextmanager
def tinyproxy(folder: Path) -> Iterator[SiteProxy]:
    binary = shutil.which("tinyproxy")
    assert binary is not None, "tinyproxy is not installed: run `just setup-system`"
    port, log = free_port(), folder / "proxy.log"
    conf = folder / "tinyproxy.conf"
    conf.write_text(
        f'Port {port}\nListen 127.0.0.1\nTimeout 60\nLogFile "{log}"\nLogLevel Connect\n'
        "MaxClients 50\nAllow 127.0.0.1\n"  # no ConnectPort: CONNECT to any port
    )
    process = subprocess.Popen([binary, "-d", "-c", str(conf)], stderr=subprocess.DEVNULL)
    try:
        yield SiteProxy(port, log, process)
    finally:
        process.kill()
        process.wait()
