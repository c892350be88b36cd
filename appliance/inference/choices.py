"""The choices of a completion as they are generated: each one's text, its tool calls and
its token logprobs, turned from the engine's events into OpenAI's deltas and final shapes.

A completion has `n` choices, each a sequence of its own in the engine. Each choice's
events pass through a :class:`ChoiceStream`, which renders logprobs with the model's
vocabulary (the engine sends token ids) and, when the request has tools, hands the text to
the tool-call parser so the client sees `tool_calls` deltas rather than the JSON the
grammar made the model write. No aiohttp here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from appliance.validation.tools import ToolCallDelta, ToolCallError, ToolStream

if TYPE_CHECKING:
    from appliance.serving.engine import Finished, TextDelta, TokenLogprob, Vocabulary


@dataclass
class ChoiceDelta:
    """What one event adds to a choice: content text, tool-call pieces, token logprobs."""

    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls or self.logprobs)


class ToolParser(Protocol):
    """Turns the model's constrained tool-call output into content and call deltas."""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]: ...

    def finish(self) -> tuple[str, list[dict[str, Any]]]: ...

    def calls(self) -> list[dict[str, Any]]: ...

    def problems(self) -> list[str]: ...


class ToolCalls:
    """A choice's output read as tool calls (appliance.validation.tools), as the deltas
    and final calls OpenAI's clients expect."""

    def __init__(self, stream: ToolStream) -> None:
        self._stream = stream
        self._problems: list[str] = []
        self._calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        try:
            return self._split(self._stream.feed(text))
        except ToolCallError as err:
            self._problems.append(str(err))
            return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        try:
            out = self._split(self._stream.finish())
        except ToolCallError as err:
            self._problems.append(str(err))
            return "", []
        result = self._stream.result()
        self._calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json},
            }
            for call in result.calls
        ]
        return out

    @staticmethod
    def _split(deltas: list[Any]) -> tuple[str, list[dict[str, Any]]]:
        content = "".join(d.text for d in deltas if not isinstance(d, ToolCallDelta))
        calls = [d.to_openai() for d in deltas if isinstance(d, ToolCallDelta)]
        return content, calls

    def calls(self) -> list[dict[str, Any]]:
        return self._calls

    def problems(self) -> list[str]:
        return self._problems


@dataclass
class Choice:
    """A choice as it ends: for the whole answer and the final chunk."""

    index: int
    content: str
    tool_calls: list[dict[str, Any]]
    logprobs: list[dict[str, Any]] | None
    finished: Finished

    @property
    def finish_reason(self) -> str:
        if self.tool_calls and self.finished.finish_reason == "stop":
            return "tool_calls"
        return "length" if self.finished.finish_reason == "length" else "stop"


class ChoiceStream:
    """One choice's events → its deltas; `finish` gives the :class:`Choice`."""

    def __init__(
        self,
        index: int,
        vocab: Vocabulary,
        *,
        logprobs: int | None,
        tools: ToolParser | None = None,
    ) -> None:
        self.index = index
        self._vocab = vocab
        self._top = logprobs
        self._tools = tools
        self._content: list[str] = []
        self._logprobs: list[dict[str, Any]] = []

    def feed(self, event: TextDelta) -> ChoiceDelta:
        delta = ChoiceDelta()
        if self._tools is not None:
            content, delta.tool_calls = self._tools.feed(event.text)
            delta.content = content or None
        else:
            delta.content = event.text or None
        if delta.content:
            self._content.append(delta.content)
        if self._top is not None and event.logprobs:
            delta.logprobs = [self._entry(token) for token in event.logprobs]
            self._logprobs += delta.logprobs
        return delta

    def finish(self, finished: Finished) -> tuple[ChoiceDelta, Choice]:
        delta = ChoiceDelta()
        if self._tools is not None:
            content, delta.tool_calls = self._tools.finish()
            delta.content = content or None
            if delta.content:
                self._content.append(delta.content)
        choice = Choice(
            index=self.index,
            content="".join(self._content),
            tool_calls=self._tools.calls() if self._tools is not None else [],
            logprobs=self._logprobs if self._top is not None else None,
            finished=finished,
        )
        return delta, choice

    def problems(self) -> list[str]:
        """Why its tool calls are not what the tools allow (empty when they are)."""
        return self._tools.problems() if self._tools is not None else []

    def _entry(self, token: TokenLogprob) -> dict[str, Any]:
        return {
            **self._piece(token.id, token.logprob),
            "top_logprobs": [self._piece(id_, lp) for id_, lp in token.top[: self._top]],
        }

    def _piece(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._vocab.piece(token)
        return {
            "token": raw.decode("utf-8", errors="replace"),
            # JSON has no -inf; OpenAI's floor for an impossible token is -9999.
            "logprob": logprob if math.isfinite(logprob) else -9999.0,
            "bytes": list(raw),
        }


def legacy_logprobs(entries: list[dict[str, Any]], start: int = 0) -> dict[str, Any]:
    """Chat-style logprob entries in the legacy completions shape (parallel lists)."""
    offsets: list[int] = []
    at = start
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }
