"""A model worker: one model replica in its own process (isolation level I1).

Started by the supervisor as ``python -m appliance.serving.worker SPEC`` (SPEC: the model
record and engine options as JSON). Reads commands from stdin and writes events to stdout,
one JSON object per line (appliance.serving.ipc); logs go to stderr. A crash here costs
only this worker's in-flight requests; the supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from appliance.serving import ipc
from appliance.serving.engine import EngineOptions, LlamaEngine, QueueFullError, Run
from appliance.serving.sampling import GrammarError
from appliance.state.store import ModelRecord

log = logging.getLogger("kvl.worker")


class _Output:
    """Writes messages to stdout; one lock, because the heartbeat thread writes too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stream = sys.stdout.buffer

    def send(self, message: dict[str, Any]) -> None:
        data = ipc.encode(message)
        with self._lock:
            self._stream.write(data)
            self._stream.flush()


class Worker:
    def __init__(self, engine: LlamaEngine, out: _Output, heartbeat_s: float) -> None:
        self.engine = engine
        self.out = out
        self.heartbeat_s = heartbeat_s
        self.runs: dict[str, Run] = {}
        self.events_out = 0  # progress counter: the supervisor detects a hung decode by it
        self._stop = threading.Event()

    def heartbeat_forever(self) -> None:
        # A thread, not a task: it must keep beating while the event loop is busy, and stop
        # when the process hangs as a whole.
        while not self._stop.wait(self.heartbeat_s):
            self.out.send(
                {
                    "type": "heartbeat",
                    "running": len(self.runs),
                    "events_out": self.events_out,
                    "pid": os.getpid(),
                    "at": time.time(),
                }
            )

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            message = ipc.decode(line)
            kind = message["type"]
            if kind == "generate":
                task = asyncio.create_task(self._generate(message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif kind == "cancel":
                run = self.runs.get(message["id"])
                if run is not None:
                    run.cancel()
            elif kind == "shutdown":
                break
        for run in self.runs.values():
            run.cancel()
        self._stop.set()

    async def _generate(self, message: dict[str, Any]) -> None:
        request_id = message["id"]
        try:
            run = self.engine.submit(ipc.request_from(message))
        except QueueFullError as err:
            self.out.send(
                {"type": "error", "id": request_id, "kind": "queue_full", "message": str(err)}
            )
            return
        self.runs[request_id] = run
        try:
            async for event in run:
                self.events_out += 1
                self.out.send(ipc.event_message(request_id, event))
        except GrammarError as err:
            self.out.send(
                {"type": "error", "id": request_id, "kind": "grammar", "message": str(err)}
            )
        except Exception as err:
            log.exception("generation %s failed", request_id)
            self.out.send(
                {"type": "error", "id": request_id, "kind": "internal", "message": str(err)}
            )
        finally:
            del self.runs[request_id]


async def _main(spec: dict[str, Any]) -> None:
    record = ModelRecord(**spec["record"])
    engine = LlamaEngine(record, EngineOptions(**spec["options"]))
    out = _Output()
    await asyncio.to_thread(engine.load)
    out.send({"type": "ready", "pid": os.getpid(), "model": record.ref})
    worker = Worker(engine, out, float(spec.get("heartbeat_s", 1.0)))
    threading.Thread(target=worker.heartbeat_forever, name="kvl-heartbeat", daemon=True).start()
    try:
        await worker.serve()
    finally:
        await engine.close()


def main() -> None:
    logging.basicConfig(
        level=os.environ.get("KVL_WORKER_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s worker[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    spec = json.loads(sys.argv[1])
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(spec))


if __name__ == "__main__":
    main()
