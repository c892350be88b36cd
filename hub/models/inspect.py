"""A GGUF read before the hub offers it for placement: what it is (architecture,
parameters, quantisation, trained context, tokenizer), whether its chat template renders a
conversation, and from these the memory a replica needs (shared/gguf.py `replica_mib`,
the estimate the appliance's budget counts too)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hub.models.errors import PullError
from shared.chat import ChatTemplateError, select_template
from shared.gguf import DEFAULT_N_CTX, DEFAULT_N_SLOTS, GGUFError, KvShape, read_gguf, replica_mib

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from hub.state.deployments import ModelArtifact

# A conversation any chat template should render: a system message, a finished turn, a new
# question (Gemma's template folds the system message into the first user turn).
TEST_CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
]


@dataclass(frozen=True)
class Inspection:
    architecture: str | None
    parameters: int | None
    quantisation: str | None
    context_length: int | None  # what it was trained for
    tokenizer: str | None  # `tokenizer.ggml.model`: gpt2, llama, …
    chat_template: str  # whose: "gguf" (its own), "family:ARCH" or "chatml"
    template_error: str | None  # None: the template renders TEST_CONVERSATION
    kv_per_token: int  # K and V elements over the full-attention layers
    kv_per_token_sliding: int  # over the sliding-window layers
    sliding_window: int  # their window (0: none)

    def replica_mib(
        self,
        size_bytes: int,
        n_ctx: int = DEFAULT_N_CTX,
        n_slots: int = DEFAULT_N_SLOTS,
        kv_type: str = "f16",
    ) -> int:
        """The memory one replica needs at this context, slots and KV cache type."""
        shape = KvShape(self.kv_per_token, self.kv_per_token_sliding, self.sliding_window)
        return round(replica_mib(shape, size_bytes, n_ctx, n_slots, kv_type=kv_type))

    @classmethod
    def of_json(cls, stored: Mapping[str, Any]) -> Inspection | None:
        """An inspection as `as_json` stored it; None when it is not one this hub reads."""
        try:
            return cls(**stored)
        except TypeError:
            return None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def inspect(path: Path) -> Inspection:
    """The file read; PullError (`unsupported`) when it is not a GGUF model."""
    try:
        info = read_gguf(path, skip_arrays=False)
    except (GGUFError, OSError) as err:
        raise PullError("unsupported", f"not a GGUF model the hub can read: {err}") from err
    meta = info.metadata
    tokens = meta.get("tokenizer.ggml.tokens")

    def token(key: str) -> str:
        index = meta.get(key)
        if isinstance(tokens, list) and isinstance(index, int) and 0 <= index < len(tokens):
            return str(tokens[index])
        return ""

    template = select_template(
        info.chat_template,
        info.architecture,
        token("tokenizer.ggml.bos_token_id"),
        token("tokenizer.ggml.eos_token_id"),
    )
    error = None
    try:
        if not template.render(TEST_CONVERSATION).strip():
            error = "the chat template renders an empty prompt"
    except ChatTemplateError as err:
        error = str(err)
    tokenizer = meta.get("tokenizer.ggml.model")
    shape = info.kv_shape()
    return Inspection(
        info.architecture,
        info.parameters,
        info.quantization,
        info.context_length,
        tokenizer if isinstance(tokenizer, str) else None,
        template.origin,
        error,
        shape.full,
        shape.sliding,
        shape.window,
    )


def deployment_mib(model: ModelArtifact, preset: Mapping[str, Any] | None) -> int:
    """The memory one replica of a deployment needs: the model's own figure, or, where the
    deployment's preset loads it otherwise (context, slots, KV cache type), the estimate
    for those from what its file says."""
    given = preset or {}
    n_ctx, n_slots, kv_type = given.get("n_ctx"), given.get("n_slots"), given.get("kv_type")
    inspection = None if model.inspection is None else Inspection.of_json(model.inspection)
    if (n_ctx, n_slots, kv_type) == (None, None, None) or inspection is None:
        return model.memory_mib
    return inspection.replica_mib(
        model.size_bytes, n_ctx or DEFAULT_N_CTX, n_slots or DEFAULT_N_SLOTS, kv_type or "f16"
    )
