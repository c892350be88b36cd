"""Request bodies of the OpenAI-compatible API, as pydantic models (OpenAI's field names),
and a JSON object parsed into one with every failure as one clear error shape.

The completion and embedding services take these, from the HTTP and WebSocket handlers,
the job runner (an item's stored body) and the package generator alike. No aiohttp here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import ApiError, ErrorCode

_I64 = 2**63

M = TypeVar("M", bound=BaseModel)

_EMPTY: tuple[object, ...] = (None, False, [], {})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = Field(
        ..., description="Text, or a list of text parts. Image and audio parts are not supported."
    )
    name: str | None = Field(None, max_length=64)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str = Field(min_length=1, max_length=256, description="`name` or `name@version`.")
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
    n: int = Field(1, ge=1, le=1, description="Only 1 choice per request is supported.")
    user: str | None = Field(None, max_length=256)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(
        description="A string, or a list holding one string; token arrays are not supported."
    )


_Text = Annotated[str, Field(min_length=1)]
_Tokens = Annotated[list[int], Field(min_length=1)]


class EmbeddingRequest(_Body):
    model: str = Field(min_length=1, max_length=256, description="`name` or `name@version`.")
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


# OpenAI parameters the appliance knows and refuses with a clear 400, rather than
# "unknown parameter": a client sending them gets told it is a missing feature.
UNSUPPORTED_CHAT = frozenset(
    {
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "audio",
        "modalities",
        "prediction",
        "store",
        "metadata",
        "reasoning_effort",
        "service_tier",
        "web_search_options",
    }
)
UNSUPPORTED_COMPLETION = frozenset({"logprobs", "logit_bias", "echo", "suffix", "best_of"})


def completion_request(
    body: dict[str, Any], *, chat: bool
) -> ChatCompletionRequest | CompletionRequest:
    """A chat (or text) completion's body, parsed as its route parses it."""
    if chat:
        return parse_body(ChatCompletionRequest, body, UNSUPPORTED_CHAT)
    return parse_body(CompletionRequest, body, UNSUPPORTED_COMPLETION)


# -- parsing ------------------------------------------------------------------------------


def parse_body(
    model: type[M], body: dict[str, Any], unsupported: frozenset[str] = frozenset()
) -> M:
    """A JSON object as `model`, or the error shape naming the parameter; a parameter in
    `unsupported` (one of OpenAI's this appliance lacks) is refused by name, unless empty."""
    for name in sorted(unsupported & body.keys()):
        if body[name] not in _EMPTY:
            raise ApiError(
                ErrorCode.unsupported_parameter,
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


def _translate(err: ValidationError) -> ApiError:
    errors = err.errors(include_url=False)
    # A union reports one error per member; the deepest location is the useful one, and
    # there a broken constraint (an empty list) says more than "not a string" from another member.
    cleaned = [(_clean_loc(e["loc"]), e) for e in errors]
    loc, first = max(cleaned, key=lambda pair: (len(pair[0]), pair[1]["type"] not in _WRONG_TYPE))
    param = param_path(loc) or None
    kind = first["type"]
    if kind == "extra_forbidden":
        return ApiError(
            ErrorCode.unknown_parameter, f"unrecognized request argument `{param}`", param=param
        )
    if kind == "missing":
        return ApiError(ErrorCode.missing_parameter, f"`{param}` is required", param=param)
    if param == "n":
        return ApiError(ErrorCode.unsupported_parameter, "only `n: 1` is supported", param=param)
    return ApiError(ErrorCode.invalid_parameter, f"`{param}`: {first['msg']}", param=param)


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
