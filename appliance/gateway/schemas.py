"""Request bodies of the OpenAI-compatible API, as pydantic models (OpenAI's field names)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.serving.registry import MAX_REPLICAS

_I64 = 2**63


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


class AdminModelRequest(_Body):
    """Load a model, or change its replicas or pin."""

    model: str = Field(min_length=1, max_length=200, description="`name` or `name@version`.")
    replicas: int | None = Field(
        None, ge=1, le=MAX_REPLICAS, description="Worker processes serving it (default 1)."
    )
    pinned: bool | None = Field(
        None, description="Pinned models stay loaded and are loaded again at start."
    )
