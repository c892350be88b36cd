"""Token streaming over a WebSocket (IF-2): many requests on one connection.

Client frames (JSON text):
    {"type": "chat.completions" | "completions", "id": "<your id>", "body": {OpenAI body}}
    {"type": "cancel", "id": "<your id>"}
Server frames, each naming the request:
    {"id": ..., "event": "chunk", "data": {OpenAI stream chunk}}
    {"id": ..., "event": "done", "usage": {...}}          after the last chunk
    {"id": ..., "event": "cancelled", "usage": {...}}     after a cancel
    {"id": ..., "event": "error", "error": {the error shape}}
A frame that cannot be understood gets an error event with its id (or null); the
connection stays open. The server closes with 1001 when it shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from aiohttp import WSMsgType, web

from appliance.gateway.completions import Prepared, chunk_body, invalid_output, usage
from appliance.gateway.keys import COMPLETIONS, SETTINGS, api_key
from appliance.gateway.middleware import route_label
from appliance.gateway.parsing import parse_body
from appliance.gateway.schemas import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
)
from appliance.serving.engine import Finished, TextDelta
from shared.errors import ApiError, ErrorCode

log = logging.getLogger(__name__)

# Usage status of a request cancelled by its client (nginx's "client closed request").
CANCELLED = 499


class _FrameError(Exception):
    def __init__(self, request_id: object, error: ApiError) -> None:
        super().__init__(error.message)
        self.request_id = request_id
        self.error = error


_KINDS = ("chat.completions", "completions", "cancel")


def _parse_frame(text: str) -> tuple[str, str, dict[str, Any]]:
    """(id, type, body) of a client frame; body is empty for a cancel."""
    try:
        frame = json.loads(text)
    except json.JSONDecodeError as err:
        raise _FrameError(
            None, ApiError(ErrorCode.invalid_json, f"the frame is not JSON: {err}")
        ) from err
    if not isinstance(frame, dict):
        raise _FrameError(None, ApiError(ErrorCode.invalid_json, "a frame must be a JSON object"))
    request_id, kind, body = frame.get("id"), frame.get("type"), frame.get("body")
    if not isinstance(request_id, str) or not request_id:
        raise _FrameError(
            request_id,
            ApiError(ErrorCode.missing_parameter, "every frame needs a string `id`", param="id"),
        )
    if kind not in _KINDS:
        raise _FrameError(
            request_id,
            ApiError(
                ErrorCode.invalid_parameter,
                f"`type` must be one of {', '.join(_KINDS)}",
                param="type",
            ),
        )
    if kind == "cancel":
        return request_id, kind, {}
    if not isinstance(body, dict):
        raise _FrameError(
            request_id, ApiError(ErrorCode.invalid_json, "`body` must be an object", param="body")
        )
    return request_id, str(kind), body


class _Connection:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request = request
        self.ws = ws
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.cancels: dict[str, asyncio.Event] = {}

    async def send(self, frame: dict[str, Any]) -> None:
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await self.ws.send_str(json.dumps(frame, ensure_ascii=False))

    async def error(self, request_id: object, err: ApiError) -> None:
        await self.send({"id": request_id, "event": "error", **err.body()})

    async def handle(self, text: str) -> None:
        try:
            request_id, kind, body = _parse_frame(text)
        except _FrameError as err:
            await self.error(err.request_id, err.error)
            return
        if kind != "cancel" and request_id in self.tasks:
            await self.error(
                request_id,
                ApiError(ErrorCode.invalid_parameter, "this `id` is already running", param="id"),
            )
            return
        if kind == "cancel":
            if (event := self.cancels.get(request_id)) is not None:
                event.set()
            return
        self.cancels[request_id] = asyncio.Event()
        task = asyncio.create_task(self._run(request_id, kind, body))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self._forget(request_id))

    def _forget(self, request_id: str) -> None:
        self.tasks.pop(request_id, None)
        self.cancels.pop(request_id, None)

    async def _run(self, request_id: str, kind: str, body: dict[str, Any]) -> None:
        service = self.request.app[COMPLETIONS]
        key, route = api_key(self.request), route_label(self.request)
        try:
            prepared: Prepared
            if kind == "chat.completions":
                req = parse_body(ChatCompletionRequest, body, UNSUPPORTED_CHAT)
                prepared = await service.prepare_chat(req, key, route)
            else:
                text_req = parse_body(CompletionRequest, body, UNSUPPORTED_COMPLETION)
                prepared = await service.prepare_text(text_req, key, route)
            await self._stream(request_id, prepared)
        except ApiError as err:
            await self.error(request_id, err)

    async def _stream(self, request_id: str, prepared: Prepared) -> None:
        service = self.request.app[COMPLETIONS]
        cancel = self.cancels[request_id]
        async with contextlib.aclosing(service.start(prepared)) as generation:
            if prepared.kind == "chat":
                await self._chunk(request_id, chunk_body(prepared, role=True))
            watcher = asyncio.create_task(cancel.wait())
            try:
                async for event in generation:
                    if isinstance(event, TextDelta):
                        await self._chunk(request_id, chunk_body(prepared, text=event.text))
                        if watcher.done():
                            generation.cancel()
                        continue
                    await self._finish(request_id, prepared, event)
            finally:
                watcher.cancel()

    async def _finish(self, request_id: str, prepared: Prepared, finished: Finished) -> None:
        service = self.request.app[COMPLETIONS]
        if finished.finish_reason == "cancelled":
            await service.record(prepared, finished, CANCELLED)
            await self.send({"id": request_id, "event": "cancelled", "usage": usage(finished)})
            return
        problems = service.problems(prepared, finished)
        await service.record(prepared, finished, 422 if problems else 200)
        if problems:
            await self.error(request_id, invalid_output(problems))
            return
        await self._chunk(request_id, chunk_body(prepared, finished=finished))
        await self.send({"id": request_id, "event": "done", "usage": usage(finished)})

    async def _chunk(self, request_id: str, data: dict[str, Any]) -> None:
        await self.send({"id": request_id, "event": "chunk", "data": data})

    async def close(self) -> None:
        for event in self.cancels.values():
            event.set()
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream(request: web.Request) -> web.StreamResponse:
    ws = web.WebSocketResponse(
        heartbeat=30.0, max_msg_size=request.app[SETTINGS].server.max_body_bytes
    )
    if not ws.can_prepare(request).ok:
        raise ApiError(
            ErrorCode.bad_request,
            "this route speaks WebSocket: send an `Upgrade: websocket` request",
        )
    await ws.prepare(request)
    connection = _Connection(request, ws)
    try:
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await connection.handle(message.data)
            elif message.type == WSMsgType.BINARY:
                await connection.error(
                    None, ApiError(ErrorCode.invalid_json, "send JSON in text frames, not binary")
                )
    finally:
        await connection.close()
    return ws
