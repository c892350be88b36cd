"""OpenAI's Responses API on the chat completion service.

A Responses request becomes a chat completion: `instructions` the system message, `input`
(a string, or messages, function calls and their outputs) the conversation, after the
conversation of `previous_response_id` when it names one this account made; `tools`,
`tool_choice` and `text.format` map to their chat equivalents. The answer is built from
the completion's first choice: a `message` output item with its text, and a
`function_call` item per tool call. Answers are kept (`store`, the default) for a bounded
time (`responses.keep_s`), so a follow-up can continue them. No aiohttp here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from appliance.inference.bodies import system_fingerprint
from appliance.inference.schemas import (
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    completion_request,
    parse_body,
)
from appliance.state.responses import ResponseNotFoundError, ResponseStore, StoredResponse
from shared.errors import MissingParameter, ResponseNotFound, UnknownParameter, UnsupportedParameter

if TYPE_CHECKING:
    from appliance.inference.choices import Choice
    from appliance.inference.completions import Completed, CompletionService, Prepared, Sink
    from appliance.settings import ResponsesSettings
    from appliance.state.store import ApiKey, AsyncStore

ROUTE = "/v1/responses"


class _Item(BaseModel):
    # Clients send back output items as they got them (ids, statuses, annotations).
    model_config = ConfigDict(extra="ignore")


class ContentText(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str = Field(max_length=1_000_000)


class ContentOther(_Item):
    type: str = Field(max_length=64)


def _kind(value: object) -> str | None:
    """A part's or item's `type` when it is a string (a client may send any JSON there:
    a list is no set member, and must be refused as other types are, not raise)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


def _content_kind(value: object) -> str:
    return "text" if _kind(value) in {"input_text", "output_text", "text"} else "other"


Content = Annotated[
    Annotated[ContentText, Tag("text")] | Annotated[ContentOther, Tag("other")],
    Discriminator(_content_kind),
]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if isinstance(part, ContentOther):
                raise UnsupportedParameter(
                    f"input parts of type `{part.type}` are not supported; the models here "
                    "read text",
                    param="input",
                )
        return "".join(p.text for p in self.content if isinstance(p, ContentText))


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1_000_000)


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str = Field(max_length=1_000_000)


def _item_kind(value: object) -> str:
    kind = _kind(value)
    return kind if kind in {"function_call", "function_call_output"} else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedFunction(_Body):
    type: Literal["function"]
    name: str = Field(max_length=64)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = Field(None, max_length=10_000)
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # `verbosity` and what OpenAI adds later
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    input: str | list[InputItem] = Field(max_length=10_000)
    instructions: str | None = Field(None, max_length=1_000_000)
    previous_response_id: str | None = Field(None, max_length=256)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    store: bool = True
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)


# OpenAI fields that change nothing here: accepted, named in `Kvl-Ignored-Parameters`.
IGNORED = frozenset(
    {"include", "reasoning", "truncation", "service_tier", "prompt_cache_key", "background"}
)


def parse_request(body: dict[str, Any], *, strict: bool) -> tuple[ResponsesRequest, list[str]]:
    """The request, and the names of the fields ignored (unknown ones too, unless strict)."""
    fields = {info.alias or name for name, info in ResponsesRequest.model_fields.items()}
    unknown = sorted(body.keys() - fields - IGNORED)
    if unknown and strict:
        raise UnknownParameter(
            f"unrecognized request argument `{unknown[0]}` (server.strict_parameters is on)",
            param=unknown[0],
        )
    ignored = sorted((body.keys() & IGNORED) | set(unknown))
    kept = {k: v for k, v in body.items() if k not in ignored}
    return parse_body(ResponsesRequest, kept), ignored


def conversation(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of the request after those of its previous response (without
    the system message: each request's `instructions` are its own, as at OpenAI)."""
    messages = list(history)
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            # Parallel calls of one turn come as consecutive items: one assistant turn.
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_request(
    req: ResponsesRequest, messages: list[dict[str, Any]], *, strict: bool
) -> ChatCompletionRequest:
    """The chat completion that answers `req`."""
    body: dict[str, Any] = {"messages": messages}
    if req.instructions:
        body["messages"] = [{"role": "system", "content": req.instructions}, *messages]
    given = {
        "model": req.model,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    body |= {name: value for name, value in given.items() if value is not None}
    if req.top_logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": req.top_logprobs}
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": tool.model_dump(exclude={"type"}, exclude_none=True),
            }
            for tool in req.tools
        ]
    if isinstance(req.tool_choice, ResponsesNamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or fmt.name is None:
            raise MissingParameter(
                "`text.format` of type json_schema needs `name` and `schema`",
                param="text.format",
            )
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    req_chat = completion_request(body, chat=True, strict=strict)
    assert isinstance(req_chat, ChatCompletionRequest)  # noqa: S101 - chat=True parses chat
    return req_chat


def output_items(response_id: str, choice: Choice) -> list[dict[str, Any]]:
    """The answer's output items: its message (when it has text), then its calls."""
    items: list[dict[str, Any]] = []
    if choice.content or not choice.tool_calls:
        items.append(message_item(response_id, choice.content, "completed", choice.logprobs))
    items += [
        function_item(call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in choice.tool_calls
    ]
    return items


def message_item(
    response_id: str,
    text: str | None,
    status: str,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    content = []
    if text is not None:
        content.append(text_part(text, logprobs))
    return {
        "type": "message",
        "id": "msg_" + response_id.removeprefix("resp_"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def function_item(
    call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call_id.removeprefix("call_"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    response_id: str,
    req: ResponsesRequest,
    prepared: Prepared,
    *,
    status: str,
    output: list[dict[str, Any]],
    completed: Completed | None = None,
) -> dict[str, Any]:
    """The response object, in progress (no `completed` yet) or done."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": prepared.created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": prepared.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "tool_choice": _tool_choice(req),
        "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or ()],
        "text": {"format": _format(req)},
        "metadata": req.metadata or {},
        "user": req.user,
        "system_fingerprint": system_fingerprint(prepared),
        "usage": None,
    }
    if completed is not None:
        finished = completed.finished
        if finished.finish_reason == "length":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["usage"] = {
            "input_tokens": finished.prompt_tokens,
            "input_tokens_details": {"cached_tokens": finished.cached_tokens},
            "output_tokens": finished.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        }
    return body


def _tool_choice(req: ResponsesRequest) -> Any:
    if isinstance(req.tool_choice, ResponsesNamedFunction):
        return req.tool_choice.model_dump()
    return req.tool_choice or "auto"


def _format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


def status_of(completed: Completed) -> str:
    return "incomplete" if completed.finished.finish_reason == "length" else "completed"


class ResponsesService:
    """Runs Responses requests on the completion service; keeps what `store` asks."""

    def __init__(
        self, completions: CompletionService, store: AsyncStore, settings: ResponsesSettings
    ) -> None:
        self._completions = completions
        self._store = store
        self._responses = ResponseStore(store.sync.db)
        self._settings = settings

    async def prepare(
        self, req: ResponsesRequest, key: ApiKey, *, strict: bool
    ) -> tuple[str, Prepared, list[dict[str, Any]]]:
        """Its id, the prepared completion, and the conversation it continues with."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = (
                await self._get(req.previous_response_id, key, "previous_response_id")
            ).messages
        messages = conversation(req, history)
        chat = chat_request(req, messages, strict=strict)
        prepared = await self._completions.prepare(chat, key, ROUTE)
        return "resp_" + prepared.id, prepared, messages

    async def complete(self, prepared: Prepared, sink: Sink | None = None) -> Completed:
        return await self._completions.complete(prepared, sink)

    async def keep(
        self,
        response_id: str,
        key: ApiKey,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        choice: Choice,
    ) -> None:
        """Keep a finished answer for follow-ups, with the conversation it ended."""
        turn: dict[str, Any] = {"role": "assistant", "content": choice.content or None}
        if choice.tool_calls:
            turn["tool_calls"] = choice.tool_calls
        s = self._settings
        await self._store.run(
            self._responses.put,
            response_id,
            key.account.id,
            body,
            [*messages, turn],
            keep_s=s.keep_s,
            max_per_account=s.max_per_account,
        )

    async def get(self, response_id: str, key: ApiKey) -> dict[str, Any]:
        stored: StoredResponse = await self._get(response_id, key, None)
        return stored.body

    async def delete(self, response_id: str, key: ApiKey) -> None:
        try:
            await self._store.run(self._responses.delete, response_id, key.account.id)
        except ResponseNotFoundError as err:
            raise ResponseNotFound(str(err)) from err

    async def _get(self, response_id: str, key: ApiKey, param: str | None) -> StoredResponse:
        try:
            return await self._store.run(self._responses.get, response_id, key.account.id)
        except ResponseNotFoundError as err:
            raise ResponseNotFound(str(err), param=param) from err
