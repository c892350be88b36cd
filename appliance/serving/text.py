"""Turning generated token bytes into text: incremental UTF-8 and stop strings. Pure code."""

from __future__ import annotations

import codecs


class TextAssembler:
    """Feed token bytes, get text that is safe to send now.

    Holds back bytes of an unfinished UTF-8 character and any tail that could still become a
    stop string; reports when a stop string completes (the stop string itself is not emitted,
    as in OpenAI's API).
    """

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.text = ""  # everything emitted so far

    def feed(self, data: bytes) -> str:
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(data)
        cut = self._earliest_stop()
        if cut is not None:
            self.stopped = True
            return self._emit(self._pending[:cut])
        if self._hold == 0:
            return self._emit(self._pending)
        safe = len(self._pending) - self._hold
        return self._emit(self._pending[:safe]) if safe > 0 else ""

    def flush(self) -> str:
        """The rest, at the end of generation (no stop string came)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        return self._emit(self._pending)

    def _earliest_stop(self) -> int | None:
        hits = [i for s in self._stop if (i := self._pending.find(s)) >= 0]
        return min(hits) if hits else None

    def _emit(self, text: str) -> str:
        self._pending = self._pending[len(text) :] if not self.stopped else ""
        self.text += text
        return text
