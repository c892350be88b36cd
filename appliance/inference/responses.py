"""OpenAI's response shapes of a completion: the whole answer, and the stream's chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.inference.completions import Prepared
    from appliance.serving.engine import Finished


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
