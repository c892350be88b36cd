"""The image's network agent (image/network.py) for tests, on temporary folders, run as
kovenlab-network.path runs it: `apply` whenever the appliance leaves a request, on its own
thread. Its reloads are counted, never made: no test touches the host's network."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from image.network import Layout, apply, boot

if TYPE_CHECKING:
    from pathlib import Path


class _StoppedError(Exception):
    pass


class Agent:
    """The agent over `system` (its /var/lib/kovenlab: the appliance's data folder is
    `system/appliance`); its clock runs `speed` times the wall's (its deadlines are its own)."""

    def __init__(self, system: Path, speed: float = 1.0) -> None:
        started, wall = datetime.now(UTC), time.monotonic()
        self.reloads = 0

        def clock() -> datetime:
            return started + timedelta(seconds=(time.monotonic() - wall) * speed)

        def reload() -> None:
            self.reloads += 1

        def sleep(seconds: float) -> None:
            if self._stop.wait(seconds / speed):
                raise _StoppedError  # a trial in progress ends with the test

        self.layout = Layout(
            esp=system / "esp",
            data=system,
            run=system / "run",
            reload=reload,
            restart_appliance=lambda: None,
            clock=clock,
            sleep=sleep,
        )
        self.layout.esp.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    @property
    def appliance_data(self) -> Path:
        return self.layout.data / "appliance"

    @property
    def folder(self) -> Path:
        """`network.agent_dir`."""
        return self.layout.paths.agent

    def boot(self) -> Agent:
        boot(self.layout)  # kovenlab-network.service, at boot
        return self

    def start(self) -> Agent:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            if self.layout.paths.request.exists():
                try:
                    apply(self.layout)
                except _StoppedError:
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
