"""Messages between the appliance and a model worker process: one JSON object per line.

Pure encoding and decoding; the worker writes them on stdout and reads commands on stdin.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from appliance.serving.engine import Finished, GenerationRequest, TextDelta
from appliance.serving.sampling import Sampling


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
    }


def request_from(message: dict[str, Any]) -> GenerationRequest:
    return GenerationRequest(
        prompt_tokens=tuple(int(t) for t in message["prompt_tokens"]),
        max_tokens=int(message["max_tokens"]),
        sampling=Sampling(**message["sampling"]),
        stop=tuple(message["stop"]),
        grammar=message["grammar"],
        priority=int(message.get("priority", 0)),
    )


def event_message(request_id: str, event: TextDelta | Finished) -> dict[str, Any]:
    if isinstance(event, TextDelta):
        return {"type": "delta", "id": request_id, "text": event.text}
    return {"type": "finished", "id": request_id, **asdict(event)}


def event_from(message: dict[str, Any]) -> TextDelta | Finished:
    if message["type"] == "delta":
        return TextDelta(message["text"])
    fields = {k: v for k, v in message.items() if k not in {"type", "id"}}
    return Finished(**fields)
