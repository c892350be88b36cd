"""OpenAI's bodies of a completion's answer: the whole answer, and the stream's chunks (the
Responses API, `/v1/responses`, is responses_api.py; its stored answers state/responses.py)."""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING, Any

from appliance.inference.choices import legacy_logprobs
from shared import __version__

if TYPE_CHECKING:
    from appliance.inference.choices import Choice, ChoiceDelta
    from appliance.inference.completions import Completed, Prepared
    from appliance.serving.engine import Finished


def usage(finished: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        # The prompt tokens whose cells were copied from a shared prefix, not computed.
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
    }


def finish_reason(finished: Finished) -> str:
    return "length" if finished.finish_reason == "length" else "stop"


def system_fingerprint(prepared: Prepared) -> str:
    """What decides the answers besides the request: this software and the model file (a
    client comparing seeded answers learns when either changed)."""
    return _fingerprint(prepared.engine.record.sha256)


@functools.lru_cache(maxsize=64)
def _fingerprint(model_sha256: str) -> str:
    # Every streamed chunk carries it: hashed once per model, not once per token.
    return "fp_" + hashlib.sha256(f"{__version__}:{model_sha256}".encode()).hexdigest()[:12]


def _head(prepared: Prepared, *, chunk: bool) -> dict[str, Any]:
    chat = prepared.kind == "chat"
    obj = "text_completion"
    if chat:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    return {
        "id": prepared.response_id,
        "object": obj,
        "created": prepared.created,
        "model": prepared.model,
        "system_fingerprint": system_fingerprint(prepared),
    }


def response_body(completed: Completed) -> dict[str, Any]:
    """The whole answer, every choice in it."""
    prepared = completed.prepared
    body = _head(prepared, chunk=False)
    body["choices"] = [_choice(prepared, choice) for choice in completed.choices]
    body["usage"] = usage(completed.finished)
    return body


def _choice(prepared: Prepared, choice: Choice) -> dict[str, Any]:
    if prepared.kind == "chat":
        message: dict[str, Any] = {
            "role": "assistant",
            "content": choice.content if choice.content or not choice.tool_calls else None,
            "refusal": None,
        }
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
        return {
            "index": choice.index,
            "message": message,
            "finish_reason": choice.finish_reason,
            "logprobs": None if choice.logprobs is None else {"content": choice.logprobs},
        }
    return {
        "index": choice.index,
        "text": choice.content,
        "finish_reason": choice.finish_reason,
        "logprobs": None if choice.logprobs is None else legacy_logprobs(choice.logprobs),
    }


def chunk_body(
    prepared: Prepared,
    *,
    index: int = 0,
    delta: ChoiceDelta | None = None,
    text: str | None = None,
    role: bool = False,
    choice: Choice | None = None,
    finished: Finished | None = None,
    usage_only: bool = False,
) -> dict[str, Any]:
    """One streamed chunk in OpenAI's format: a delta of choice `index`, its opening
    (`role`), or its end (`choice`, with its reason).

    The last chunk that carries a `finish_reason` also carries `usage` (`finished`, as
    llama-server does), so every client sees the token counts; with
    `stream_options.include_usage` OpenAI's separate final chunk (empty `choices`) follows
    as well.
    """
    body = _head(prepared, chunk=True)
    if usage_only and finished is not None:
        body["choices"] = []
        body["usage"] = usage(finished)
        return body
    if choice is not None:
        index = choice.index
    if text is not None:
        content: str | None = text
    else:
        content = delta.content if delta is not None else None
    reason = choice.finish_reason if choice is not None else None
    logprobs = delta.logprobs if delta is not None and delta.logprobs else None
    if prepared.kind == "chat":
        piece: dict[str, Any] = {}
        if role:
            piece["role"] = "assistant"
            piece["content"] = ""
        if content is not None:
            piece["content"] = content
        if delta is not None and delta.tool_calls:
            piece["tool_calls"] = delta.tool_calls
        out: dict[str, Any] = {
            "index": index,
            "delta": piece,
            "finish_reason": reason,
            "logprobs": None if logprobs is None else {"content": logprobs},
        }
    else:
        out = {
            "index": index,
            "text": content or "",
            "finish_reason": reason,
            "logprobs": None if logprobs is None else legacy_logprobs(logprobs),
        }
    body["choices"] = [out]
    if finished is not None:
        body["usage"] = usage(finished)
    return body
