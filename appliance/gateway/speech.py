"""`POST /v1/audio/speech`: parse, hand it to the speech service, send the audio as it is
read (chunked), or as OpenAI's server-sent events with `stream_format: "sse"`."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from appliance.gateway import sse
from appliance.gateway.appkeys import REQUEST_ID, api_key
from appliance.gateway.errors import error_data
from appliance.gateway.middleware import route_label
from appliance.gateway.parsing import read_json
from appliance.inference.speech import SpeechService, speech_request
from shared.errors import DomainError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from appliance.inference.speech import Speech

log = logging.getLogger(__name__)
SPEECH = web.AppKey("speech", SpeechService)


async def create_speech(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req = speech_request(body)
    speech = await request.app[SPEECH].prepare(req, api_key(request), route_label(request))
    chunks = speech.audio()
    gone = False
    try:
        response, gone = await _respond(request, speech, chunks)
    except asyncio.CancelledError:
        gone = True  # the client went away (a server that cancels its handlers then)
        raise
    finally:
        await chunks.aclose()
        await speech.close(gone=gone)
    return response


async def _respond(
    request: web.Request, speech: Speech, chunks: AsyncIterator[bytes]
) -> tuple[web.StreamResponse, bool]:
    """The response, and whether the client went away before its end."""
    # The first piece is read before anything is sent: a failure there is a status.
    first = await anext(chunks)
    headers = {
        "X-Request-Id": request[REQUEST_ID],
        "X-Kvl-Model": speech.reader.ref,
        "X-Kvl-Voice": speech.reader.voice,
        "X-Kvl-Sample-Rate": str(speech.sample_rate),
    }
    if speech.req.stream_format == "sse":
        return await _events(request, speech, first, chunks, headers)
    if not speech.format.streams:  # made whole (flac): its length is known
        rest = [data async for data in chunks]
        whole = b"".join([first, *rest])
        return web.Response(body=whole, content_type=speech.format.mime, headers=headers), False
    return await _stream(request, speech, first, chunks, headers)


async def _stream(
    request: web.Request,
    speech: Speech,
    first: bytes,
    chunks: AsyncIterator[bytes],
    headers: dict[str, str],
) -> tuple[web.StreamResponse, bool]:
    """The audio with chunked transfer, each piece as it is read; and whether the client
    went away before the end."""
    response = web.StreamResponse(headers={"Content-Type": speech.format.mime, **headers})
    response.enable_chunked_encoding()
    await response.prepare(request)
    try:
        await response.write(first)
        async for data in chunks:
            await response.write(data)
    except DomainError as err:
        # The status is sent: the stream is cut without its last chunk, so the client
        # sees an incomplete body rather than a shorter, complete-looking file.
        log.error("speech %s failed mid-stream: %s", speech.id, err.message)  # noqa: TRY400
        if request.transport is not None:
            request.transport.abort()
        return response, False
    except ConnectionResetError:
        log.info("client closed the speech stream %s", speech.id)
        return response, True
    await response.write_eof()
    return response, False


async def _events(
    request: web.Request,
    speech: Speech,
    first: bytes,
    chunks: AsyncIterator[bytes],
    headers: dict[str, str],
) -> tuple[web.StreamResponse, bool]:
    """OpenAI's speech events: `speech.audio.delta` with base64 audio, then
    `speech.audio.done` with the usage (or the error shape, if a voice failed)."""
    response = await sse.open_stream(request, headers)

    async def delta(data: bytes) -> None:
        if data:
            await sse.send(
                response, {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
            )

    try:
        await delta(first)
        async for data in chunks:
            await delta(data)
        n = speech.characters
        usage = {"input_tokens": n, "output_tokens": 0, "total_tokens": n}
        await sse.send(response, {"type": "speech.audio.done", "usage": usage})
    except DomainError as err:
        await sse.send(response, error_data(err))
    except ConnectionResetError:
        log.info("client closed the speech stream %s", speech.id)
        return response, True
    await response.write_eof()
    return response, False
