"""The appliance's recent log records, kept in memory for the hub to read (`GET
/v1/fleet/logs` on the fleet listener): an operator reads and follows a node's log
through the tunnel, with no shell on it.

A bounded ring: the last `MAX_RECORDS` records or `MAX_BYTES` of them, whichever is less,
each numbered (`seq`, from 1, never reused while the process lives) so a reader asks for
what came after the last one it has. Under systemd the journal holds more, for longer; the
ring is what is served all the same: it is bounded (a reader cannot make the node read
gigabytes), it needs no journal access, and it is the same on any OS and in the tests.

One ring per process, on the root logger (logging is per process too): several
appliances in one process, as in the tests, share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from shared import protocol
from shared.supervise import wait_until_set

MAX_RECORDS = 5000
MAX_BYTES = 2 << 20
MAX_MESSAGE = 8192  # characters of one record's message with its traceback
MAX_ANSWER_BYTES = 1 << 20  # of the records one answer carries
MAX_LIMIT = protocol.MAX_LOG_RECORDS  # records one answer carries
MAX_WAIT_S = 30.0  # a long poll's longest wait
OVERHEAD = 96  # bytes counted for a record besides its text (its JSON keys and numbers)
LEVELS = protocol.LOG_LEVELS
LEVEL_NUMBERS: dict[str, int] = {name: logging.getLevelNamesMapping()[name] for name in LEVELS}


@dataclass(frozen=True)
class Kept:
    seq: int
    time: float
    level: str
    levelno: int
    logger: str
    message: str

    @property
    def size(self) -> int:
        return OVERHEAD + len(self.logger) + len(self.message.encode())

    def record(self) -> protocol.LogRecord:
        # A custom level's name is none of the protocol's: the standard one below it.
        level: protocol.LogLevel = "DEBUG"
        for name in LEVELS:
            if self.levelno >= LEVEL_NUMBERS[name]:
                level = name
        return protocol.LogRecord(
            seq=self.seq, time=self.time, level=level, logger=self.logger, message=self.message
        )


@dataclass(frozen=True)
class Read:
    records: list[Kept]
    next_after: int  # what the reader passes as `after` next (records skipped by level too)
    oldest: int  # the oldest seq the ring holds, 0 when empty
    missed: int  # records after `after` that the ring no longer held


def truncate(text: str, limit: int = MAX_MESSAGE) -> str:
    """At most ``limit`` characters (and a note of how many were cut), as text any JSON
    reader and database takes: no NUL, no lone surrogate (a byte name decoded with
    `surrogateescape`)."""
    text = text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"{text[:limit]}… [{cut} characters cut]"


def with_traceback(message: str, trace: str, limit: int = MAX_MESSAGE) -> str:
    """The message and its traceback within about ``limit``: a long one keeps the head of
    the message and the end of the traceback (the exception and the frames nearest it)."""
    if len(message) + 1 + len(trace) <= limit:
        return f"{message}\n{trace}"
    head = truncate(message, limit // 4)
    room = max(limit - len(head) - 1, 0)
    if len(trace) <= room:
        return f"{head}\n{trace}"
    return f"{head}\n[{len(trace) - room} characters cut] …{trace[-room:]}"


class LogRing(logging.Handler):
    def __init__(self, max_records: int = MAX_RECORDS, max_bytes: int = MAX_BYTES) -> None:
        super().__init__(logging.DEBUG)
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._kept: deque[Kept] = deque()
        self._bytes = 0
        self._seq = 0
        self._guard = threading.Lock()  # records come from any thread
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._formatter = logging.Formatter()

    @property
    def waiting(self) -> int:
        """Long polls waiting for a record now."""
        with self._guard:
            return len(self._waiters)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            trace = ""
            if record.exc_info:
                trace = self._formatter.formatException(record.exc_info)
            elif record.exc_text:
                trace = record.exc_text
            if record.stack_info:
                trace = f"{trace}\n{record.stack_info}" if trace else record.stack_info
            if trace:
                message = with_traceback(message, trace)
        except Exception:  # noqa: BLE001 - a bad format string is logging's to report
            self.handleError(record)
            return
        with self._guard:
            self._seq += 1
            kept = Kept(
                self._seq,
                record.created,
                record.levelname,
                record.levelno,
                truncate(record.name, 160),
                truncate(message, MAX_MESSAGE + 64),  # (with_traceback's notes)
            )
            self._kept.append(kept)
            self._bytes += kept.size
            while len(self._kept) > self._max_records or self._bytes > self._max_bytes:
                self._bytes -= self._kept.popleft().size
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(event.set)

    def read(
        self,
        after: int = 0,
        limit: int = 100,
        level: int = logging.DEBUG,
        max_bytes: int = MAX_ANSWER_BYTES,
        *,
        tail: bool = False,
    ) -> Read:
        """Up to ``limit`` records after seq ``after`` at ``level`` or above, at most
        ``max_bytes`` of them (at least one, whatever its size): the first ones, or with
        ``tail`` the last ones (oldest first either way). An ``after`` beyond the last
        seq is of an earlier run of the process (numbers start again at 1): read from
        the start."""
        with self._guard:
            last = self._seq
            if after > last:
                after = 0
            kept = [k for k in self._kept if k.seq > after] if last > after else []
            oldest = self._kept[0].seq if self._kept else 0
        records: list[Kept] = []
        size = 0
        missed = max(0, oldest - after - 1) if oldest else 0
        if tail:
            for entry in reversed(kept):
                if entry.levelno >= level:
                    if len(records) == limit or (records and size + entry.size > max_bytes):
                        break
                    records.append(entry)
                    size += entry.size
            return Read(records[::-1], kept[-1].seq if kept else after, oldest, missed)
        next_after = after
        for entry in kept:
            if entry.levelno >= level:
                if len(records) == limit or (records and size + entry.size > max_bytes):
                    break
                records.append(entry)
                size += entry.size
            next_after = entry.seq
        return Read(records, next_after, oldest, missed)

    async def wait(
        self, after: int, timeout_s: float, limit: int = 100, level: int = logging.DEBUG
    ) -> Read:
        """:meth:`read`, waiting up to ``timeout_s`` for a record it would answer."""
        deadline = time.monotonic() + timeout_s
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._guard:
            self._waiters.add(waiter)
        try:
            while True:
                event.clear()
                found = self.read(after, limit, level)
                left = deadline - time.monotonic()
                if found.records or left <= 0:
                    return found
                after = found.next_after  # records below the level: skipped, not read again
                await wait_until_set(event, left)
        finally:
            with self._guard:
                self._waiters.discard(waiter)


_RING: LogRing | None = None
_INSTALLING = threading.Lock()


def ring() -> LogRing:
    """The process's ring, on the root logger from the first call on."""
    global _RING  # noqa: PLW0603 - one per process, as the root logger is
    with _INSTALLING:
        if _RING is None:
            _RING = LogRing()
            logging.getLogger().addHandler(_RING)
        return _RING


def level_number(name: str) -> int | None:
    """A level by its name (any case), None for one that is not a level."""
    upper = name.strip().upper()
    return LEVEL_NUMBERS.get(upper)
