"""A progress bar for long copies (model assembly), on stderr, that degrades to log lines."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    """Draw `[#####-----]  48%  120/250 MiB label` in place on a TTY; milestones otherwise."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._tty = self.stream.isatty()
        self._last_step = -1

    def update(self, done: int) -> None:
        fraction = min(done / self.total, 1.0)
        if self._tty:
            filled = int(fraction * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            mib = f"{done / 2**20:.0f}/{self.total / 2**20:.0f} MiB"
            self.stream.write(f"\r[{bar}] {fraction:4.0%}  {mib} {self.label}")
            self.stream.flush()
            return
        step = int(fraction * 4)  # 0%, 25%, 50%, 75%, 100%
        if step != self._last_step:
            self._last_step = step
            self.stream.write(f"{self.label}: {fraction:.0%} of {self.total / 2**20:.0f} MiB\n")
            self.stream.flush()

    def finish(self) -> None:
        self.update(self.total)
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
