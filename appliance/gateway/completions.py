"""The completion service: an API request → a generation, its events, its usage record.

No aiohttp here; the handlers and the SSE writer call this. Domain failures from the engine,
the model host and the chat template become ApiErrors at this boundary.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from appliance.gateway.schemas import ChatCompletionRequest, CompletionRequest
from appliance.serving.chat import ChatTemplateError
from appliance.serving.engine import (
    EngineError,
    Event,
    Finished,
    GenerationRequest,
    NotLoadedError,
    QueueFullError,
    Run,
)
from appliance.serving.registry import (
    Deployment,
    InsufficientMemoryError,
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
    from collections.abc import Callable

    from appliance.gateway.admission import AdmissionControl
    from appliance.observability.metrics import Metrics
    from appliance.observability.tracing import Tracing
    from shared.classes import ServiceClass

Kind = Literal["chat", "text"]


@dataclass
class Prepared:
    """A request ready to generate."""

    kind: Kind
    route: str
    key: ApiKey
    engine: Deployment
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

    async def prepare_chat(
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

    async def prepare_text(self, req: CompletionRequest, key: ApiKey, route: str) -> Prepared:
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
        engine: Deployment,
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

    async def _engine(self, model: str) -> Deployment:
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
        engine: Deployment,
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

    def start(self, prepared: Prepared) -> Generation:
        """Submit the generation; iterate the result for its events."""
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

    def problems(self, prepared: Prepared, finished: Finished) -> list[str]:
        with self._tracing.span("validation", {"kvl.structured": prepared.structured is not None}):
            return self._problems(prepared, finished)

    def _problems(self, prepared: Prepared, finished: Finished) -> list[str]:
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


# -- OpenAI response shapes ---------------------------------------------------------------


def usage(finished: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


def finish_reason(finished: Finished) -> str:
    return "length" if finished.finish_reason == "length" else "stop"


def response_body(prepared: Prepared, finished: Finished) -> dict[str, Any]:
    if prepared.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": finished.text},
            "finish_reason": finish_reason(finished),
            "logprobs": None,
        }
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {
            "index": 0,
            "text": finished.text,
            "finish_reason": finish_reason(finished),
            "logprobs": None,
        }
        obj, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + prepared.id,
        "object": obj,
        "created": prepared.created,
        "model": prepared.model,
        "choices": [choice],
        "usage": usage(finished),
    }


def chunk_body(
    prepared: Prepared,
    *,
    text: str | None = None,
    role: bool = False,
    finished: Finished | None = None,
    usage_only: bool = False,
) -> dict[str, Any]:
    """One streamed chunk in OpenAI's format.

    The chunk carrying `finish_reason` also carries `usage` (as llama-server does), so every
    client sees the token counts; with `stream_options.include_usage` OpenAI's separate final
    chunk (empty `choices`) follows as well.
    """
    chat = prepared.kind == "chat"
    body: dict[str, Any] = {
        "id": ("chatcmpl-" if chat else "cmpl-") + prepared.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": prepared.created,
        "model": prepared.model,
    }
    if usage_only and finished is not None:
        body["choices"] = []
        body["usage"] = usage(finished)
        return body
    reason = finish_reason(finished) if finished is not None else None
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "finish_reason": reason,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    body["choices"] = [choice]
    if finished is not None:
        body["usage"] = usage(finished)
    return body


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
