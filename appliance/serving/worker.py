"""A model worker: one model replica in its own process (isolation level I1).

Started by the supervisor as ``python -m appliance.serving.worker SPEC`` (SPEC: the model
record and engine options as JSON). Commands arrive on stdin and events leave on stdout,
one JSON object per line (appliance.serving.ipc); logs go to stderr. A crash here costs
only this worker's in-flight requests; the supervisor restarts it.

Plain threads, no event loop: the batching thread writes the events of each step to stdout
itself, all of them in one write after the step (one pipe write and one wake-up of the
appliance a step, not one a token), and no thread hand-off on this side.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from appliance.serving import ipc
from appliance.serving.engine import EngineOptions, Event, Failed, Finished, Job, SlotChange
from appliance.serving.sampling_options import GrammarError
from appliance.state.records import ModelRecord

if TYPE_CHECKING:
    from appliance.serving.batching import BatchEngine
    from appliance.serving.scripted import ScriptedEngine

log = logging.getLogger("kvl.worker")
# How often the decode calls made since the last report go to the supervisor (seconds).
STEPS_S = 0.5


def engine_for(record: ModelRecord, options: EngineOptions) -> BatchEngine | ScriptedEngine:
    """The engine of the record's format: llama.cpp's continuous batching for GGUF, the
    script for a scripted model (which then never imports llama.cpp)."""
    if record.format == "script":
        from appliance.serving.scripted import ScriptedEngine  # noqa: PLC0415

        return ScriptedEngine(record, options)
    from appliance.serving.batching import BatchEngine  # noqa: PLC0415

    return BatchEngine(record, options)


class Worker:
    def __init__(self, engine: BatchEngine | ScriptedEngine, heartbeat_s: float) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.cancels: dict[str, threading.Event] = {}
        self.events_out = 0  # progress counter: the supervisor detects a hung decode by it
        self._lock = threading.Lock()
        self._out = sys.stdout.buffer
        self._stop = threading.Event()
        # Events of the current step, encoded; only the batching thread adds and flushes.
        self._held: list[bytes] = []
        engine.flush_events = self.flush

    def send(self, message: dict[str, Any]) -> None:
        self._write(ipc.encode(message))

    def flush(self) -> None:
        """Write the events the batching thread held back this turn."""
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._write(data)

    def _hold(self, message: dict[str, Any]) -> None:
        self._held.append(ipc.encode(message))

    def _write(self, data: bytes) -> None:
        with self._lock:
            try:
                self._out.write(data)
                self._out.flush()
            except BrokenPipeError:
                # The appliance is gone (killed, or it closed the pipe): nobody is left to
                # serve. Exit at once, from whichever thread noticed; the OS frees the model.
                log.info("the appliance closed the pipe; the worker exits")
                os._exit(0)

    def heartbeat_forever(self) -> None:
        # Its own thread: it keeps beating while a decode runs, and falls silent only when
        # the whole process is stuck, which is what the supervisor watches for. Between
        # beats, the decode calls made (twice a second, while there are any): the door
        # predicts with the model's speed now, not as of the last beat.
        engine = self.engine
        beat = time.monotonic()
        while not self._stop.wait(min(self.heartbeat_s, STEPS_S)):
            steps: list[tuple[int, float]] = []
            with contextlib.suppress(IndexError):
                while True:
                    steps.append(engine.steps.popleft())
            if steps:
                self.send({"type": "steps", "steps": steps})
            if time.monotonic() - beat < self.heartbeat_s:
                continue
            beat = time.monotonic()
            self.send(
                {
                    "type": "heartbeat",
                    "running": engine.running,
                    "busy_slots": engine.busy_slots,
                    "events_out": self.events_out,
                    # Counters since the worker started: the supervisor turns them into
                    # metrics.
                    "tokens_generated": engine.tokens_generated,
                    "prefix_tokens_reused": engine.prefix_tokens_reused,
                    "preemptions": engine.preemptions,
                    "pid": os.getpid(),
                    "at": time.time(),
                }
            )

    def _emit(self, request_id: str, event: Event | Failed | SlotChange) -> None:
        """The engine's events (on the batching thread), held until the turn ends."""
        self.events_out += 1
        if isinstance(event, SlotChange):
            self._hold({"type": "slot", "id": request_id, "holds": event.holds})
            return
        if isinstance(event, Failed):
            self.cancels.pop(request_id, None)
            kind = "grammar" if isinstance(event.error, GrammarError) else "internal"
            if kind == "internal":
                log.error("generation %s failed: %s", request_id, event.error)
            self._hold(
                {"type": "error", "id": request_id, "kind": kind, "message": str(event.error)}
            )
            return
        if isinstance(event, Finished):
            self.cancels.pop(request_id, None)
        self._hold(ipc.event_message(request_id, event))

    def read_commands(self) -> None:
        for line in sys.stdin.buffer:
            message = ipc.decode(line)
            kind = message["type"]
            if kind == "generate":
                cancel = threading.Event()
                self.cancels[message["id"]] = cancel
                self.engine.jobs.put(
                    Job(
                        ipc.request_from(message),
                        functools.partial(self._emit, message["id"]),
                        cancel,
                    )
                )
            elif kind == "cancel":
                if (event := self.cancels.get(message["id"])) is not None:
                    event.set()
            elif kind == "shutdown":
                break
        self.engine.jobs.put(None)
        self._stop.set()


def main() -> None:
    logging.basicConfig(
        level=os.environ.get("KVL_WORKER_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s worker[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    spec = json.loads(sys.argv[1])
    options = EngineOptions(**spec["options"])
    # The gateway answers the LAN (a refusal in milliseconds, each token as it comes) with
    # little CPU; the model takes every core it is given. Below the gateway's priority
    # (`model.worker_nice`), the model yields the moment the gateway has work, instead of
    # the gateway waiting for a time slice behind both decode threads.
    with contextlib.suppress(OSError):  # a process may always lower its priority
        os.nice(options.worker_nice)
    record = ModelRecord(**spec["record"])
    engine = engine_for(record, options)
    engine.load()
    worker = Worker(engine, float(spec.get("heartbeat_s", 1.0)))
    worker.send(
        {
            "type": "ready",
            "pid": os.getpid(),
            "model": record.ref,
            "placement": engine.layout().to_json(),
        }
    )
    threading.Thread(target=worker.heartbeat_forever, name="kvl-heartbeat", daemon=True).start()
    batching = threading.Thread(target=engine.serve_forever, name="kvl-batching")
    batching.start()
    with contextlib.suppress(KeyboardInterrupt):
        worker.read_commands()
    batching.join()
    engine.close()


if __name__ == "__main__":
    main()
