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
connection stays open. The server closes with 1001 when it shuts down, and with 1008
(policy violation) within a second of the connection's API key being revoked, after a last
`{"id": null, "event": "error", "error": {revoked_api_key}}` frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import WSCloseCode, WSMsgType, web

from appliance.gateway.appkeys import COMPLETIONS, SETTINGS, STORE, api_key
from appliance.gateway.errors import error_data
from appliance.gateway.middleware import route_label
from appliance.inference.bodies import chunk_body, usage
from appliance.inference.completions import Completed, Generation, Prepared, Sink, invalid_output
from appliance.inference.schemas import completion_request
from shared import jsonlimits
from shared.errors import ApiError, DomainError, ErrorCode

if TYPE_CHECKING:
    from appliance.inference.choices import ChoiceDelta

log = logging.getLogger(__name__)

# How often an open connection looks at its API key again. A connection outlives any one
# request, so the check at the upgrade is not enough: a revoked key must stop its streams.
# Cheap while nothing changed: the store answers from memory until the database moves.
KEY_CHECK_S = 0.25


class _FrameError(Exception):
    def __init__(self, request_id: object, error: ApiError) -> None:
        super().__init__(error.message)
        self.request_id = request_id
        self.error = error


_KINDS = ("chat.completions", "completions", "cancel")


def _parse_frame(text: str) -> tuple[str, str, dict[str, Any]]:
    """(id, type, body) of a client frame; body is empty for a cancel."""
    try:
        frame = jsonlimits.loads(text)  # standard JSON, nesting bounded, as every body
    except ValueError as err:
        raise _FrameError(
            None, ApiError(ErrorCode.invalid_json, f"the frame is not JSON: {err}")
        ) from err
    if not isinstance(frame, dict):
        raise _FrameError(None, ApiError(ErrorCode.invalid_json, "a frame must be a JSON object"))
    request_id, kind, body = frame.get("id"), frame.get("type"), frame.get("body")
    if not isinstance(request_id, str) or not request_id:
        raise _FrameError(
            request_id,
            ApiError(
                ErrorCode.missing_required_parameter, "every frame needs a string `id`", param="id"
            ),
        )
    if kind not in _KINDS:
        raise _FrameError(
            request_id,
            ApiError(
                ErrorCode.invalid_value,
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
        self.ending = False  # the server is closing it (the key was revoked)

    async def send(self, frame: dict[str, Any]) -> None:
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await self.ws.send_str(json.dumps(frame, ensure_ascii=False))

    async def error(self, request_id: object, err: DomainError) -> None:
        await self.send({"id": request_id, "event": "error", **error_data(err)})

    async def handle(self, text: str) -> None:
        try:
            request_id, kind, body = _parse_frame(text)
        except _FrameError as err:
            await self.error(err.request_id, err.error)
            return
        if kind != "cancel" and request_id in self.tasks:
            await self.error(
                request_id,
                ApiError(ErrorCode.invalid_value, "this `id` is already running", param="id"),
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
            req = completion_request(body, chat=kind == "chat.completions")
            prepared = await service.prepare(req, key, route)
            frames = _Frames(self, request_id, prepared)
            try:
                completed = await service.complete(prepared, frames)
            finally:
                frames.close()
        except DomainError as err:
            await self.error(request_id, err)
            return
        await self._finish(request_id, completed)

    async def _finish(self, request_id: str, completed: Completed) -> None:
        finished = completed.finished
        if completed.cancelled:
            await self.send({"id": request_id, "event": "cancelled", "usage": usage(finished)})
            return
        if completed.problems:
            await self.error(request_id, invalid_output(completed))
            return
        for choice in completed.choices:
            last = choice is completed.choices[-1]
            data = chunk_body(
                completed.prepared, choice=choice, finished=finished if last else None
            )
            await self.chunk(request_id, data)
        await self.send({"id": request_id, "event": "done", "usage": usage(finished)})

    async def chunk(self, request_id: str, data: dict[str, Any]) -> None:
        await self.send({"id": request_id, "event": "chunk", "data": data})

    async def close(self) -> None:
        for event in self.cancels.values():
            event.set()
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def end(self, error: ApiError) -> None:
        """Stop every request, say why in a last frame, and close as a policy violation."""
        self.ending = True
        await self.close()
        await self.error(None, error)
        await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=error.code.value.encode())

    async def watch_key(self) -> None:
        """End the connection once its key is revoked (or gone), while it is open."""
        store = self.request.app[STORE]
        # The middleware authenticated this very header at the upgrade.
        token = self.request.headers.get("Authorization", "").partition(" ")[2].strip()
        while True:
            await asyncio.sleep(KEY_CHECK_S)
            try:
                key = await store.authenticate(token)
            except Exception:
                # The database failed us for a moment: the key stands until it answers.
                log.exception("could not check the API key of a WebSocket again")
                continue
            if key is None:
                error = ApiError(ErrorCode.invalid_api_key, "the API key is no longer valid")
                break
            if key.revoked:
                error = ApiError(ErrorCode.revoked_api_key, f"the API key {key.prefix} was revoked")
                break
        log.info("closing a WebSocket: %s", error.message)
        await self.end(error)


class _Frames(Sink):
    """One request's events as chunk frames; its cancel frame stops the generation at its
    next token."""

    def __init__(self, connection: _Connection, request_id: str, prepared: Prepared) -> None:
        self._connection = connection
        self._id = request_id
        self._prepared = prepared
        self._generation: Generation | None = None
        self._watcher: asyncio.Task[Literal[True]] | None = None

    async def started(self, generation: Generation) -> None:
        self._generation = generation
        if self._prepared.kind == "chat":
            for index in range(self._prepared.n):
                data = chunk_body(self._prepared, index=index, role=True)
                await self._connection.chunk(self._id, data)
        self._watcher = asyncio.create_task(self._connection.cancels[self._id].wait())

    async def delta(self, index: int, delta: ChoiceDelta) -> None:
        data = chunk_body(self._prepared, index=index, delta=delta)
        await self._connection.chunk(self._id, data)
        if self._watcher is not None and self._watcher.done() and self._generation is not None:
            self._generation.cancel()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


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
    watcher = asyncio.create_task(connection.watch_key(), name="kvl-ws-key")
    try:
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await connection.handle(message.data)
            elif message.type == WSMsgType.BINARY:
                await connection.error(
                    None, ApiError(ErrorCode.invalid_json, "send JSON in text frames, not binary")
                )
    finally:
        # A watcher that is closing the connection finishes its close handshake; otherwise
        # the client left (or the server stops) and the watcher has nothing left to do.
        if not connection.ending:
            watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await connection.close()
    return ws
