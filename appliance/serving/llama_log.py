"""llama.cpp's own log (and ggml's) into Python's logging, as the logger `llama.cpp`, every
line at DEBUG: loading a model it reports every metadata key and tensor it reads (some 1,300
lines), and at its "error" level the oddities of a model's vocabulary it then overrides. They
belong in the log file when asked for, not on an operator's terminal; what does fail (a
model that does not load, a batch that does not decode) the appliance's own code reports,
with the error. llama-cpp-python's own callback prints to stderr instead, by a level of its
own; this one replaces it wherever a model or a vocabulary is loaded.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger("llama.cpp")

_MAX_LINE = 10_000  # characters kept of one line


class _Lines:
    """Text as llama.cpp writes it (pieces, lines, progress dots) into whole lines."""

    def __init__(self) -> None:
        self.pending = ""

    def feed(self, text: str) -> None:
        self.pending = (self.pending + text)[-_MAX_LINE:]
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.strip():
                log.debug("%s", line.rstrip())


_lines = _Lines()
_callback: Any = None  # the ctypes callback, kept: llama.cpp holds a pointer to it


def route() -> None:
    """llama.cpp's log to the `llama.cpp` logger from now on (again, should anything have
    set another callback since: importing llama-cpp-python's high-level half does)."""
    global _callback  # noqa: PLW0603 - one callback per process, alive while llama.cpp is
    import llama_cpp  # noqa: PLC0415 - only where llama.cpp is used

    if _callback is None:

        def forward(_level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
            if text:
                _lines.feed(text.decode("utf-8", "replace"))

        _callback = llama_cpp.llama_log_callback(forward)
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
