"""A model replica in a worker process, as the gateway sees it: start, watch, restart.

The worker (appliance.serving.worker) holds the model; this side keeps the model's
vocabulary (to render templates and count tokens locally), forwards generations over the
worker's stdin/stdout, and watches it. A worker that exits, stops sending heartbeats, makes
no progress while busy, or grows past its memory limit is killed and restarted with
backoff; its in-flight requests end at once with WorkerUnavailableError (503 upstream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import psutil

from appliance.serving import ipc, isolation, scripted
from appliance.serving.devices import DeviceLayout
from appliance.serving.engine import (
    EngineError,
    EngineOptions,
    GenerationRequest,
    LlamaVocabulary,
    NotLoadedError,
    QueueFullError,
    Run,
    Vocabulary,
)
from appliance.serving.predictor import InFlight
from appliance.serving.sampling_options import GrammarError

if TYPE_CHECKING:
    from pathlib import Path

    from appliance.state.records import ModelRecord
    from shared.classes import IsolationLevel

log = logging.getLogger(__name__)


def load_vocabulary(record: ModelRecord) -> Vocabulary:
    """The vocabulary of a registered model, by its format. Blocking."""
    if record.format == scripted.FORMAT:
        return scripted.ByteVocabulary.load(record)
    return LlamaVocabulary.load(record)


class WorkerUnavailableError(EngineError):
    """The worker serving this request stopped; it is being restarted."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class SupervisorOptions:
    heartbeat_s: float = 1.0
    # No heartbeat for this long: the process is frozen.
    heartbeat_timeout_s: float = 10.0
    # Busy with no event for this long: a decode is hung.
    hang_timeout_s: float = 60.0
    load_timeout_s: float = 300.0
    memory_limit_mb: int = 0  # 0: no limit
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    # A worker that ran this long without trouble resets the backoff.
    stable_after_s: float = 60.0
    # Where each worker gets a cgroup of its own with these limits (I2), if anywhere.
    cgroups: isolation.Cgroups | None = None
    limits: isolation.Limits | None = None


@dataclass(frozen=True)
class Restart:
    """Why a worker was restarted. `kind` is one of exited, heartbeat, hung, memory."""

    model: str
    kind: str
    detail: str
    exit_code: int | None


@dataclass(frozen=True)
class WorkerStats:
    """What a worker reported in one heartbeat (its counters, as changes since the previous
    one) or between two (`steps`: the decode calls it made, with no counters)."""

    busy_slots: int
    tokens_generated: int
    prefix_tokens_reused: int
    steps: tuple[tuple[int, float], ...]  # each llama_decode call: (tokens, seconds)
    interval_s: float
    preemptions: int = 0


@dataclass
class _Flight:
    """What admission control needs to know of a submitted request."""

    priority: int
    prompt_tokens: int
    max_tokens: int
    arrival: int
    produced: int = 0
    running: bool = False  # holds a batch slot (the worker says when)

    def snapshot(self) -> InFlight:
        return InFlight(
            self.priority,
            self.prompt_tokens,
            self.max_tokens,
            self.produced,
            self.running,
            self.arrival,
        )


OnRestart = Callable[[Restart], Awaitable[None]]
OnStats = Callable[[WorkerStats], None]


class Replica:
    def __init__(
        self,
        record: ModelRecord,
        options: EngineOptions,
        supervision: SupervisorOptions | None = None,
        on_restart: OnRestart | None = None,
        on_stats: OnStats | None = None,
    ) -> None:
        self.record = record
        self.options = options
        self.supervision = supervision or SupervisorOptions()
        self._on_restart = on_restart
        self._on_stats = on_stats
        self.busy_slots = 0
        self._counts = (0, 0, 0)  # tokens generated, prefix tokens reused, preemptions
        self.layout: DeviceLayout | None = None  # where the worker put the model
        self.tokens_per_second = 0.0  # generated, over the last heartbeat
        self.submitted = 0  # requests routed here
        self._flights: dict[str, _Flight] = {}
        self.vocab: Vocabulary | None = None
        self.restarts = 0
        self.pid: int | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._cgroup: Path | None = None  # the running worker's own cgroup (I2)
        self._ready = asyncio.Event()
        self._runs: dict[str, Run] = {}
        self._last_heartbeat = 0.0
        self._last_progress = 0.0
        self._events_seen = -1
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._backoff = self.supervision.backoff_initial_s
        self._kill: tuple[str, str] | None = None  # (kind, detail) when the watchdog killed it
        self.load_error: str | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the vocabulary, start the worker and wait until it has loaded the model."""
        self.vocab = await asyncio.to_thread(load_vocabulary, self.record)
        self._task = asyncio.create_task(self._supervise(), name=f"kvl-supervise-{self.record.ref}")
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait(
            {ready, self._task},
            timeout=self.supervision.load_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if ready not in done:
            ready.cancel()
            raise NotLoadedError(
                self.load_error or f"worker for {self.record.ref} did not become ready"
            )

    async def close(self) -> None:
        self._closing = True
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ConnectionError, RuntimeError, AttributeError):
                process.stdin.write(ipc.encode({"type": "shutdown"}))  # type: ignore[union-attr]
                await process.stdin.drain()  # type: ignore[union-attr]
            try:
                async with asyncio.timeout(10):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all("the appliance is shutting down", retry_after=5)
        if self.vocab is not None:
            self.vocab.close()

    @property
    def isolation(self) -> IsolationLevel:
        """The level its worker runs at now, read back from the system (I1 when none runs)."""
        running = self._process is not None and self._process.returncode is None
        return isolation.level_of(self.pid if running else None, self._cgroup)

    @property
    def kill_reason(self) -> tuple[str, str] | None:
        """Why the watchdog killed the current worker, if it did."""
        return self._kill

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def n_ctx(self) -> int:
        return self.options.n_ctx

    @property
    def outstanding(self) -> int:
        return len(self._runs)

    @property
    def waiting(self) -> int:
        return max(0, len(self._runs) - self.options.n_slots)

    def require_vocab(self) -> Vocabulary:
        if self.vocab is None:
            raise NotLoadedError(f"model {self.record.ref} is not loaded")
        return self.vocab

    # -- requests --------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Run:
        process = self._process
        if not self.ready or process is None or process.stdin is None:
            raise WorkerUnavailableError(
                f"the worker of {self.record.ref} is restarting", retry_after=self._backoff
            )
        if len(self._runs) >= self.options.n_slots + self.options.max_queue:
            raise QueueFullError(self.waiting, retry_after=2.0 * (self.waiting + 1))
        request_id = uuid.uuid4().hex
        run = Run(
            asyncio.get_running_loop(),
            on_cancel=lambda: self._send({"type": "cancel", "id": request_id}),
        )
        self._runs[request_id] = run
        self._flights[request_id] = flight = _Flight(
            request.priority, len(request.prompt_tokens), request.max_tokens, self.submitted
        )
        run.flight = lambda: flight.snapshot() if request_id in self._flights else None
        self.submitted += 1
        self._send(ipc.generate_message(request_id, request))
        return run

    def _send(self, message: dict[str, object]) -> None:
        process = self._process
        if process is None or process.stdin is None or process.returncode is not None:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            process.stdin.write(ipc.encode(message))

    # -- supervision -----------------------------------------------------------------------

    async def _supervise(self) -> None:
        while not self._closing:
            started = time.monotonic()
            restart = await self._run_worker()
            if self.closing:  # set by close() while the worker ran
                return
            self.restarts += 1
            self._ready.clear()
            message = (
                f"the worker of {self.record.ref} stopped ({restart.detail}); it is restarting"
            )
            log.error("%s in %.1fs", message, self._backoff)
            self._fail_all(message, retry_after=self._backoff + 1)
            if self._on_restart is not None:
                await self._on_restart(restart)
            if time.monotonic() - started > self.supervision.stable_after_s:
                self._backoff = self.supervision.backoff_initial_s
            await asyncio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, self.supervision.backoff_max_s)

    async def _run_worker(self) -> Restart:
        spec = {
            "record": asdict(self.record),
            "options": asdict(self.options),
            "heartbeat_s": self.supervision.heartbeat_s,
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "appliance.serving.worker",
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=64 * 1024 * 1024,
            # Its own process group: a Ctrl-C on the appliance's terminal reaches the
            # appliance, which shuts the worker down in order.
            start_new_session=True,
        )
        self._process = process
        self.pid = process.pid
        s = self.supervision
        if s.cgroups is not None and s.limits is not None:
            self._cgroup = isolation.confine(s.cgroups, process.pid, s.limits)
        now = time.monotonic()
        self._last_heartbeat = self._last_progress = now
        self._events_seen = -1
        self._counts = (0, 0, 0)
        self.busy_slots = 0
        self._kill = None
        watchdog = asyncio.create_task(self._watch(process))
        try:
            await self._read(process)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        code = await process.wait()
        self._process = None
        isolation.release(self._cgroup)
        self._cgroup = None
        kind, detail = self.kill_reason or ("exited", f"exit status {code}")
        return Restart(self.record.ref, kind, detail, code)

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        if process.stdout is None:  # pragma: no cover - created with a pipe above
            return
        while line := await process.stdout.readline():
            try:
                message = ipc.decode(line)
            except ValueError:
                log.warning(
                    "worker %s wrote a line that is not a message: %r", process.pid, line[:200]
                )
                continue
            self._dispatch(message)

    def _dispatch(self, message: dict[str, object]) -> None:
        kind = message["type"]
        now = time.monotonic()
        if kind == "heartbeat":
            self._stats(message, now - self._last_heartbeat)
            self._last_heartbeat = now
            events = message.get("events_out")
            if events != self._events_seen or not self._runs:
                self._events_seen = events if isinstance(events, int) else -1
                self._last_progress = now
            return
        if kind == "steps":
            # Decode calls since the last report: progress, and the model's speed now.
            steps = message.get("steps")
            parsed = [_step(x) for x in steps] if isinstance(steps, list) else []
            self._last_progress = now
            if self._on_stats is not None:
                calls = tuple(x for x in parsed if x is not None)
                self._on_stats(WorkerStats(self.busy_slots, 0, 0, calls, 0.0))
            return
        if kind == "ready":
            found = message.get("placement")
            if isinstance(found, dict):
                self.layout = DeviceLayout.from_json(found)
            self._last_heartbeat = self._last_progress = now
            self._ready.set()
            return
        self._request_message(kind, message, now)

    def _request_message(self, kind: object, message: dict[str, object], now: float) -> None:
        request_id = str(message.get("id"))
        run = self._runs.get(request_id)
        if run is None:
            return
        self._last_progress = now
        flight = self._flights.get(request_id)
        if kind == "slot":
            if flight is not None:
                flight.running = bool(message.get("holds"))
            run.seated = run.seated or bool(message.get("holds"))
            return
        if kind == "delta" and flight is not None:
            # A delta with logprobs says how many tokens it completes; one without is about
            # one token (text held back for a stop string comes later, in one delta).
            tokens = message.get("logprobs")
            flight.produced += len(tokens) if isinstance(tokens, list) else 1
        if kind == "error":
            del self._runs[request_id]
            self._flights.pop(request_id, None)
            error_kind, text = message.get("kind"), str(message.get("message"))
            if error_kind == "grammar":
                run.fail(GrammarError(text))
            elif error_kind == "queue_full":
                run.fail(QueueFullError(self.waiting, retry_after=2.0))
            else:
                run.fail(EngineError(text))
            return
        event = ipc.event_from(message)
        if kind == "finished":
            del self._runs[request_id]
            self._flights.pop(request_id, None)
        run.emit(event)

    def _stats(self, message: dict[str, object], interval_s: float) -> None:
        generated, reused = message.get("tokens_generated"), message.get("prefix_tokens_reused")
        busy = message.get("busy_slots")
        if not (isinstance(generated, int) and isinstance(reused, int) and isinstance(busy, int)):
            return
        preempted = message.get("preemptions")
        preempted = preempted if isinstance(preempted, int) else self._counts[2]
        before, self._counts = self._counts, (generated, reused, preempted)
        self.busy_slots = busy
        if interval_s > 0:
            self.tokens_per_second = max(0, generated - before[0]) / interval_s
        if self._on_stats is not None:
            self._on_stats(
                WorkerStats(
                    busy,
                    generated - before[0],
                    reused - before[1],
                    (),
                    interval_s,
                    preempted - before[2],
                )
            )

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        s = self.supervision
        while True:
            await asyncio.sleep(s.heartbeat_s)
            now = time.monotonic()
            if self.ready and now - self._last_heartbeat > s.heartbeat_timeout_s:
                self._kill = ("heartbeat", f"no heartbeat for {now - self._last_heartbeat:.0f}s")
            elif self._runs and now - self._last_progress > s.hang_timeout_s:
                self._kill = (
                    "hung",
                    f"no progress for {now - self._last_progress:.0f}s while busy",
                )
            elif s.memory_limit_mb and _rss_mb(process.pid) > s.memory_limit_mb:
                self._kill = ("memory", f"resident memory over {s.memory_limit_mb} MB")
            if self._kill is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                return

    def flights(self) -> list[InFlight]:
        """The requests submitted here and not yet finished."""
        return [flight.snapshot() for flight in self._flights.values()]

    def _fail_all(self, message: str, retry_after: float) -> None:
        self._flights = {}
        runs, self._runs = self._runs, {}
        for run in runs.values():
            run.fail(WorkerUnavailableError(message, retry_after=retry_after))


def _step(value: object) -> tuple[int, float] | None:
    """A step the worker reported, `[tokens, seconds]`; None for anything else."""
    if isinstance(value, list) and len(value) == 2:
        n, seconds = value
        if isinstance(n, int) and isinstance(seconds, (int, float)) and seconds >= 0:
            return n, float(seconds)
    return None


def _rss_mb(pid: int) -> float:
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return 0.0
