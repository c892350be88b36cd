"""HTTP/2 on the LAN API's TLS port, in the appliance's own process: ALPN chooses, per
connection, between ``h2`` and ``http/1.1`` on one port.

An http/1.1 connection is handed to aiohttp's own protocol, as if nothing stood in front.
An h2 connection is served with the ``h2`` library, and each of its streams is one request
to the same aiohttp application: a request handler of its own, fed the request as HTTP/1.1
bytes on a transport of that stream (so aiohttp's parser, its limits and the error shape
apply unchanged), and answering through a writer that sends the response as HEADERS and
DATA frames under HTTP/2 flow control. The client's address is the connection's: there is
no second hop, and nothing to trust. (An nginx front was measured against this; see
docs/api.md, "HTTP/2".)

Hostile clients: streams per connection are bounded (a reset stream keeps its place until
its handler has finished), header blocks are bounded, request bodies are bounded by
``server.max_body_bytes``, and a protocol error ends the connection with a GOAWAY, logged
in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import weakref
from typing import TYPE_CHECKING, Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.compression_utils import ZLibCompressor
from h2.errors import ErrorCodes
from hpack import NeverIndexedHeaderTuple
from hyperframe.frame import GoAwayFrame
from yarl import URL

from shared.errors import ErrorCode, error_body

if TYPE_CHECKING:
    import ssl
    from collections.abc import Callable

    from aiohttp.http_parser import RawRequestMessage
    from aiohttp.streams import StreamReader
    from aiohttp.web_protocol import RequestHandler
    from aiohttp.web_request import BaseRequest
    from multidict import CIMultiDict

log = logging.getLogger(__name__)

ALPN = ["h2", "http/1.1"]
# Decoded size of a request's header block. aiohttp's parser then bounds each line (8190
# bytes) and the number of headers (128) of the request it is given, as for HTTP/1.1.
MAX_HEADER_LIST_BYTES = 65_536
# Frames wait for the end of the loop's turn unless this many bytes are waiting.
_COALESCE_BYTES = 65_536
# An h2 connection without a stream is closed (GOAWAY) after this long.
IDLE_TIMEOUT_S = 300.0
# The rest of a body sent after its response is read (and dropped) this long, as aiohttp
# lingers on an HTTP/1.1 connection: clients that send the whole body before they read
# the response (httpx, curl) then get it. Then RST_STREAM.
LINGER_S = 10.0

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_PATH = re.compile(rb"[\x21-\x7e]+")
# Not passed on to aiohttp: `expect` would make it write an HTTP/1.1 interim response,
# `te` means something else in HTTP/1.1. (h2 itself refuses the connection-specific ones.)
_DROPPED = frozenset({b"expect", b"te"})
_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_VOLATILE = frozenset({"date", "x-request-id", "content-length", "etag", "last-modified"})
# Connection-specific response headers, which HTTP/2 forbids (RFC 9113, 8.2.2).
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}
)


def offer_alpn(context: ssl.SSLContext) -> None:
    """Offer h2 then http/1.1 on ``context``, and on every context its server-name
    callback switches a handshake to (`shared.tls.LiveContext`: OpenSSL takes the ALPN
    choice from the context a handshake ends up on, so a renewed one is offered it too)."""
    context.set_alpn_protocols(ALPN)
    inner = context.sni_callback
    if inner is None:
        return
    offered: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet([context])

    def switch(connection: ssl.SSLObject, name: str, outer: ssl.SSLContext) -> int | None:
        result = inner(connection, name, outer)
        current = connection.context
        if current not in offered:
            current.set_alpn_protocols(ALPN)
            offered.add(current)
        return result

    context.sni_callback = switch


class Http2Site(web.BaseSite):
    """The LAN API's TLS listener, offering h2 and http/1.1 (ALPN) on one port."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext,
        *,
        max_streams: int,
        max_body_bytes: int,
    ) -> None:
        offer_alpn(ssl_context)
        super().__init__(runner, ssl_context=ssl_context)
        self._host = host
        self._port = port
        self.max_streams = max_streams
        self.max_body_bytes = max_body_bytes
        self.connections: set[_Connection] = set()
        self._listener: asyncio.Server | None = None

    @property
    def name(self) -> str:
        return str(URL.build(scheme="https", host=self._host, port=self.port))

    @property
    def port(self) -> int:
        """The port listened on (with port 0, the one the system chose)."""
        if self._listener is not None and self._listener.sockets:
            return int(self._listener.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        _route_streams(server)
        self._server = self._listener = await asyncio.get_running_loop().create_server(
            lambda: _Negotiation(self, server),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
        )

    async def stop(self) -> None:
        await super().stop()
        # No new streams; those in flight finish (the runner waits for their handlers).
        for connection in list(self.connections):
            connection.go_away()


class _Negotiation(asyncio.Protocol):
    """Chooses a connection's protocol once its handshake is done, by what ALPN chose."""

    def __init__(self, site: Http2Site, server: web.Server) -> None:
        self._site = site
        self._server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        chosen = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        # Anything but h2 (http/1.1, or a client without ALPN): aiohttp's own protocol.
        protocol: asyncio.Protocol = (
            _Connection(self._site, self._server) if chosen == "h2" else self._server()
        )
        transport.set_protocol(protocol)
        protocol.connection_made(transport)


def _route_streams(server: web.Server) -> None:
    """aiohttp makes each request with the writer of its connection; a stream's request is
    made with the stream's writer instead (the transport says whose request it is)."""
    make = server.request_factory
    if getattr(make, "routes_streams", False):
        return

    def request_factory(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> BaseRequest:
        transport = protocol.transport
        if isinstance(transport, _StreamTransport):
            writer = transport.stream.begin(payload, task)
        return make(message, payload, protocol, writer, task)

    request_factory.routes_streams = True  # type: ignore[attr-defined]
    server.request_factory = request_factory


class _Connection(asyncio.Protocol):
    """One h2 connection: its frames in and out, its streams."""

    def __init__(self, site: Http2Site, server: web.Server) -> None:
        self.site = site
        self._server = server
        self._loop = asyncio.get_running_loop()
        # Outbound headers are aiohttp's, lower-cased and checked here (_StreamWriter):
        # h2's own checks of them were a fifth of the cost of a small response.
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.h2 = h2.connection.H2Connection(config=config)
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: site.max_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
            },
        )
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.streams: dict[int, _Stream] = {}
        # Streams whose handler still runs, reset or not: the bound on work per connection.
        self._busy = 0
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._out: list[bytes] = []  # framed, to be written (see flush)
        self._out_bytes = 0
        self._write_soon = False
        self._idle: asyncio.TimerHandle | None = None
        self._closing = False
        self._last_stream_id: int | None = None  # of a GOAWAY sent
        # Streams answered whose client still sends: their timers (see LINGER_S).
        self._lingering: dict[int, asyncio.TimerHandle] = {}

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.site.connections.add(self)
        self.h2.initiate_connection()
        self.flush()
        self._watch_idle()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as err:
            self._fail(err)
            return
        for event in events:
            self._dispatch(event)
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.site.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        for stream in list(self.streams.values()):
            stream.lose(ConnectionResetError("the HTTP/2 connection closed"))
        for timer in self._lingering.values():
            timer.cancel()
        self._lingering.clear()
        self._wake_drain()

    def pause_writing(self) -> None:
        # A client that does not read (its pings and settings answered all the same)
        # is read no more until it does: what waits to be sent stays bounded.
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None:
            self.transport.resume_reading()
        self._wake_drain()

    # -- frames

    def flush(self) -> None:
        """Send what h2 has framed, at the end of this turn of the loop: the frames of
        one turn (a response's HEADERS and DATA, several streams') go in one TLS write,
        which is most of the cost of a small response. Past 64 KiB, at once."""
        data = self.h2.data_to_send()
        if not data or self.transport is None:
            return
        self._out.append(data)
        self._out_bytes += len(data)
        if self._out_bytes >= _COALESCE_BYTES:
            self._write_out()
        elif not self._write_soon:
            self._write_soon = True
            self._loop.call_soon(self._write_out)

    def _write_out(self) -> None:
        self._write_soon = False
        if self._out and self.transport is not None:
            self.transport.write(b"".join(self._out) if len(self._out) > 1 else self._out[0])
        self._out.clear()
        self._out_bytes = 0

    async def drain(self) -> None:
        while self._paused and self.transport is not None:
            if self._drained is None:
                self._drained = self._loop.create_future()
            await self._drained
        if self.transport is None:
            raise ConnectionResetError("the HTTP/2 connection closed")

    def _wake_drain(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def _dispatch(self, event: h2.events.Event) -> None:
        handle = _EVENTS.get(type(event))
        if handle is not None:  # the others (pings, acknowledgements) need nothing of us
            handle(self, event)

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        self._request(event)

    def _on_data(self, event: h2.events.DataReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:  # answered already: dropped, but the window is the client's
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        else:
            stream.feed(event.data, event.flow_controlled_length)

    def _on_ended(self, event: h2.events.StreamEnded) -> None:
        self._stop_lingering(event.stream_id, reset=False)
        if (stream := self.streams.get(event.stream_id)) is not None:
            stream.end()

    def _on_reset(self, event: h2.events.StreamReset) -> None:
        self._stop_lingering(event.stream_id, reset=False)
        if (stream := self.streams.get(event.stream_id)) is not None:
            stream.lose(ConnectionResetError("the client reset the stream"))

    def _on_window(self, event: h2.events.WindowUpdated) -> None:
        if event.stream_id == 0:
            for each in self.streams.values():
                each.wake()
        elif (stream := self.streams.get(event.stream_id)) is not None:
            stream.wake()

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        del event
        self._closing = True
        if not self.streams:
            self._hang_up()

    def _on_settings(self, event: h2.events.RemoteSettingsChanged) -> None:
        table = event.changed_settings.get(h2.settings.SettingCodes.HEADER_TABLE_SIZE)
        if table is not None and table.new_value > 4096:
            # The client may allow a larger table for our responses' headers; a table
            # as large as it likes would be memory it chooses. The default is plenty.
            self.h2.encoder.header_table_size = 4096
        if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
            for stream in self.streams.values():
                stream.wake()

    def _fail(self, err: h2.exceptions.ProtocolError) -> None:
        """A protocol error: GOAWAY with its code, then close (the client's other
        connections are not affected)."""
        log.info("HTTP/2 protocol error from %s, closing: %s", self.peer, err)
        code = getattr(err, "error_code", None) or ErrorCodes.PROTOCOL_ERROR
        with contextlib.suppress(h2.exceptions.H2Error):
            self.h2.close_connection(error_code=code)
            self.flush()
        self._hang_up()

    def go_away(self) -> None:
        """Graceful close (shutdown): a GOAWAY tells the client to open no more streams;
        those open may finish; the connection closes when none is left. h2 itself would
        send no more frames after its GOAWAY, so this one is written by hand."""
        if self._closing or self.transport is None:
            return
        self._closing = True
        self._last_stream_id = self.h2.highest_inbound_stream_id
        self._write_out()
        self.transport.write(GoAwayFrame(0, last_stream_id=self._last_stream_id).serialize())
        if not self.streams:
            self._close()

    def _close(self) -> None:
        if self.transport is None:
            return
        with contextlib.suppress(h2.exceptions.H2Error):
            self.h2.close_connection(last_stream_id=self._last_stream_id)
            self.flush()
        self._hang_up()

    def _hang_up(self) -> None:
        """Close, after what waits to be written."""
        self._write_out()
        if self.transport is not None:
            self.transport.close()

    def _watch_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self._loop.call_later(IDLE_TIMEOUT_S, self._close_if_idle)

    def _close_if_idle(self) -> None:
        self._idle = None
        if not self.streams:
            self._close()

    # -- streams

    def _request(self, event: h2.events.RequestReceived) -> None:
        stream_id = event.stream_id
        if self._closing or self._busy >= self.site.max_streams:
            # Handlers of reset streams still running count too (a client resetting
            # streams as fast as it opens them would have no bound otherwise).
            self.h2.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
            return
        ended = event.stream_ended is not None
        head = _request_head(event.headers, body=not ended)
        if isinstance(head, str):
            self.respond_error(stream_id, ErrorCode.bad_request, head, ended=ended)
            return
        data, length = head
        if length is not None and length > self.site.max_body_bytes:
            self.respond_error(
                stream_id, ErrorCode.request_too_large, self.too_large_message, ended=ended
            )
            return
        stream = _Stream(self, stream_id, chunked=not ended and length is None)
        self.streams[stream_id] = stream
        self._busy += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        handler = self._server()
        stream.handler = handler
        handler.connection_made(_StreamTransport(stream, self.transport))
        handler.data_received(data)

    @property
    def too_large_message(self) -> str:
        return f"the body is larger than the limit of {self.site.max_body_bytes} bytes"

    def respond_error(self, stream_id: int, code: ErrorCode, message: str, *, ended: bool) -> None:
        """Answer a stream in the error shape from here (no handler runs)."""
        body = json.dumps(error_body(code, message)).encode()
        try:
            headers = [
                (b":status", str(code.status).encode()),
                (b"content-type", b"application/json; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ]
            if self.h2.local_flow_control_window(stream_id) >= len(body):
                self.h2.send_headers(stream_id, headers)
                self.h2.send_data(stream_id, body, end_stream=True)
            else:  # a window too small for the body: the status alone
                self.h2.send_headers(stream_id, headers[:1], end_stream=True)
        except h2.exceptions.StreamClosedError:
            return
        if not ended:
            self.linger(stream_id)

    def linger(self, stream_id: int) -> None:
        """A stream answered before its request's end: what more comes is dropped, for
        LINGER_S, then the client is told to stop (RST_STREAM NO_ERROR, RFC 9113, 8.1)."""
        self._lingering[stream_id] = self._loop.call_later(
            LINGER_S, self._stop_lingering, stream_id
        )

    def _stop_lingering(self, stream_id: int, *, reset: bool = True) -> None:
        timer = self._lingering.pop(stream_id, None)
        if timer is None:
            return
        timer.cancel()
        if reset:
            try:
                self.h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)
            except h2.exceptions.StreamClosedError:
                return
            self.flush()

    def stream_done(self, stream: _Stream) -> None:
        """A stream's handler has finished: its place is free."""
        self.streams.pop(stream.id, None)
        self._busy -= 1
        self.flush()
        if self.streams:
            return
        if self._closing:
            self._close()
        elif self.transport is not None:
            self._watch_idle()


_EVENTS: dict[type[h2.events.Event], Callable[[_Connection, Any], None]] = {
    h2.events.RequestReceived: _Connection._on_request,  # noqa: SLF001
    h2.events.DataReceived: _Connection._on_data,  # noqa: SLF001
    h2.events.StreamEnded: _Connection._on_ended,  # noqa: SLF001
    h2.events.StreamReset: _Connection._on_reset,  # noqa: SLF001
    h2.events.WindowUpdated: _Connection._on_window,  # noqa: SLF001
    h2.events.RemoteSettingsChanged: _Connection._on_settings,  # noqa: SLF001
    h2.events.ConnectionTerminated: _Connection._on_goaway,  # noqa: SLF001
}


class _Stream:
    """One request and its response on an h2 connection."""

    def __init__(self, connection: _Connection, stream_id: int, *, chunked: bool) -> None:
        self.connection = connection
        self.id = stream_id
        self.chunked = chunked  # the body goes to aiohttp in chunks (no content-length)
        self.handler: RequestHandler | None = None
        self.writer = _StreamWriter(self)
        self._payload: StreamReader | None = None
        self._received = 0
        self._ended = False  # the client's END_STREAM
        self.closed = False  # nothing more can be sent: the response ended, or a reset
        self.started = False  # the response's HEADERS are sent
        self.paused = False
        self._unacknowledged = 0
        self._window: asyncio.Future[None] | None = None
        self._lost = False
        self._task: asyncio.Task[None] | None = None

    def begin(self, payload: StreamReader, task: asyncio.Task[None]) -> _StreamWriter:
        """aiohttp makes this stream's request: its body and its handler's task."""
        self._payload = payload
        self._task = task
        return self.writer

    # -- the request's body, in

    def feed(self, data: bytes, flow_controlled: int) -> None:
        h2c = self.connection.h2
        limit = self.connection.site.max_body_bytes
        if self.closed or self._lost or self.handler is None or self._received > limit:
            # Past the limit nothing more is passed on: what aiohttp has is over it
            # already, and reading it answers 413, as over HTTP/1.1.
            h2c.acknowledge_received_data(flow_controlled, self.id)
            return
        self._received += len(data)
        if data:
            self.handler.data_received(
                b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data
            )
        if self.paused:
            self._unacknowledged += flow_controlled
        else:
            h2c.acknowledge_received_data(flow_controlled, self.id)

    def end(self) -> None:
        self._ended = True
        if self.chunked and not self.closed and self.handler is not None:
            self.handler.data_received(b"0\r\n\r\n")

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False
        if self._unacknowledged and not self._lost:
            self.connection.h2.acknowledge_received_data(self._unacknowledged, self.id)
            self._unacknowledged = 0
            self.connection.flush()

    # -- the response, out

    def send_headers(self, headers: list[tuple[bytes, bytes]], *, end: bool) -> None:
        self._check()
        try:
            self.connection.h2.send_headers(self.id, headers, end_stream=end)
        except h2.exceptions.StreamClosedError as err:
            self.closed = True
            raise ConnectionResetError("the HTTP/2 stream is closed") from err
        self.started = True
        self.connection.flush()
        if end:
            self._response_ended()

    async def send_data(self, data: bytes, *, end: bool) -> None:
        h2c = self.connection.h2
        view = memoryview(data)
        while True:
            self._check()
            try:
                size = min(len(view), h2c.local_flow_control_window(self.id))
                size = min(size, h2c.max_outbound_frame_size)
                if size <= 0 < len(view):
                    await self._wait_window()
                    continue
                last = size == len(view)
                chunk = data if last and size == len(data) else bytes(view[:size])
                h2c.send_data(self.id, chunk, end_stream=end and last)
            except h2.exceptions.StreamClosedError as err:
                self.closed = True
                raise ConnectionResetError("the HTTP/2 stream is closed") from err
            self.connection.flush()
            view = view[size:]
            if last:
                break
        if end:
            self._response_ended()
        await self.connection.drain()

    def _check(self) -> None:
        if self.closed or self._lost:
            raise ConnectionResetError("the HTTP/2 stream is closed")

    async def _wait_window(self) -> None:
        if self._window is None:
            self._window = asyncio.get_running_loop().create_future()
        await self._window

    def wake(self) -> None:
        if self._window is not None and not self._window.done():
            self._window.set_result(None)
        self._window = None

    def _response_ended(self) -> None:
        self.closed = True
        if not self._ended:
            # The response is complete before the request: the rest of the body is
            # dropped (Connection.linger), and aiohttp need not wait for it.
            self.connection.linger(self.id)
            if self._payload is not None:
                self._payload.feed_eof()

    def _reset(self, code: ErrorCodes) -> None:
        self.closed = True
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.connection.h2.reset_stream(self.id, code)
        self.connection.flush()

    # -- the end

    def lose(self, exc: Exception | None) -> None:
        """The stream is over for its handler (its response done, a reset, the connection
        gone): the handler loses its transport; the stream's place is kept until the
        handler's task has finished."""
        if self._lost:
            return
        self._lost = True
        if not self.closed:
            # The handler closed its transport without a complete response.
            self._reset(ErrorCodes.CANCEL if exc is not None else ErrorCodes.INTERNAL_ERROR)
        self.closed = True
        self.wake()
        if self.handler is not None:
            self.handler.connection_lost(exc)
        task = self._task
        if task is None or task.done():
            self.connection.stream_done(self)
        else:
            task.add_done_callback(lambda _: self.connection.stream_done(self))


class _StreamTransport(asyncio.Transport):
    """What a stream's aiohttp request handler sees as its connection: the client's
    address and TLS from the real one; reading is the stream's flow control."""

    def __init__(self, stream: _Stream, transport: asyncio.Transport | None) -> None:
        super().__init__()
        self.stream = stream
        self._transport = transport
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket" or self._transport is None:
            return default  # the socket is the connection's, not this stream's
        return self._transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._closing or self.stream.closed

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        asyncio.get_running_loop().call_soon(self.stream.lose, None)

    def abort(self) -> None:
        self.close()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        # Only the stream's writer answers; bytes written here would be HTTP/1.1.
        log.warning("HTTP/2 stream %d: %d bytes written past its writer", self.stream.id, len(data))
        self.stream.lose(ConnectionResetError("not an HTTP/2 response"))

    def pause_reading(self) -> None:
        self.stream.pause_reading()

    def resume_reading(self) -> None:
        self.stream.resume_reading()

    def is_reading(self) -> bool:
        return not self.stream.paused

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return False


class _StreamWriter(AbstractStreamWriter):
    """aiohttp's response writer for one stream: HEADERS, then DATA frames."""

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream
        self._headers: list[tuple[bytes, bytes]] | None = None
        self._compress: ZLibCompressor | None = None
        self._eof = False
        self.length: int | None = None

    def enable_chunking(self) -> None:
        """Nothing to do: HTTP/2 frames delimit the body."""

    def enable_compression(self, encoding: str = "deflate", strategy: int | None = None) -> None:
        self._compress = ZLibCompressor(encoding=encoding, strategy=strategy)

    async def write_headers(self, status_line: str, headers: CIMultiDict[str]) -> None:
        status = status_line.split(" ", 2)[1]
        block: list[tuple[bytes, bytes]] = [(b":status", status.encode())]
        for name, value in headers.items():
            lower = name.lower()
            if lower in _HOP_BY_HOP:
                continue
            if _UNSAFE.search(value) is not None or _UNSAFE.search(name) is not None:
                # What aiohttp's HTTP/1.1 writer refuses too.
                raise ValueError(f"a control character in the response header {name!r}")
            # Values that change with each response are not worth a place in the
            # client's table (HPACK): the table stays short, and so do its searches.
            block.append(
                NeverIndexedHeaderTuple(lower.encode(), value.encode())
                if lower in _VOLATILE
                else (lower.encode(), value.encode())
            )
        # Counted as sent: aiohttp reads a non-zero output_size as a response begun.
        self.output_size += len(status_line) + sum(len(k) + len(v) + 4 for k, v in block)
        self._headers = block

    def send_headers(self) -> None:
        if self._headers is not None:
            headers, self._headers = self._headers, None
            self._stream.send_headers(headers, end=False)

    async def write(self, chunk: bytes | bytearray | memoryview) -> None:
        data = bytes(chunk)
        if self._compress is not None:
            data = await self._compress.compress(data)
        data = self._clip(data)
        self.send_headers()
        if data:
            self.output_size += len(data)
            await self._stream.send_data(data, end=False)

    async def write_eof(self, chunk: bytes = b"") -> None:
        if self._eof:
            return
        self._eof = True
        data = chunk
        if self._compress is not None:
            data = (await self._compress.compress(chunk) if chunk else b"") + self._compress.flush()
        data = self._clip(data)
        self.output_size += len(data)
        if self._headers is not None and not data:
            headers, self._headers = self._headers, None
            self._stream.send_headers(headers, end=True)
            return
        self.send_headers()
        await self._stream.send_data(data, end=True)

    def _clip(self, data: bytes) -> bytes:
        """No more than a declared Content-Length (as aiohttp's own writer does)."""
        if self.length is None:
            return data
        data = data[: self.length]
        self.length -= len(data)
        return data

    async def drain(self) -> None:
        await self._stream.connection.drain()


def _request_head(
    headers: list[tuple[bytes, bytes]], *, body: bool
) -> tuple[bytes, int | None] | str:
    """An h2 request's headers as an HTTP/1.1 request head and its Content-Length, or why
    they cannot be one. h2 has checked the pseudo-headers and refused control characters
    in names and values; aiohttp's parser checks the rest."""
    pseudo: dict[bytes, bytes] = {}
    lines: list[bytes] = []
    cookies: list[bytes] = []
    host = False
    lengths: list[bytes] = []
    for name, value in headers:
        if name.startswith(b":"):
            pseudo[name] = value
        elif name == b"cookie":  # h2 may split cookies; HTTP/1.1 has one header
            cookies.append(value)
        elif name not in _DROPPED:
            host = host or name == b"host"
            if name == b"content-length":
                lengths.append(value)
            lines.append(b"%s: %s\r\n" % (name, value))
    method, path = pseudo.get(b":method", b""), pseudo.get(b":path", b"")
    if not _TOKEN.fullmatch(method) or method == b"CONNECT":
        return f"the method {method.decode('latin-1')!r} is not served"
    if not _PATH.fullmatch(path):
        return "a bad :path"
    if len(lengths) > 1 or not all(value.isdigit() for value in lengths):
        return "a bad content-length"
    authority = pseudo.get(b":authority")
    if not host and authority:
        lines.append(b"host: %s\r\n" % authority)
    if cookies:
        lines.append(b"cookie: %s\r\n" % b"; ".join(cookies))
    if body and not lengths:
        lines.append(b"transfer-encoding: chunked\r\n")
    # One request per handler: it closes its transport (the stream) when it has answered.
    lines.append(b"connection: close\r\n\r\n")
    head = b"%s %s HTTP/1.1\r\n%s" % (method, path, b"".join(lines))
    return head, int(lengths[0]) if lengths else None
