"""Request bodies of the OpenAI-compatible API, as pydantic models (OpenAI's field names),
and a JSON object parsed into one with every failure as one clear error shape.

The completion and embedding services take these, from the HTTP and WebSocket handlers,
the job runner (an item's stored body) and the package generator alike. No aiohttp here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from shared.errors import (
    InvalidRequest,
    MissingParameter,
    UnknownParameter,
    UnsupportedParameter,
)

_I64 = 2**63

# Choices in one request, and alternatives per token with logprobs (OpenAI's bounds).
MAX_CHOICES = 8
MAX_TOP_LOGPROBS = 20

M = TypeVar("M", bound=BaseModel)

_EMPTY: tuple[object, ...] = (None, False, [], {})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    type: Literal["text", "input_text", "output_text"]
    text: str = Field(max_length=1_000_000)


class OtherPart(BaseModel):
    """A content part the models here cannot take (an image, audio, a file): refused by
    name rather than as an unknown shape."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(max_length=64)


def _part_kind(value: object) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    # any JSON may come as the type: a list is no set member (refused as "other", not raised)
    return (
        "text"
        if isinstance(kind, str) and kind in {"text", "input_text", "output_text"}
        else "other"
    )


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[OtherPart, Tag("other")],
    Discriminator(_part_kind),
]


class FunctionCallIn(_Body):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1_000_000, description="The call's arguments as JSON text.")


class ToolCallIn(_Body):
    """A call an earlier assistant turn made (in the history a client sends back)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


# What each role needs, in the JSON Schema too (the validator below says it in words): a
# generator of schema-valid requests, and a client's, then reach the model.
_ROLE_RULES: dict[str, Any] = {
    "allOf": [
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {
                "required": ["tool_call_id", "content"],
                "properties": {"tool_call_id": {"type": "string", "minLength": 1}},
            },
        },
        {
            "if": {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]}}},
            "then": {
                "required": ["content"],
                "properties": {"content": {"not": {"type": "null"}}, "tool_calls": False},
            },
        },
    ]
}


class ChatMessage(_Body):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_ROLE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(
        None, description="Text, or a list of text parts. Image and audio parts are refused."
    )
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCallIn] | None = Field(
        None, max_length=128, description="An assistant turn's calls."
    )
    tool_call_id: str | None = Field(
        None, max_length=256, description="A `tool` turn: the call it answers."
    )
    refusal: str | None = Field(None, max_length=100_000)

    @model_validator(mode="after")
    def _fits_role(self) -> ChatMessage:
        if isinstance(self.content, list):
            for index, part in enumerate(self.content):
                if isinstance(part, OtherPart):
                    raise PydanticCustomError(
                        "unsupported_part",
                        "content parts of type `{kind}` are not supported (content[{index}]); "
                        "the models here read text",
                        {"kind": part.type, "index": index},
                    )
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("tool_call_id", "a `tool` message needs `tool_call_id`")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls", "only an `assistant` message has `tool_calls`")
        if self.content is None and not self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("content", "`content` is required for this role")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class JsonSchemaSpec(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=10_000)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormatText(_Body):
    type: Literal["text"]


class ResponseFormatJsonObject(_Body):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class StreamOptions(BaseModel):
    # OpenAI adds options here (include_obfuscation …); those not known are ignored.
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class FunctionSpec(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments; none: a function without arguments."
    )
    strict: bool | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: str = Field(max_length=64)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

_Name = Annotated[str, Field(min_length=1, max_length=256)]


class _Sampling(_Body):
    model: _Name | None = Field(
        None,
        description=(
            "`name`, `name@version` or an alias (`model.aliases`); omitted: `model.default`."
        ),
    )
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-_I64, lt=_I64)
    stop: (
        Annotated[str, Field(min_length=1, max_length=256)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)]
        | None
    ) = Field(None, description="Up to 4 stop strings.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description=f"Choices, 1 to {MAX_CHOICES}.")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=1024, description="Token id (of this model's vocabulary) to a bias."
    )
    user: str | None = Field(None, max_length=256)
    # llama.cpp's samplers beyond OpenAI's (llama-server, Ollama and vLLM take them).
    top_k: int | None = Field(None, ge=0, le=100_000, description="0: off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="0: off.")
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0, description="1: off.")
    repeat_last_n: int | None = Field(None, ge=0, le=4096, description="Tokens it looks back.")

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    # Body fields that were not this API's and were ignored (the `Kvl-Ignored-Parameters`
    # response header names them).
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @property
    def ignored(self) -> tuple[str, ...]:
        return self._ignored


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = Field(
        None, description="`none`, `auto` (with tools, the default), `required`, or one function."
    )
    parallel_tool_calls: bool | None = Field(None, description="Several calls in one turn.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "`top_logprobs` needs `logprobs: true`")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError("tools", "each tool needs its own function name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError(
                "tool_choice",
                "`tool_choice` names `{name}`, which is not in `tools`",
                {"name": choice.function.name},
            )
        if choice == "required" and not names:
            raise PydanticCustomError("tool_choice", "`tool_choice: required` needs `tools`")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(
        description="A string, or a list holding one string; token arrays are not supported."
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token (legacy API)."
    )
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.echo:
            raise PydanticCustomError("echo", "`echo: true` is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise PydanticCustomError("best_of", "`best_of` other than `n` is not supported")
        return self


_Text = Annotated[str, Field(min_length=1)]
_Tokens = Annotated[list[int], Field(min_length=1)]


class EmbeddingRequest(_Body):
    model: _Name | None = Field(
        None, description="`name`, `name@version` or an alias; omitted: the embedding model."
    )
    input: (
        _Text
        | Annotated[list[_Text], Field(min_length=1)]
        | _Tokens
        | Annotated[list[_Tokens], Field(min_length=1)]
    ) = Field(
        description=(
            "A string, or a list of strings (at most `embeddings.max_inputs`), none empty. "
            "Token arrays are refused: the model's tokenizer is not OpenAI's."
        )
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`base64`: each vector as base64 of little-endian float32."
    )
    dimensions: int | None = Field(
        None, ge=1, description="Only the model's own dimension (384) is supported."
    )
    user: str | None = Field(None, max_length=256)


# OpenAI parameters the appliance knows and cannot honour: refused with a clear 400 (the
# answer would be wrong if they were ignored), unless empty.
UNSUPPORTED_CHAT = frozenset({"functions", "function_call", "audio", "prediction"})
UNSUPPORTED_COMPLETION = frozenset({"suffix"})

# OpenAI parameters that change nothing here (billing, storage, routing at OpenAI):
# accepted and ignored, and named in `Kvl-Ignored-Parameters`.
IGNORED_CHAT = frozenset(
    {
        "store",
        "metadata",
        "service_tier",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "prompt_cache_key",
        "safety_identifier",
        "modalities",
    }
)
IGNORED_COMPLETION = frozenset({"store", "metadata", "service_tier"})


def completion_request(
    body: dict[str, Any], *, chat: bool, strict: bool = False
) -> ChatCompletionRequest | CompletionRequest:
    """A chat (or text) completion's body, parsed as its route parses it: fields this API
    does not know are ignored (and reported) as llama-server and vLLM do, or refused with
    `strict` (`server.strict_parameters`)."""
    if chat:
        if _audio_asked(body):
            raise UnsupportedParameter(
                "`modalities` asks for audio, which chat completions here do not produce; "
                "use /v1/audio/speech",
                param="modalities",
            )
        return _lenient(ChatCompletionRequest, body, UNSUPPORTED_CHAT, IGNORED_CHAT, strict)
    return _lenient(CompletionRequest, body, UNSUPPORTED_COMPLETION, IGNORED_COMPLETION, strict)


def _audio_asked(body: dict[str, Any]) -> bool:
    modalities = body.get("modalities")
    return isinstance(modalities, list) and "audio" in modalities


S = TypeVar("S", bound=_Sampling)


def _lenient(
    model: type[S],
    body: dict[str, Any],
    unsupported: frozenset[str],
    known_ignored: frozenset[str],
    strict: bool,
) -> S:
    fields = {info.alias or name for name, info in model.model_fields.items()}
    ignored = sorted(known_ignored & body.keys())
    unknown = sorted(body.keys() - fields - unsupported - known_ignored)
    if unknown and strict:
        name = unknown[0]
        raise UnknownParameter(
            f"unrecognized request argument `{name}` (server.strict_parameters is on)",
            param=name,
        )
    drop = set(ignored) | set(unknown)
    req = parse_body(model, {k: v for k, v in body.items() if k not in drop}, unsupported)
    req._ignored = tuple(sorted(drop))  # noqa: SLF001 - set once, where it is parsed
    return req


# -- parsing ------------------------------------------------------------------------------


def parse_body(
    model: type[M], body: dict[str, Any], unsupported: frozenset[str] = frozenset()
) -> M:
    """A JSON object as `model`, or the error shape naming the parameter; a parameter in
    `unsupported` (one of OpenAI's this appliance lacks) is refused by name, unless empty."""
    for name in sorted(unsupported & body.keys()):
        if body[name] not in _EMPTY:
            raise UnsupportedParameter(
                f"`{name}` is not supported by this appliance; remove it",
                param=name,
            )
    try:
        return model.model_validate({k: v for k, v in body.items() if k not in unsupported})
    except ValidationError as err:
        raise _translate(err) from err


def param_path(loc: tuple[int | str, ...]) -> str:
    """OpenAI writes parameter paths as `messages[0].content`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _translate(err: ValidationError) -> InvalidRequest:
    errors = err.errors(include_url=False)
    # A union reports one error per member; the deepest location is the useful one, and
    # there a broken constraint (an empty list) says more than "not a string" from another member.
    cleaned = [(_clean_loc(e["loc"]), e) for e in errors]
    loc, first = max(cleaned, key=lambda pair: (len(pair[0]), pair[1]["type"] not in _WRONG_TYPE))
    param = param_path(loc) or None
    kind = first["type"]
    if kind == "extra_forbidden":
        return UnknownParameter(f"unrecognized request argument `{param}`", param=param)
    if kind == "missing":
        return MissingParameter(f"`{param}` is required", param=param)
    if kind in _CUSTOM:
        # A check across fields (a model validator): its type names the field.
        param = param_path((*loc, kind)) if kind != "unsupported_part" else param
        refusal = UnsupportedParameter if kind in _UNSUPPORTED else InvalidRequest
        return refusal(first["msg"], param=param)
    return InvalidRequest(f"`{param}`: {first['msg']}", param=param)


# The types of the errors the model validators above raise.
_UNSUPPORTED = frozenset({"unsupported_part", "echo", "best_of"})
_CUSTOM = _UNSUPPORTED | {
    "tool_call_id", "tool_calls", "content", "top_logprobs", "tools", "tool_choice"
}  # fmt: skip

# Error types that say only "the value is not of this union member's type".
_WRONG_TYPE = frozenset(
    {"string_type", "int_type", "int_parsing", "list_type", "none_required", "model_type"}
)

# Fields holding a union discriminated by `type`: pydantic puts the tag after them in `loc`.
_DISCRIMINATED = frozenset({"response_format"})
_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """A location without the union-member tags that pydantic inserts."""
    out: list[int | str] = []
    skip_next = False
    for part in loc:
        if skip_next:
            skip_next = False
            continue
        if isinstance(part, str) and (
            part in _MEMBER_TAGS or "[" in part or part.startswith(("function-", "constrained-"))
        ):
            continue
        out.append(part)
        skip_next = part in _DISCRIMINATED
    return tuple(out)
