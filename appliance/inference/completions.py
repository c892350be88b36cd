"""The completion service: an API request → a generation, its events, its usage record.

`CompletionService.complete` is the one drive of a completion (admit → generate →
validate → record), and `run` puts `prepare` in front of it: the HTTP and SSE handlers,
the WebSocket handler, the job runner and the package generator all run their completions
through it, each passing what it does with the events as a :class:`Sink`.

No aiohttp here. Domain failures from the engine, the model host and the chat template
become domain errors (shared.errors) here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel

from appliance.inference.choices import Choice, ChoiceDelta, ChoiceStream, ToolCalls
from appliance.inference.names import ModelNames
from appliance.inference.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
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
from appliance.serving.sampling_options import GrammarError, Sampling
from appliance.serving.supervisor import WorkerUnavailableError
from appliance.state.store import ApiKey, AsyncStore, UsageEvent
from appliance.validation.structured import (
    SchemaUnusableError,
    StructuredOutput,
    json_object_output,
    json_schema_output,
)
from appliance.validation.tools import ToolPlan, ToolSpecError, plan_tools
from shared.chat import ChatTemplate, ChatTemplateError
from shared.errors import (
    ContextTooLong,
    ErrorCode,
    InsufficientMemory,
    InternalError,
    InvalidRequest,
    InvalidSchema,
    ModelNotFound,
    ModelNotReady,
    ModelUnavailable,
    NodeFault,
    OutputInvalid,
    Overloaded,
    QueueFull,
    UnsupportedParameter,
)
from shared.protocol import ModelPreset

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from appliance.inference.admission import AdmissionControl
    from appliance.observability.metrics import Metrics
    from appliance.observability.objectives import Ticket
    from appliance.observability.tracing import Tracing
    from appliance.serving.engine import Vocabulary
    from shared.classes import ServiceClass

    # Commits a finished completion's usage: (prepared, finished, status).
    Recorder = Callable[["Prepared", Finished, int], Awaitable[None]]

_T = TypeVar("_T")

Kind = Literal["chat", "text"]
# OpenTelemetry's GenAI semantic conventions (gen_ai.*): the provider is this appliance,
# which serves the models itself (no well-known provider value applies).
GENAI_PROVIDER = "kovenlab-edge"
GENAI_OPERATION: dict[Kind, str] = {"chat": "chat", "text": "text_completion"}
# How often a queued request asks whether it will still hold a slot by its deadline (s).
RECHECK_S = 0.5


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
    n: int = 1  # choices: each its own sequence, sharing the prompt's cells
    ignored: tuple[str, ...] = ()  # body fields this API ignored
    tools: ToolPlan | None = None  # tools the output is constrained to call
    # Alternatives reported per token (OpenAI's top_logprobs); None: no logprobs.
    logprobs: int | None = None
    # Its way through admission, for the live objectives (ends once: `complete`).
    ticket: Ticket | None = None
    requested: str | None = None  # the model as the client named it (None: the default)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model(self) -> str:
        return self.engine.record.ref

    @property
    def klass(self) -> ServiceClass:
        return self.service_class or self.key.account.service_class

    @property
    def response_id(self) -> str:
        """The id its answer carries."""
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id


@dataclass(frozen=True)
class Completed:
    """A completion that ran to its end, its usage recorded."""

    prepared: Prepared
    # All its choices together: the prompt once, the tokens of every choice; the first
    # choice's text and reason (what a one-choice caller reads).
    finished: Finished
    # Why the output fails its contract, `response_format` or the tool calls the request
    # asked for (empty when it holds, or when cancelled).
    problems: list[str]
    status: int  # the status its usage event was recorded with
    choices: list[Choice] = field(default_factory=list)

    @property
    def contract(self) -> Literal["response_format", "tools"]:
        """What its output is held to: the tool calls, or the response format."""
        return "tools" if self.prepared.tools is not None else "response_format"

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
        """Its first event came: a refusal before this one is still a DomainError raised
        from `complete`, to answer with a status code of its own."""

    async def streaming(self) -> None:
        """Before its first text is passed on (inside the `stream` span)."""

    async def text(self, text: str) -> None:
        """A piece of the first choice's text, in order."""

    async def delta(self, index: int, delta: ChoiceDelta) -> None:
        """What an event adds to choice `index` (text, tool calls, logprobs); by default
        the first choice's text goes to `text`."""
        if index == 0 and delta.content:
            await self.text(delta.content)


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
        names: ModelNames | None = None,
    ) -> None:
        self._names = names if names is not None else ModelNames()
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
        refuse_early: bool = False,
    ) -> Prepared:
        """A chat or text request ready to generate. `service_class`: the class it runs in
        in place of its account's (a job's completions run as S0); `request_id`: the id of
        its usage event in place of a fresh one (a job item's own, the same on every run
        of it); `refuse_early`: a refusal for load whatever the prompt comes before the
        prompt is rendered and tokenized (a caller that would not hand the refused
        request on elsewhere, which needs it prepared)."""
        klass = service_class or key.account.service_class
        ticket = self._admission.book.ticket(klass.value, key.account.name)
        chat = isinstance(req, ChatCompletionRequest)
        await self._quota(key, ticket)
        engine = await self._engine(req.model, chat=chat)
        place: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if refuse_early:
            limit = self._max_tokens_limit if max_tokens_limit is None else max_tokens_limit
            rough = _rough_tokens(req), _max_tokens(req, limit) * req.n
            place = self._admission.refuse_early(engine, klass, *rough, ticket)
        with place:
            if refuse_early:
                # Past the door's early check, its place held: the requests reaching the
                # door meanwhile (a burst's refusals among them) are answered before this
                # one's prompt is rendered and tokenized, not after.
                await self._admission.after_the_door()
            if isinstance(req, ChatCompletionRequest):
                prepared = await self._prepare_chat(
                    req, key, route, engine, max_tokens_limit=max_tokens_limit
                )
            else:
                prepared = await self._prepare_text(
                    req, key, route, engine, max_tokens_limit=max_tokens_limit
                )
        prepared.ticket = ticket
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
        engine: LoadedModel,
        *,
        max_tokens_limit: int | None = None,
    ) -> Prepared:
        """`max_tokens_limit`: an internal caller's own bound (a package's items are bounded
        by `packages.item_max_tokens`), in place of `model.max_tokens_limit`."""
        vocab = engine.require_vocab()
        messages = [_message(m) for m in req.messages]
        preset = engine.preset
        roles = {m.get("role") for m in messages}
        if preset is not None and preset.system_prompt and not roles & {"system", "developer"}:
            messages.insert(0, {"role": "system", "content": preset.system_prompt})
        tools = _tools(req, vocab.chat_template, preset.tool_format if preset else "auto")
        try:
            if tools is not None:
                prompt = tools.render(vocab.chat_template, messages)
            else:
                prompt = vocab.chat_template.render(messages)
        except ChatTemplateError as err:
            raise InvalidRequest(str(err), param="messages") from err
        structured = _structured(req)
        if structured is not None and tools is not None and tools.grammar is not None:
            raise UnsupportedParameter(
                "`response_format` with `tools` is not supported: the output is either "
                "constrained to the tool calls or to the schema; send tool_choice: none, "
                "or leave out response_format",
                param="response_format",
            )
        tokens = await _tokenize(vocab, prompt, chat=True)
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
        prepared = self._prepared(
            "chat",
            route=route,
            key=key,
            engine=engine,
            request=request,
            req=req,
            structured=structured,
        )
        prepared.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prepared.tools = tools if tools is not None and tools.grammar is not None else None
        if prepared.tools is not None:
            prepared.request = replace(prepared.request, grammar=prepared.tools.grammar)
        return prepared

    async def _prepare_text(
        self,
        req: CompletionRequest,
        key: ApiKey,
        route: str,
        engine: LoadedModel,
        *,
        max_tokens_limit: int | None = None,
    ) -> Prepared:
        if isinstance(req.prompt, list):
            if len(req.prompt) != 1:
                raise UnsupportedParameter(
                    "`prompt` must be a string or a list of exactly one string",
                    param="prompt",
                )
            prompt = req.prompt[0]
        else:
            prompt = req.prompt
        tokens = await _tokenize(engine.require_vocab(), prompt, chat=False)
        if not tokens:
            raise InvalidRequest("`prompt` is empty", param="prompt")
        request = self._generation(
            engine,
            tokens=tokens,
            max_tokens=req.max_tokens,
            param="max_tokens",
            req=req,
            structured=None,
            limit=max_tokens_limit,
        )
        prepared = self._prepared(
            "text", route=route, key=key, engine=engine, request=request, req=req, structured=None
        )
        prepared.logprobs = req.logprobs
        return prepared

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
            n=req.n,
            ignored=req.ignored,
            requested=req.model,
        )

    async def _quota(self, key: ApiKey, ticket: Ticket) -> None:
        klass = key.account.service_class
        with self._tracing.span("quota", {"kvl.class": klass.value}):
            await self._admission.check_quota(key, klass, ticket)

    async def _engine(self, requested: str | None, *, chat: bool) -> LoadedModel:
        model = self._names.generation(requested, chat=chat)
        try:
            with self._tracing.span("router", {"kvl.model": model}):
                return await self._host.resolve(model)
        except UnknownModelError as err:
            raise ModelNotFound(str(err), param="model") from err
        except ModelNotReadyError as err:
            if err.failed:
                raise ModelUnavailable(str(err), retry_after=30) from err
            raise ModelNotReady(str(err), retry_after=5) from err
        except InsufficientMemoryError as err:
            raise InsufficientMemory(str(err), retry_after=30) from err

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
            raise InvalidRequest(
                f"`{param}` is {max_tokens}; this appliance allows at most {limit}",
                param=param,
            )
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise ContextTooLong(
                f"the prompt has {len(tokens)} tokens and {param} asks for {max_tokens or 1}; "
                f"the context holds {engine.n_ctx}",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        # The request's own sampling, else the deployment's preset's, else the API's.
        p = engine.preset or ModelPreset()
        return GenerationRequest(
            prompt_tokens=tuple(tokens),
            max_tokens=min(max_tokens or room, room, limit),
            sampling=Sampling(
                temperature=_first(req.temperature, p.temperature, 1.0),
                top_p=_first(req.top_p, p.top_p, 1.0),
                seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                top_k=_first(req.top_k, p.top_k, 0),
                min_p=_first(req.min_p, p.min_p, 0.0),
                repeat_penalty=_first(req.repeat_penalty, p.repeat_penalty, 1.0),
                repeat_last_n=64 if req.repeat_last_n is None else req.repeat_last_n,
                logit_bias=_logit_bias(req.logit_bias, engine.require_vocab().n_vocab),
            ),
            # The preset's stop strings end every request (a model's own turn markers).
            stop=tuple(dict.fromkeys((*req.stop_list(), *p.stop))),
            grammar=structured.grammar if structured is not None else None,
        )

    def _start(self, prepared: Prepared, ticket: Ticket) -> Generation:
        """Admit and submit the generation (a sequence per choice); iterate the result for
        its events."""
        klass = prepared.klass
        request = replace(
            prepared.request,
            priority=klass.priority,
            logprobs=prepared.logprobs,
            share_prompt=prepared.n > 1,
        )
        n = prepared.n
        with self._tracing.span("admission", {"kvl.class": klass.value}):
            targets = self._admission.admit(
                prepared.engine, klass, len(request.prompt_tokens), request.max_tokens * n, ticket
            )
        cost = len(request.prompt_tokens) + request.max_tokens * n
        prepared.lease_id = self._admission.take_lease(
            prepared.key, klass, prepared.id, cost, ticket
        )
        prepared.submitted_at = time.time()
        runs: list[Run] = []
        try:
            runs.extend(prepared.engine.submit(_choice_request(request, i)) for i in range(n))
        except (QueueFullError, NotLoadedError, WorkerUnavailableError) as err:
            for run in runs:
                run.cancel()
            self._admission.settle_lease(prepared.lease_id, prepared.id, 0)
            if isinstance(err, QueueFullError):
                ticket.refuse("admit")  # no room to wait: refused at the door
                raise QueueFull(str(err), retry_after=err.retry_after) from err
            if isinstance(err, NotLoadedError):
                raise ModelNotReady(str(err), retry_after=5) from err
            raise ModelUnavailable(str(err), retry_after=err.retry_after) from err
        self._metrics.queue_waiting.labels(prepared.model).set(prepared.engine.waiting)
        objective = targets.first_token_s  # the class's, with the allowance for its prompt
        engine = prepared.engine
        return Generation(
            runs,
            objective,
            lambda waited: self._admission.shed(klass, waited, objective, ticket),
            doomed=lambda waited: self._admission.doomed(engine, runs, waited, objective),
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
        recorder). Refusals and failures are DomainErrors; a generation its caller cancelled
        is recorded as CLIENT_CLOSED, without validation."""
        if prepared.ticket is None:
            prepared.ticket = self._admission.book.ticket(
                prepared.klass.value, prepared.key.account.name
            )
        ticket = prepared.ticket
        try:
            return await self._complete(prepared, ticket, sink, record)
        except NodeFault:  # the node failed a request it had admitted
            ticket.refuse("error")
            raise
        finally:
            ticket.close()  # ended any other way (admitted, its client gone): counted once

    async def _complete(
        self, prepared: Prepared, ticket: Ticket, sink: Sink | None, record: Recorder | None
    ) -> Completed:
        sink = sink if sink is not None else Sink()
        record = record if record is not None else self.record
        streams = self._streams(prepared)
        ends: list[Finished | None] = [None] * prepared.n
        choices: list[Choice | None] = [None] * prepared.n
        async with contextlib.aclosing(self._start(prepared, ticket)) as generation:
            await sink.started(generation)
            # The first event before anything is answered, so a grammar the engine refuses
            # (or a shed) is still a proper status code rather than an error in a stream.
            index, event = await anext(generation)
            await sink.first(event)
            try:
                with contextlib.ExitStack() as stack:
                    if sink.stream_span:
                        stack.enter_context(
                            self._tracing.span("stream", {"kvl.model": prepared.model})
                        )
                    await sink.streaming()
                    while True:
                        if isinstance(event, TextDelta):
                            delta = streams[index].feed(event)
                        else:
                            ends[index] = event
                            delta, choices[index] = streams[index].finish(event)
                        if delta:
                            await sink.delta(index, delta)
                        if generation.done:
                            break
                        index, event = await anext(generation)
            except (ConnectionResetError, asyncio.CancelledError):
                if sink.record_when_gone:
                    # The client went away: stop the sequences, still count what they spent.
                    generation.cancel()
                    rest = await asyncio.shield(drain(generation))
                    done = merge([end for end in ends if end is not None] + rest)
                    self._admission.finished(prepared.model, prepared.klass, done, ticket)
                    await asyncio.shield(record(prepared, done, CLIENT_CLOSED))
                raise
            finished = merge([end for end in ends if end is not None])
            ended = [choice for choice in choices if choice is not None]
            problems: list[str] = []
            if finished.finish_reason == "cancelled":
                status = CLIENT_CLOSED
            else:
                problems = self._problems(prepared, ended, streams)
                status = ErrorCode.output_validation_failed.status if problems else 200
            # Here, not in `record`: a caller's own recorder (a job's) cannot skip it.
            self._admission.finished(prepared.model, prepared.klass, finished, ticket)
            await record(prepared, finished, status)
        return Completed(prepared, finished, problems, status, ended)

    def _streams(self, prepared: Prepared) -> list[ChoiceStream]:
        vocab = prepared.engine.require_vocab()
        plan = prepared.tools
        return [
            ChoiceStream(
                index,
                vocab,
                logprobs=prepared.logprobs,
                tools=ToolCalls(plan.stream()) if plan is not None else None,
            )
            for index in range(prepared.n)
        ]

    def _trace_generation(self, prepared: Prepared, finished: Finished) -> None:
        """The worker's side as spans, from its own timings: waiting for a batch slot, then
        prefill and decode in the slot."""
        start = prepared.submitted_at
        if start is None or not self._tracing.enabled:
            return
        admitted = start + (finished.queue_s or 0.0)
        self._tracing.record("batcher", start, admitted, {"kvl.model": prepared.model})
        sampling = prepared.request.sampling
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
                # The model call as OpenTelemetry's GenAI conventions name it.
                "gen_ai.operation.name": GENAI_OPERATION[prepared.kind],
                "gen_ai.provider.name": GENAI_PROVIDER,
                "gen_ai.request.model": prepared.requested or prepared.engine.record.name,
                "gen_ai.response.model": prepared.model,
                "gen_ai.request.max_tokens": prepared.request.max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.request.seed": sampling.seed,
                "gen_ai.request.choice.count": prepared.n if prepared.n != 1 else None,
                "gen_ai.usage.input_tokens": finished.prompt_tokens,
                "gen_ai.usage.output_tokens": finished.completion_tokens,
                "gen_ai.response.finish_reasons": (finished.finish_reason,),
                "gen_ai.response.id": prepared.response_id,
            },
        )

    def _problems(
        self, prepared: Prepared, choices: list[Choice], streams: list[ChoiceStream]
    ) -> list[str]:
        with self._tracing.span("validation", {"kvl.structured": prepared.structured is not None}):
            found: list[str] = []
            for choice in choices:
                problems = self._output_problems(prepared, choice, streams[choice.index].problems())
                prefix = f"choice {choice.index}: " if prepared.n > 1 else ""
                found += [prefix + problem for problem in problems]
            return found

    def _output_problems(self, prepared: Prepared, choice: Choice, calls: list[str]) -> list[str]:
        """Why a choice's output fails its contract (empty when it holds): `calls`, the
        problems its stream found in its tool calls."""
        finished = choice.finished
        if prepared.structured is None:
            cut = calls and finished.finish_reason == "length"
            # Tool calls broken off: say why, and what to change.
            return [*calls, self._cut(prepared)] if cut else calls
        if finished.finish_reason == "cancelled":
            return calls
        found = calls + prepared.structured.problems(choice.content)
        if finished.finish_reason == "length":
            found.insert(0, self._cut(prepared))
        return found

    @staticmethod
    def _cut(prepared: Prepared) -> str:
        return (
            f"generation stopped at max_tokens={prepared.request.max_tokens}; "
            "allow more tokens for the whole output"
        )

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
    """The events of a running generation's choices, as (choice, event), with engine
    failures as DomainErrors. `done` once every choice has finished."""

    def __init__(
        self,
        runs: list[Run],
        first_token_s: float | None = None,
        shed: Callable[[float], Overloaded] | None = None,
        *,
        doomed: Callable[[float], bool] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._runs = runs
        self._on_close = on_close
        # A request still waiting in the queue at this deadline (its class's SLO.B, with
        # the allowance for its prompt) is dropped from it rather than served late; one that
        # holds a slot by then is being served (a busy host slows it: not the queue's fault)
        # and goes on. Until then, `doomed(waited)` is asked every RECHECK_S: a request
        # the prediction says will not hold a slot by then is dropped at once.
        self._started = time.monotonic()
        self._first_token_s = first_token_s
        self._shed = shed
        self._doomed = doomed
        self._first = True
        self._open = set(range(len(runs)))
        # Several choices: each run's next event is awaited at once, as its own task.
        self._next: dict[int, asyncio.Task[Event]] = {}

    @property
    def done(self) -> bool:
        return not self._open

    def cancel(self) -> None:
        for run in self._runs:
            run.cancel()

    async def aclose(self) -> None:
        try:
            for task in self._next.values():
                task.cancel()
            for run in self._runs:
                await run.aclose()
        finally:
            if self._on_close is not None:
                self._on_close()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, Event]:
        if not self._open:
            raise StopAsyncIteration
        try:
            if self._first and self._first_token_s is not None:
                self._first = False
                return await self._first_event(self._first_token_s)
            return await self._event()
        except GrammarError as err:
            raise InvalidSchema(str(err), param="response_format") from err
        except WorkerUnavailableError as err:
            raise ModelUnavailable(str(err), retry_after=err.retry_after) from err
        except EngineError as err:
            raise InternalError(f"generation failed: {err}") from err

    async def _first_event(self, deadline_s: float) -> tuple[int, Event]:
        while True:
            left = deadline_s - (time.monotonic() - self._started)
            tick = min(left, RECHECK_S) if self._doomed is not None else left
            try:
                async with asyncio.timeout(max(0.0, tick)):  # not wait_for: see wait_until_set
                    return await self._event()
            except TimeoutError:
                if any(run.seated for run in self._runs):
                    return await self._event()
                waited = time.monotonic() - self._started
                if waited < deadline_s and not (self._doomed and self._doomed(waited)):
                    continue
                self.cancel()
                if self._shed is None:  # pragma: no cover - set with the deadline
                    raise
                raise self._shed(waited) from None

    async def _event(self) -> tuple[int, Event]:
        if len(self._runs) == 1:  # the common case: no task per token
            event = await anext(self._runs[0])
            if isinstance(event, Finished):
                self._open.discard(0)
            return 0, event
        for index in self._open - self._next.keys():
            self._next[index] = asyncio.ensure_future(anext(self._runs[index]))
        done, _ = await asyncio.wait(self._next.values(), return_when=asyncio.FIRST_COMPLETED)
        # The lowest choice first, so a choice's events keep their order among equals.
        index = min(i for i, task in self._next.items() if task in done)
        event = self._next.pop(index).result()
        if isinstance(event, Finished):
            self._open.discard(index)
        return index, event


def _choice_request(request: GenerationRequest, index: int) -> GenerationRequest:
    """The request of choice `index`: each choice samples with a seed of its own."""
    if index == 0 or request.sampling.seed is None:
        return request
    seed = (request.sampling.seed + index) % 2**63
    return replace(request, sampling=replace(request.sampling, seed=seed))


def merge(ends: list[Finished]) -> Finished:
    """The choices' ends as one, for usage: the prompt once, every choice's tokens."""
    if len(ends) == 1:
        return ends[0]
    if not ends:
        raise AssertionError("a generation has at least one choice")  # pragma: no cover
    first = ends[0]
    ttfts = [e.ttft_s for e in ends if e.ttft_s is not None]
    queues = [e.queue_s for e in ends if e.queue_s is not None]
    cancelled = any(e.finish_reason == "cancelled" for e in ends)
    return replace(
        first,
        finish_reason="cancelled" if cancelled else first.finish_reason,
        completion_tokens=sum(e.completion_tokens for e in ends),
        ttft_s=min(ttfts) if ttfts else None,
        duration_s=max(e.duration_s for e in ends),
        queue_s=min(queues) if queues else None,
    )


# Prompts up to this many characters are tokenized on the event loop (tens of
# microseconds); longer ones on a thread, so a long prompt never holds the loop. A thread
# hop costs more than a short prompt's tokens, and on a loaded machine it waits for the
# thread to be scheduled: a request the door then refuses waited milliseconds for nothing.
INLINE_TOKENIZE_CHARS = 2048


def _rough_tokens(req: ChatCompletionRequest | CompletionRequest) -> int:
    """The prompt's length in tokens before it is tokenized: about four characters a
    token (English text; a place at the door counts it so until it is tokenized)."""
    if isinstance(req, ChatCompletionRequest):
        chars = sum(len(m.text()) for m in req.messages)
    else:
        chars = sum(len(p) for p in req.prompt) if isinstance(req.prompt, list) else len(req.prompt)
    return max(1, chars // 4)


def _max_tokens(req: ChatCompletionRequest | CompletionRequest, limit: int) -> int:
    """The completion's length at most, before its prompt is known (`limit` where unset)."""
    asked = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None
    return min(asked or req.max_tokens or limit, limit)


async def _tokenize(vocab: Vocabulary, text: str, *, chat: bool) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return vocab.tokenize(text, chat=chat)
    return await asyncio.to_thread(vocab.tokenize, text, chat=chat)


def _message(message: ChatMessage) -> dict[str, Any]:
    # OpenAI's newer `developer` role is the system prompt for models that predate it.
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _logit_bias(bias: dict[str, float] | None, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token id as text → bias) for this model's vocabulary."""
    if not bias:
        return ()
    out: list[tuple[int, float]] = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < n_vocab:
            raise InvalidRequest(
                f"`logit_bias` key {key!r} is not a token id of this model (0..{n_vocab - 1})",
                param="logit_bias",
            )
        out.append((token, value))
    return tuple(sorted(out))


def _first(*values: _T | None) -> _T:
    """The first value that is set (the last is the default, always set)."""
    return next(v for v in values if v is not None)


def _tools(
    req: ChatCompletionRequest, template: ChatTemplate, tool_format: str = "auto"
) -> ToolPlan | None:
    """The request's tools, planned for this model's template (its own tool format, or
    the generic one, unless the deployment's preset says which); None without tools."""
    if not req.tools:
        return None
    choice = req.tool_choice
    # Calls in parallel unless the request says not; for a function the request names,
    # one call unless it asks for more (a small model repeats the call it is forced to).
    named = isinstance(choice, BaseModel)
    parallel = req.parallel_tool_calls is True if named else req.parallel_tool_calls is not False
    try:
        return plan_tools(
            [tool.model_dump(exclude_none=True) for tool in req.tools],
            choice.model_dump() if isinstance(choice, BaseModel) else choice,
            parallel_tool_calls=parallel,
            template=template,
            tool_format=tool_format,
        )
    except ToolSpecError as err:
        # A parameters schema no grammar can enforce is the schema's fault; the rest
        # (a name, a choice) the field's.
        refusal = InvalidSchema if err.param == "tools" else InvalidRequest
        raise refusal(str(err), param=err.param) from err


def _structured(req: ChatCompletionRequest) -> StructuredOutput | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return json_object_output()
    try:
        return json_schema_output(rf.json_schema.schema_, rf.json_schema.name)
    except SchemaUnusableError as err:
        raise InvalidSchema(str(err), param="response_format.json_schema.schema") from err


# The status recorded for a request whose client went away before it ended (nginx's).
CLIENT_CLOSED = 499


async def drain(generation: Generation) -> list[Finished]:
    """The Finished events of a generation's choices still running, skipping their text."""
    ends: list[Finished] = []
    async for _, event in generation:
        if isinstance(event, Finished):
            ends.append(event)
    return ends


def invalid_output(completed: Completed) -> OutputInvalid:
    """The error of an output that fails its contract (it fails closed): its
    `response_format`, or the tool calls the request asked for."""
    what = (
        "the tool calls are not valid"
        if completed.contract == "tools"
        else ("the output does not satisfy response_format")
    )
    return OutputInvalid(what + ": " + "; ".join(completed.problems), param=completed.contract)
