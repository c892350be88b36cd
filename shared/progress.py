"""A progress bar for long copies and downloads (model assembly, model pulls), on stderr,
that degrades to log lines where stderr is not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Draw `[#####-----]  48%  120/250 MiB  31 MiB/s  4 s left  label` in place on a TTY;
    milestones (every quarter) otherwise."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._tty = self.stream.isatty()
        self._last_step = -1
        self._started = time.monotonic()
        self._first: int | None = None  # bytes there before this run (a resumed download)
        self._drawn = 0.0

    def update(self, done: int) -> None:
        if self._first is None:
            self._first = done
        fraction = min(done / self.total, 1.0)
        if self._tty:
            now = time.monotonic()
            if done < self.total and now - self._drawn < 0.1:
                return  # a terminal redrawn ten times a second is enough
            self._drawn = now
            filled = int(fraction * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            mib = f"{done / 2**20:.0f}/{self.total / 2**20:.0f} MiB"
            self.stream.write(f"\r[{bar}] {fraction:4.0%}  {mib}{self._rate(done)} {self.label}")
            self.stream.flush()
            return
        step = int(fraction * 4)  # 0%, 25%, 50%, 75%, 100%
        if step != self._last_step:
            self._last_step = step
            self.stream.write(
                f"{self.label}: {fraction:.0%} of {self.total / 2**20:.0f} MiB{self._rate(done)}\n"
            )
            self.stream.flush()

    def _rate(self, done: int) -> str:
        """`  31 MiB/s  4 s left` once a second has gone by, else nothing."""
        elapsed = time.monotonic() - self._started
        moved = done - (self._first or 0)
        if elapsed < 1 or moved <= 0:
            return ""
        rate = moved / elapsed
        left = (self.total - done) / rate
        return f"  {rate / 2**20:.1f} MiB/s  {left:.0f} s left" if done < self.total else ""

    def finish(self) -> None:
        self.update(self.total)
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
