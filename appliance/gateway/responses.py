"""`/v1/responses`: OpenAI's Responses API, whole or as its typed stream of events."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from appliance.gateway import sse
from appliance.gateway.appkeys import SETTINGS, api_key
from appliance.gateway.parsing import read_json
from appliance.inference.completions import Sink, invalid_output
from appliance.inference.responses_api import (
    ResponsesRequest,
    ResponsesService,
    function_item,
    message_item,
    output_items,
    parse_request,
    response_object,
    status_of,
    text_part,
)
from shared.errors import DomainError

if TYPE_CHECKING:
    from appliance.inference.choices import ChoiceDelta
    from appliance.inference.completions import Prepared
    from appliance.serving.engine import Event

log = logging.getLogger(__name__)

RESPONSES = web.AppKey("responses", ResponsesService)
IGNORED_HEADER = "Kvl-Ignored-Parameters"


async def create(request: web.Request) -> web.StreamResponse:
    strict = request.app[SETTINGS].server.strict_parameters
    req, ignored = parse_request(await read_json(request), strict=strict)
    service = request.app[RESPONSES]
    key = api_key(request)
    response_id, prepared, messages = await service.prepare(req, key, strict=strict)
    headers = {"X-Kvl-Model": prepared.model}
    if ignored or prepared.ignored:
        headers[IGNORED_HEADER] = ", ".join(sorted({*ignored, *prepared.ignored}))
    if req.stream:
        events = _Events(request, req, response_id, prepared, headers)
        return await _stream(request, service, events, messages)
    completed = await service.complete(prepared)
    if completed.problems:
        raise invalid_output(completed)
    choice = completed.choices[0]
    body = response_object(
        response_id,
        req,
        prepared,
        status=status_of(completed),
        output=output_items(response_id, choice),
        completed=completed,
    )
    if req.store:
        await service.keep(response_id, key, body, messages, choice)
    return web.json_response(body, headers=headers)


async def retrieve(request: web.Request) -> web.Response:
    body = await request.app[RESPONSES].get(request.match_info["id"], api_key(request))
    return web.json_response(body)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    await request.app[RESPONSES].delete(response_id, api_key(request))
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


class _Events(Sink):
    """The Responses stream: `response.created`, then the output items as they grow
    (a message's text deltas, each call's argument deltas), then `response.completed`."""

    stream_span = True
    record_when_gone = True

    def __init__(
        self,
        request: web.Request,
        req: ResponsesRequest,
        response_id: str,
        prepared: Prepared,
        headers: dict[str, str],
    ) -> None:
        self.request = request
        self.req = req
        self.id = response_id
        self.prepared = prepared
        self._headers = headers
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # the output so far, in order
        self._message: int | None = None  # the message item's output index
        self._calls: dict[int, int] = {}  # a tool call's index → its item's output index
        self.response: web.StreamResponse | None = None

    async def first(self, event: Event) -> None:
        self.response = await sse.open_stream(self.request, self._headers)
        body = self._object("in_progress")
        await self.send("response.created", {"response": body})
        await self.send("response.in_progress", {"response": body})

    async def delta(self, index: int, delta: ChoiceDelta) -> None:
        if index != 0:
            return
        if delta.content:
            at = await self._open_message()
            part = self._items[at]["content"][0]
            part["text"] += delta.content
            await self.send(
                "response.output_text.delta",
                {
                    "item_id": self._items[at]["id"],
                    "output_index": at,
                    "content_index": 0,
                    "delta": delta.content,
                    "logprobs": delta.logprobs,
                },
            )
        for piece in delta.tool_calls:
            await self._call_piece(piece)

    async def _open_message(self) -> int:
        if self._message is None:
            self._message = len(self._items)
            item = message_item(self.id, None, "in_progress")
            self._items.append(item)
            await self.send(
                "response.output_item.added", {"output_index": self._message, "item": item}
            )
            item["content"].append(text_part(""))
            await self.send(
                "response.content_part.added",
                {
                    "item_id": item["id"],
                    "output_index": self._message,
                    "content_index": 0,
                    "part": text_part(""),
                },
            )
        return self._message

    async def _call_piece(self, piece: dict[str, Any]) -> None:
        index = piece["index"]
        function = piece.get("function", {})
        if index not in self._calls:
            at = len(self._items)
            self._calls[index] = at
            item = function_item(
                piece.get("id", f"call_{index}"), function.get("name", ""), "", "in_progress"
            )
            self._items.append(item)
            await self.send("response.output_item.added", {"output_index": at, "item": dict(item)})
        at = self._calls[index]
        if fragment := function.get("arguments"):
            self._items[at]["arguments"] += fragment
            await self.send(
                "response.function_call_arguments.delta",
                {"item_id": self._items[at]["id"], "output_index": at, "delta": fragment},
            )

    async def finish(self, final: list[dict[str, Any]], body: dict[str, Any]) -> None:
        """Close the items (the final ones replace what the deltas built) and end."""
        for at, item in enumerate(final):
            if item["type"] == "message" and item["content"]:
                part = item["content"][0]
                common = {"item_id": item["id"], "output_index": at, "content_index": 0}
                await self.send("response.output_text.done", {**common, "text": part["text"]})
                await self.send("response.content_part.done", {**common, "part": part})
            elif item["type"] == "function_call":
                await self.send(
                    "response.function_call_arguments.done",
                    {"item_id": item["id"], "output_index": at, "arguments": item["arguments"]},
                )
            await self.send("response.output_item.done", {"output_index": at, "item": item})
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        await self.send(kind, {"response": body})

    def _object(self, status: str) -> dict[str, Any]:
        return response_object(self.id, self.req, self.prepared, status=status, output=[])

    async def send(self, kind: str, data: dict[str, Any]) -> None:
        if self.response is None:
            return
        payload = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        line = json.dumps(payload, ensure_ascii=False).encode()
        await self.response.write(b"event: " + kind.encode() + b"\ndata: " + line + b"\n\n")

    async def error(self, err: DomainError) -> None:
        await self.send(
            "error",
            {"code": err.code.value, "message": err.message, "param": err.param},
        )


async def _stream(
    request: web.Request,
    service: ResponsesService,
    events: _Events,
    messages: list[dict[str, Any]],
) -> web.StreamResponse:
    req, response_id, prepared = events.req, events.id, events.prepared
    try:
        completed = await service.complete(prepared, events)
    except DomainError as err:
        if events.response is None:
            raise  # before the stream began: a status code of its own
        with contextlib.suppress(ConnectionResetError):
            await events.error(err)
            await events.response.write_eof()
        return events.response
    except ConnectionResetError:
        if events.response is None:
            raise
        log.info("client closed the stream of %s", response_id)
        return events.response
    response = events.response
    if response is None:  # pragma: no cover - the first event opens it
        raise AssertionError("a completed stream has begun")
    if completed.problems:
        await events.error(invalid_output(completed))
    else:
        choice = completed.choices[0]
        final = output_items(response_id, choice)
        body = response_object(
            response_id,
            req,
            prepared,
            status=status_of(completed),
            output=final,
            completed=completed,
        )
        if req.store:
            await service.keep(response_id, api_key(request), body, messages, choice)
        await events.finish(final, body)
    await response.write_eof()
    return response
