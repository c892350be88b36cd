"""The hub's pull loop: the model pulls operators asked for (hub/state/pulls.py), one at a
time, each run as `kvl hub models pull` runs one (hub/models/pull.py), its progress written
once a second (where the API, the CLI and the console read it), and the model registered
only once its file is whole, checked and in place. A pull cancelled is stopped at its next
progress; one the hub was running when it stopped is queued again and goes on from its part
file."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from hub.models.errors import PullError
from hub.models.pull import Naming, pull
from hub.state.errors import ConflictError
from shared.supervise import wait_until_set

if TYPE_CHECKING:
    from hub.settings import HubSettings
    from hub.state.deployments import ModelArtifact
    from hub.state.pulls import Pull
    from hub.state.store import AsyncHubStore, HubStore
    from shared.supervise import Failures

log = logging.getLogger(__name__)

IDLE_S = 5.0  # how often an idle loop looks for pulls another hub replica queued
REPORT_S = 1.0


class PullRunner:
    def __init__(self, store: AsyncHubStore, settings: HubSettings, loops: Failures) -> None:
        self._store = store
        self._settings = settings
        self._loops = loops
        self.wake = asyncio.Event()  # a pull was queued

    async def forever(self) -> None:
        requeued = await self._store.run(self._store.sync.pulls.requeue_running)
        if requeued:
            log.info("%d model pull(s) the hub was running when it stopped: queued again", requeued)
        while True:
            with self._loops.guard("pulls"):
                while (job := await self._store.run(self._store.sync.pulls.claim)) is not None:
                    await self.run(job)
            self.wake.clear()
            await wait_until_set(self.wake, IDLE_S)

    async def run(self, job: Pull) -> None:
        latest: list[int | None] = [0, None]

        def progress(done: int, total: int | None) -> None:
            latest[:] = [done, total]

        naming = Naming(job.name, job.version, job.memory_mib)
        task = asyncio.create_task(pull(job.reference, self._settings, naming, progress=progress))
        pulls = self._store.sync.pulls
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=REPORT_S)
                state = await self._store.run(pulls.progress, job.id, latest[0] or 0, latest[1])
                if state == "cancelled" and not task.done():
                    task.cancel()
            model = await task
        except asyncio.CancelledError:
            if not task.cancelled():  # the hub is stopping: the pull is queued at its next start
                task.cancel()
                raise
            log.info("model pull %s (%s) cancelled", job.id, job.reference)
            return
        except PullError as err:
            log.warning("model pull %s (%s) failed: %s", job.id, job.reference, err)
            await self._store.run(pulls.fail, job.id, err.kind, str(err))
            return
        try:
            await self._store.run(_register, self._store.sync, job.id, model)
        except ConflictError as err:
            await self._store.run(pulls.fail, job.id, "conflict", str(err))
            return
        log.info("model pull %s: %s registered from %s", job.id, model.ref, model.source)


def _register(store: HubStore, pull_id: str, model: ModelArtifact) -> None:
    """The model registered (unless the same file is there under its name already) and the
    pull done, in one transaction; ConflictError when its name holds another file."""
    with store.db.transaction():
        known = next((m for m in store.deployments.models() if m.ref == model.ref), None)
        if known is None:
            store.deployments.add_model(model)
        elif known.sha256 != model.sha256:
            raise ConflictError(f"model {model.ref} is registered already, with another file")
        store.pulls.finish(pull_id, model.ref)
