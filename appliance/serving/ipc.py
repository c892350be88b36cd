"""Messages between the appliance and a model worker process: one JSON object per line.

Pure encoding and decoding; the worker writes them on stdout and reads commands on stdin.
JSON has no tuples: what goes out as a tuple comes back as a list and is rebuilt here. A
delta without logprobs has no key for them: that message goes out once per token.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from appliance.serving.engine import Finished, GenerationRequest, TextDelta, TokenLogprob
from appliance.serving.sampling_options import Sampling


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError(f"not a message: {line[:200]!r}")  # noqa: TRY004 - a protocol error
    return message


def generate_message(request_id: str, request: GenerationRequest) -> dict[str, Any]:
    return {
        "type": "generate",
        "id": request_id,
        "prompt_tokens": list(request.prompt_tokens),
        "max_tokens": request.max_tokens,
        "sampling": asdict(request.sampling),
        "stop": list(request.stop),
        "grammar": request.grammar,
        "priority": request.priority,
        "logprobs": request.logprobs,
        "share_prompt": request.share_prompt,
    }


def request_from(message: dict[str, Any]) -> GenerationRequest:
    logprobs = message.get("logprobs")
    return GenerationRequest(
        prompt_tokens=tuple(int(t) for t in message["prompt_tokens"]),
        max_tokens=int(message["max_tokens"]),
        sampling=sampling_from(message["sampling"]),
        stop=tuple(message["stop"]),
        grammar=message["grammar"],
        priority=int(message.get("priority", 0)),
        logprobs=None if logprobs is None else int(logprobs),
        share_prompt=bool(message.get("share_prompt", False)),
    )


def sampling_from(fields: dict[str, Any]) -> Sampling:
    bias = fields.get("logit_bias", ())
    return Sampling(
        **{k: v for k, v in fields.items() if k != "logit_bias"},
        logit_bias=tuple((int(token), float(value)) for token, value in bias),
    )


def event_message(request_id: str, event: TextDelta | Finished) -> dict[str, Any]:
    if isinstance(event, TextDelta):
        message: dict[str, Any] = {"type": "delta", "id": request_id, "text": event.text}
        if event.logprobs:
            # [id, logprob, [[id, logprob], ...]] per token: compact, and no key names
            # repeated 21 times per token.
            message["logprobs"] = [[t.id, t.logprob, t.top] for t in event.logprobs]
        return message
    return {"type": "finished", "id": request_id, **asdict(event)}


def event_from(message: dict[str, Any]) -> TextDelta | Finished:
    if message["type"] == "delta":
        if "logprobs" not in message:
            return TextDelta(message["text"])
        return TextDelta(
            message["text"],
            tuple(
                TokenLogprob(
                    int(token),
                    float(logprob),
                    tuple((int(alt), float(value)) for alt, value in top),
                )
                for token, logprob, top in message["logprobs"]
            ),
        )
    fields = {k: v for k, v in message.items() if k not in {"type", "id"}}
    return Finished(**fields)
