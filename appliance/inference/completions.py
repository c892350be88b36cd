"""The completion service: an API request → a generation, its events, its usage record.

`CompletionService.complete` is the one drive of a completion (admit → generate →
validate → record), and `run` puts `prepare` in front of it: the HTTP and SSE handlers,
the WebSocket handler, the job runner and the package generator all run their completions
through it, each passing what it does with the events as a :class:`Sink`.

No aiohttp here. Domain failures from the engine, the model host and the chat template
become ApiErrors at this boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from appliance.inference.schemas import ChatCompletionRequest, CompletionRequest
from appliance.serving.chat import ChatTemplateError
from appliance.serving.engine import (
    EngineError,
    Event,
    Finished,
    GenerationRequest,
    NotLoadedError,
    QueueFullError,
    Run,
    TextDelta,
)
from appliance.serving.registry import (
    InsufficientMemoryError,
    LoadedModel,
    ModelNotReadyError,
    ModelRegistry,
    UnknownModelError,
)
from appliance.serving.sampling import GrammarError, Sampling
from appliance.serving.supervisor import WorkerUnavailableError
from appliance.state.store import ApiKey, AsyncStore, UsageEvent
from appliance.validation.structured import (
    SchemaUnusableError,
    StructuredOutput,
    json_object_output,
    json_schema_output,
)
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from appliance.inference.admission import AdmissionControl
    from appliance.observability.metrics import Metrics
    from appliance.observability.tracing import Tracing
    from shared.classes import ServiceClass

    # Commits a finished completion's usage: (prepared, finished, status).
    Recorder = Callable[["Prepared", Finished, int], Awaitable[None]]

Kind = Literal["chat", "text"]


@dataclass
class Prepared:
    """A request ready to generate."""

    kind: Kind
    route: str
    key: ApiKey
    engine: LoadedModel
    request: GenerationRequest
    structured: StructuredOutput | None
    include_usage: bool
    # The class the request runs in: the account's, unless its caller says otherwise (a
    # job's completions run as S0).
    service_class: ServiceClass | None = None
    submitted_at: float | None = None  # wall clock, when it went to the worker
    lease_id: str | None = None  # the quota lease it is charged to (a budgeted account)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model(self) -> str:
        return self.engine.record.ref

    @property
    def klass(self) -> ServiceClass:
        return self.service_class or self.key.account.service_class


@dataclass(frozen=True)
class Completed:
    """A completion that ran to its end, its usage recorded."""

    prepared: Prepared
    finished: Finished
    # Why the output fails its `response_format` (empty when it holds, or when cancelled).
    problems: list[str]
    status: int  # the status its usage event was recorded with

    @property
    def cancelled(self) -> bool:
        """Its generation was cancelled (by its caller) before it ended."""
        return self.finished.finish_reason == "cancelled"


class Sink:
    """What a caller does with a completion's events while `CompletionService.complete`
    drives it. Every hook does nothing here; a caller overrides those it needs."""

    # Its text is traced as the `stream` span (the SSE stream's).
    stream_span = False
    # Its client can go away mid-stream (its connection reset, its handler cancelled):
    # the sequence is stopped, and the tokens it spent are still recorded (as
    # CLIENT_CLOSED) before the exception goes on.
    record_when_gone = False

    async def started(self, generation: Generation) -> None:
        """The generation is submitted (admitted, its lease taken); no event yet."""

    async def first(self, event: Event) -> None:
        """Its first event came: a refusal before this one is still an ApiError raised
        from `complete`, to answer with a status code of its own."""

    async def streaming(self) -> None:
        """Before its first text is passed on (inside the `stream` span)."""

    async def text(self, text: str) -> None:
        """A piece of generated text, in order."""


class CompletionService:
    def __init__(
        self,
        host: ModelRegistry,
        store: AsyncStore,
        metrics: Metrics,
        max_tokens_limit: int,
        *,
        admission: AdmissionControl,
        tracing: Tracing,
    ) -> None:
        self._host = host
        self._store = store
        self._metrics = metrics
        self._max_tokens_limit = max_tokens_limit
        self._admission = admission
        self._tracing = tracing

    async def prepare(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        key: ApiKey,
        route: str,
        *,
        max_tokens_limit: int | None = None,
        service_class: ServiceClass | None = None,
        request_id: str | None = None,
    ) -> Prepared:
        """A chat or text request ready to generate. `service_class`: the class it runs in
        in place of its account's (a job's completions run as S0); `request_id`: the id of
        its usage event in place of a fresh one (a job item's own, the same on every run
        of it)."""
        if isinstance(req, ChatCompletionRequest):
            prepared = await self._prepare_chat(req, key, route, max_tokens_limit=max_tokens_limit)
        else:
            prepared = await self._prepare_text(req, key, route, max_tokens_limit=max_tokens_limit)
        if service_class is not None:
            prepared = replace(prepared, service_class=service_class)
        if request_id is not None:
            prepared = replace(prepared, id=request_id)
        return prepared

    async def _prepare_chat(
        self,
        req: ChatCompletionRequest,
        key: ApiKey,
        route: str,
        *,
        max_tokens_limit: int | None = None,
    ) -> Prepared:
        """`max_tokens_limit`: an internal caller's own bound (a package's items are bounded
        by `packages.item_max_tokens`), in place of `model.max_tokens_limit`."""
        await self._quota(key)
        engine = await self._engine(req.model)
        template = engine.require_vocab().chat_template
        messages = [{"role": _role(m.role), "content": m.text()} for m in req.messages]
        try:
            prompt = template.render(messages)
        except ChatTemplateError as err:
            raise ApiError(ErrorCode.invalid_parameter, str(err), param="messages") from err
        structured = _structured(req)
        tokens = await asyncio.to_thread(engine.require_vocab().tokenize, prompt, chat=True)
        max_tokens = req.max_completion_tokens or req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        request = self._generation(
            engine,
            tokens=tokens,
            max_tokens=max_tokens,
            param=param,
            req=req,
            structured=structured,
            limit=max_tokens_limit,
        )
        return self._prepared(
            "chat",
            route=route,
            key=key,
            engine=engine,
            request=request,
            req=req,
            structured=structured,
        )

    async def _prepare_text(
        self,
        req: CompletionRequest,
        key: ApiKey,
        route: str,
        *,
        max_tokens_limit: int | None = None,
    ) -> Prepared:
        await self._quota(key)
        engine = await self._engine(req.model)
        if isinstance(req.prompt, list):
            if len(req.prompt) != 1:
                raise ApiError(
                    ErrorCode.unsupported_parameter,
                    "`prompt` must be a string or a list of exactly one string",
                    param="prompt",
                )
            prompt = req.prompt[0]
        else:
            prompt = req.prompt
        tokens = await asyncio.to_thread(engine.require_vocab().tokenize, prompt, chat=False)
        if not tokens:
            raise ApiError(ErrorCode.invalid_parameter, "`prompt` is empty", param="prompt")
        request = self._generation(
            engine,
            tokens=tokens,
            max_tokens=req.max_tokens,
            param="max_tokens",
            req=req,
            structured=None,
            limit=max_tokens_limit,
        )
        return self._prepared(
            "text", route=route, key=key, engine=engine, request=request, req=req, structured=None
        )

    @staticmethod
    def _prepared(
        kind: Kind,
        *,
        route: str,
        key: ApiKey,
        engine: LoadedModel,
        request: GenerationRequest,
        req: ChatCompletionRequest | CompletionRequest,
        structured: StructuredOutput | None,
    ) -> Prepared:
        return Prepared(
            kind=kind,
            route=route,
            key=key,
            engine=engine,
            request=request,
            structured=structured,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )

    async def _quota(self, key: ApiKey) -> None:
        klass = key.account.service_class
        with self._tracing.span("quota", {"kvl.class": klass.value}):
            await self._admission.check_quota(key, klass)

    async def _engine(self, model: str) -> LoadedModel:
        try:
            with self._tracing.span("router", {"kvl.model": model}):
                return await self._host.resolve(model)
        except UnknownModelError as err:
            raise ApiError(ErrorCode.model_not_found, str(err), param="model") from err
        except ModelNotReadyError as err:
            if err.failed:
                raise ApiError(ErrorCode.model_unavailable, str(err), retry_after=30) from err
            raise ApiError(ErrorCode.model_not_ready, str(err), retry_after=5) from err
        except InsufficientMemoryError as err:
            raise ApiError(ErrorCode.insufficient_memory, str(err), retry_after=30) from err

    def _generation(
        self,
        engine: LoadedModel,
        *,
        tokens: list[int],
        max_tokens: int | None,
        param: str,
        req: ChatCompletionRequest | CompletionRequest,
        structured: StructuredOutput | None,
        limit: int | None = None,
    ) -> GenerationRequest:
        room = engine.n_ctx - len(tokens)
        limit = self._max_tokens_limit if limit is None else limit
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(
                ErrorCode.invalid_parameter,
                f"`{param}` is {max_tokens}; this appliance allows at most {limit}",
                param=param,
            )
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise ApiError(
                ErrorCode.context_length_exceeded,
                f"the prompt has {len(tokens)} tokens and {param} asks for {max_tokens or 1}; "
                f"the context holds {engine.n_ctx}",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        return GenerationRequest(
            prompt_tokens=tuple(tokens),
            max_tokens=min(max_tokens or room, room, limit),
            sampling=Sampling(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
            ),
            stop=req.stop_list(),
            grammar=structured.grammar if structured is not None else None,
        )

    def _start(self, prepared: Prepared) -> Generation:
        """Admit and submit the generation; iterate the result for its events."""
        klass = prepared.klass
        request = replace(prepared.request, priority=klass.priority)
        with self._tracing.span("admission", {"kvl.class": klass.value}):
            self._admission.admit(
                prepared.engine, klass, len(request.prompt_tokens), request.max_tokens
            )
        cost = len(request.prompt_tokens) + request.max_tokens
        prepared.lease_id = self._admission.take_lease(prepared.key, klass, prepared.id, cost)
        prepared.submitted_at = time.time()
        try:
            run = prepared.engine.submit(request)
        except (QueueFullError, NotLoadedError, WorkerUnavailableError) as err:
            self._admission.settle_lease(prepared.lease_id, prepared.id, 0)
            if isinstance(err, QueueFullError):
                raise ApiError(ErrorCode.queue_full, str(err), retry_after=err.retry_after) from err
            if isinstance(err, NotLoadedError):
                raise ApiError(ErrorCode.model_not_ready, str(err), retry_after=5) from err
            raise ApiError(
                ErrorCode.model_unavailable, str(err), retry_after=err.retry_after
            ) from err
        self._metrics.queue_waiting.labels(prepared.model).set(prepared.engine.waiting)
        objective = self._admission.objectives(klass).first_token_s
        return Generation(
            run,
            objective,
            lambda waited: self._admission.shed(klass, waited),
            # A generation closed without a usage record (it failed) frees its reservation.
            on_close=lambda: self._admission.settle_lease(prepared.lease_id, prepared.id, 0),
        )

    async def run(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        key: ApiKey,
        route: str,
        sink: Sink | None = None,
        *,
        max_tokens_limit: int | None = None,
        service_class: ServiceClass | None = None,
        request_id: str | None = None,
        record: Recorder | None = None,
    ) -> Completed:
        """A completion end to end: `prepare`, then `complete`."""
        prepared = await self.prepare(
            req,
            key,
            route,
            max_tokens_limit=max_tokens_limit,
            service_class=service_class,
            request_id=request_id,
        )
        return await self.complete(prepared, sink, record=record)

    async def complete(
        self, prepared: Prepared, sink: Sink | None = None, *, record: Recorder | None = None
    ) -> Completed:
        """The one drive of a prepared completion: admit and submit it, pass its events to
        `sink`, validate its output, record its usage (`record`, or the caller's own
        recorder). Refusals and failures are ApiErrors; a generation its caller cancelled
        is recorded as CLIENT_CLOSED, without validation."""
        sink = sink if sink is not None else Sink()
        record = record if record is not None else self.record
        async with contextlib.aclosing(self._start(prepared)) as generation:
            await sink.started(generation)
            # The first event before anything is answered, so a grammar the engine refuses
            # (or a shed) is still a proper status code rather than an error in a stream.
            event = await anext(generation)
            await sink.first(event)
            try:
                with contextlib.ExitStack() as stack:
                    if sink.stream_span:
                        stack.enter_context(
                            self._tracing.span("stream", {"kvl.model": prepared.model})
                        )
                    await sink.streaming()
                    while isinstance(event, TextDelta):
                        await sink.text(event.text)
                        event = await anext(generation)
            except (ConnectionResetError, asyncio.CancelledError):
                if sink.record_when_gone:
                    # The client went away: stop the sequence, still count what it spent.
                    generation.cancel()
                    finished = await asyncio.shield(drain(generation))
                    await asyncio.shield(record(prepared, finished, CLIENT_CLOSED))
                raise
            finished = event
            problems: list[str] = []
            if finished.finish_reason == "cancelled":
                status = CLIENT_CLOSED
            else:
                problems = self._problems(prepared, finished)
                status = ErrorCode.output_validation_failed.status if problems else 200
            await record(prepared, finished, status)
        return Completed(prepared, finished, problems, status)

    def _trace_generation(self, prepared: Prepared, finished: Finished) -> None:
        """The worker's side as spans, from its own timings: waiting for a batch slot, then
        prefill and decode in the slot."""
        start = prepared.submitted_at
        if start is None or not self._tracing.enabled:
            return
        admitted = start + (finished.queue_s or 0.0)
        self._tracing.record("batcher", start, admitted, {"kvl.model": prepared.model})
        self._tracing.record(
            "worker",
            admitted,
            start + finished.duration_s,
            {
                "kvl.model": prepared.model,
                "kvl.prompt_tokens": finished.prompt_tokens,
                "kvl.completion_tokens": finished.completion_tokens,
                "kvl.ttft_s": finished.ttft_s,
                "kvl.finish_reason": finished.finish_reason,
            },
        )

    def _problems(self, prepared: Prepared, finished: Finished) -> list[str]:
        with self._tracing.span("validation", {"kvl.structured": prepared.structured is not None}):
            return self._output_problems(prepared, finished)

    def _output_problems(self, prepared: Prepared, finished: Finished) -> list[str]:
        """Why the output fails its structured-output contract (empty when it holds)."""
        if prepared.structured is None or finished.finish_reason == "cancelled":
            return []
        found = prepared.structured.problems(finished.text)
        if finished.finish_reason == "length":
            found.insert(0, f"generation stopped at max_tokens={prepared.request.max_tokens}")
        return found

    async def record(self, prepared: Prepared, finished: Finished, status: int) -> None:
        """Count the tokens and commit the usage event (before the response completes)."""
        self._trace_generation(prepared, finished)
        m = self._metrics
        model = prepared.model
        m.prompt_tokens.labels(model).inc(finished.prompt_tokens)
        m.completion_tokens.labels(model).inc(finished.completion_tokens)
        if finished.ttft_s is not None:
            m.ttft_seconds.labels(model).observe(finished.ttft_s)
            if finished.completion_tokens > 1:
                tpot = (finished.duration_s - finished.ttft_s) / (finished.completion_tokens - 1)
                m.time_per_output_token.labels(model).observe(tpot)
        if finished.queue_s is not None:
            m.queue_seconds.labels(model).observe(finished.queue_s)
        m.generation_seconds.labels(model).observe(finished.duration_s)
        self._admission.finished(model, prepared.klass, finished)
        tokens = finished.prompt_tokens + finished.completion_tokens
        self._admission.charge(prepared.key, prepared.klass, tokens)
        self._admission.settle_lease(prepared.lease_id, prepared.id, tokens)
        event = UsageEvent(
            account_id=prepared.key.account.id,
            key_prefix=prepared.key.prefix,
            route=prepared.route,
            model=model,
            tokens_in=finished.prompt_tokens,
            tokens_out=finished.completion_tokens,
            ttft_ms=None if finished.ttft_s is None else finished.ttft_s * 1000,
            duration_ms=finished.duration_s * 1000,
            status=status,
            finish_reason=finished.finish_reason,
            id=prepared.id,
            lease_id=prepared.lease_id,
        )
        await self._store.run(self._store.sync.record_usage, event)


class Generation:
    """A running generation's events, with engine failures as ApiErrors."""

    def __init__(
        self,
        run: Run,
        first_token_s: float | None = None,
        shed: Callable[[float], ApiError] | None = None,
        *,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._run = run
        self._on_close = on_close
        # A request still waiting for its first token at this deadline is dropped from the
        # queue (its class's SLO.B) rather than served late.
        self._started = time.monotonic()
        self._first_token_s = first_token_s
        self._shed = shed
        self._first = True

    def cancel(self) -> None:
        self._run.cancel()

    async def aclose(self) -> None:
        try:
            await self._run.aclose()
        finally:
            if self._on_close is not None:
                self._on_close()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Event:
        try:
            if self._first and self._first_token_s is not None:
                self._first = False
                left = self._first_token_s - (time.monotonic() - self._started)
                try:
                    return await asyncio.wait_for(anext(self._run), max(0.0, left))
                except TimeoutError:
                    self._run.cancel()
                    waited = time.monotonic() - self._started
                    if self._shed is None:  # pragma: no cover - set with the deadline
                        raise
                    raise self._shed(waited) from None
            return await anext(self._run)
        except GrammarError as err:
            raise ApiError(ErrorCode.invalid_schema, str(err), param="response_format") from err
        except WorkerUnavailableError as err:
            raise ApiError(
                ErrorCode.model_unavailable, str(err), retry_after=err.retry_after
            ) from err
        except EngineError as err:
            raise ApiError(ErrorCode.internal_error, f"generation failed: {err}") from err


def _role(role: str) -> str:
    # OpenAI's newer `developer` role is the system prompt for models that predate it.
    return "system" if role == "developer" else role


def _structured(req: ChatCompletionRequest) -> StructuredOutput | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return json_object_output()
    try:
        return json_schema_output(rf.json_schema.schema_, rf.json_schema.name)
    except SchemaUnusableError as err:
        raise ApiError(
            ErrorCode.invalid_schema, str(err), param="response_format.json_schema.schema"
        ) from err


# The status recorded for a request whose client went away before it ended (nginx's).
CLIENT_CLOSED = 499


async def drain(generation: Generation) -> Finished:
    """The Finished event of a generation, skipping its text deltas."""
    async for event in generation:
        if isinstance(event, Finished):
            return event
    raise AssertionError("a generation always ends with Finished")  # pragma: no cover


def invalid_output(problems: list[str]) -> ApiError:
    """The error of an output that fails its `response_format` (it fails closed)."""
    return ApiError(
        ErrorCode.output_validation_failed,
        "the output does not satisfy response_format: " + "; ".join(problems),
        param="response_format",
    )
