"""The jobs service behind `/v1/jobs`: create, look up, list results, cancel.

Every lookup is scoped to the caller's account: another account's job is not found (404),
never forbidden, so job ids reveal nothing. The listing too, but for an admin key, which
lists every account's jobs. State-layer failures become domain errors here,
as the completion service does for the engine's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.jobs.delivery import WebhookSender
from appliance.jobs.destinations import ALLOW_SETTING, WebhookDestinations
from appliance.jobs.runner import JobRunner
from appliance.serving.registry import split_ref
from appliance.state.jobs import JobFinishedError, JobNotFoundError, JobStore
from appliance.state.store import NotFoundError
from shared.errors import InvalidRequest, JobFinished, JobNotFound, ModelNotFound

if TYPE_CHECKING:
    from collections.abc import Callable

    from appliance.inference.completions import CompletionService
    from appliance.observability.metrics import Metrics
    from appliance.settings import JobSettings
    from appliance.state.jobs import ItemResult, Job, NewItem
    from appliance.state.store import ApiKey, AsyncStore


class JobService:
    def __init__(
        self,
        store: AsyncStore,
        completions: CompletionService,
        settings: JobSettings,
        metrics: Metrics,
        *,
        overlay_prefix: Callable[[], str | None] = lambda: None,
    ) -> None:
        """`overlay_prefix`: the node's overlay network once it enrolled (webhooks never
        go there)."""
        self._store = store
        self._jobs = JobStore(store.sync.db)
        self._metrics = metrics
        self._destinations = WebhookDestinations(
            settings.webhook_allow,
            overlay_prefix=overlay_prefix,
            resolve_timeout_s=settings.webhook_timeout_s,
        )
        self.sender = WebhookSender(store, self._jobs, settings, metrics, self._destinations)
        self.runner = JobRunner(
            store, self._jobs, completions, settings=settings, metrics=metrics, on_end=self._ended
        )

    def start(self) -> None:
        """Resume: pending items and deliveries left by the last run go first."""
        self.sender.start()
        self.runner.start()

    async def close(self) -> None:
        await self.runner.close()
        await self.sender.close()

    async def create(
        self,
        key: ApiKey,
        items: list[NewItem],
        *,
        models: dict[str, str],
        metadata: dict[str, str],
        webhook_url: str | None,
    ) -> Job:
        """Queue a job of validated items; `models` maps each model named to the `param` of
        its first use, so an unknown one is refused before anything is queued."""
        if webhook_url is not None:
            await self._check_destination(webhook_url)
        for model, param in models.items():
            name, version = split_ref(model)
            if await self._store.run(self._store.sync.get_model, name, version) is None:
                raise ModelNotFound(f"no model {model!r} is registered", param=param)
        job = await self._store.run(
            self._jobs.create,
            account_id=key.account.id,
            key_prefix=key.prefix,
            items=items,
            metadata=metadata,
            webhook_url=webhook_url,
        )
        self._metrics.jobs.labels("queued").inc()
        self.runner.wake()
        return job

    async def get(self, key: ApiKey, job_id: str) -> Job:
        try:
            return await self._store.run(self._jobs.get, job_id, key.account.id)
        except JobNotFoundError as err:
            raise JobNotFound(str(err)) from err

    async def list_jobs(
        self, key: ApiKey, *, after: str | None, limit: int
    ) -> tuple[list[Job], bool]:
        """The caller's account's jobs, newest first (an admin key: every account's)."""
        account_id = None if key.admin else key.account.id
        try:
            return await self._store.run(self._jobs.list_jobs, account_id, after=after, limit=limit)
        except JobNotFoundError as err:
            raise InvalidRequest(str(err), param="after") from err

    async def results(
        self, key: ApiKey, job_id: str, *, after: str | None, limit: int
    ) -> tuple[list[ItemResult], bool]:
        try:
            return await self._store.run(
                self._jobs.results, job_id, key.account.id, after=after, limit=limit
            )
        except JobNotFoundError as err:
            raise JobNotFound(str(err)) from err
        except NotFoundError as err:
            raise InvalidRequest(str(err), param="after") from err

    async def cancel(self, key: ApiKey, job_id: str) -> Job:
        try:
            job = await self._store.run(self._jobs.cancel, job_id, key.account.id)
        except JobNotFoundError as err:
            raise JobNotFound(str(err)) from err
        except JobFinishedError as err:
            raise JobFinished(str(err)) from err
        self.runner.cancel(job_id)
        self._metrics.jobs.labels("cancelled").inc()
        self._ended(job)
        return job

    async def _check_destination(self, url: str) -> None:
        why = await self._destinations.check_url(url)
        if why is not None:
            raise InvalidRequest(
                f"webhooks may not go to this URL: its host is, or resolves to, an address "
                f"that is {why}; they go to public addresses, and to those the operator "
                f"names in `{ALLOW_SETTING}`",
                param="webhook_url",
            )

    def _ended(self, job: Job) -> None:
        if job.delivery is not None:
            self.sender.wake()
