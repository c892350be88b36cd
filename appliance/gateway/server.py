"""Serving the app: an aiohttp runner whose protocol-level errors use the one error shape.

aiohttp answers requests its HTTP parser refuses (a bad method, an oversized header, bad
chunking, a Content-Encoding it cannot decode) with `text/plain` before any middleware
runs. The handler here answers them in the API's error shape instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from appliance.fleet.identity import lan_tls_files
from appliance.gateway.appkeys import SETTINGS
from appliance.gateway.front import UPSTREAM_LIMITS, Front, nginx_binary, trust_forwarded
from appliance.packages.cache import blob_dir
from shared.errors import ErrorCode, error_body

if TYPE_CHECKING:
    import ssl
    from collections.abc import Callable

    from aiohttp.web_request import BaseRequest


log = logging.getLogger(__name__)


class _Handler(RequestHandler):
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("error answering %s", request.remote, exc_info=exc)
        else:
            # The peer's fault, not ours: no traceback, and below the operator's level (a
            # client that speaks TLS to the plain port, or a hostile one, would fill the log).
            log.debug("refused a malformed request from %s: %s", request.remote, exc or message)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        if status == 413:
            code = ErrorCode.request_too_large
        elif status < 500:
            code = ErrorCode.bad_request
        else:
            code = ErrorCode.internal_error
        text = (message or "").strip().splitlines()[0] if message else code.summary
        response = web.json_response(error_body(code, text), status=code.status)
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class ApplianceRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Same object and state; only the connection handler class differs (see _Handler).
        server.__class__ = _Server
        return server


class ListenerRunner(web.BaseRunner):
    """Serves an application that another runner started (and cleans up): a second
    listener of the same application, with TLS of its own."""

    def __init__(self, app: web.Application) -> None:
        super().__init__(handle_signals=False)
        self._app = app

    async def shutdown(self) -> None:
        return None

    async def _make_server(self) -> web.Server:
        # aiohttp makes a Server for an application with `_make_handler`; the
        # application is started already, by its own runner.
        server = self._app._make_handler(loop=asyncio.get_running_loop(), access_log=None)  # noqa: SLF001
        server.__class__ = _Server
        return server

    async def _cleanup_server(self) -> None:
        return None


class FleetListener:
    """The fleet listener: the appliance's application on a second address (its overlay
    address, through the tunnel), over mutual TLS only: a handshake without a client
    certificate of the fleet fails. The hub's calls (offload) come here."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._runner = ListenerRunner(app)
        self._host = host
        self._port = port
        self.port: int | None = None

    async def start(self, context: ssl.SSLContext) -> int:
        """Listen; the port listened on (``port`` 0: a free one)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, ssl_context=context)
        await site.start()
        addresses = self._runner.addresses  # with port 0, the one the system chose
        self.port = int(addresses[0][1]) if addresses else self._port
        return self.port

    async def stop(self) -> None:
        await self._runner.cleanup()


def _front(app: web.Application, host: str, port: int, tls: bool) -> Front | None:
    """nginx in front (front.py), with TLS and `server.http2`; None: aiohttp serves the
    port itself (HTTP/1.1)."""
    settings = app[SETTINGS]
    files = lan_tls_files(settings)
    if not tls or not settings.server.http2 or files is None:
        return None
    binary = nginx_binary()
    if binary is None:
        log.warning(
            "HTTP/2 is served by nginx, which is not installed (Debian's nginx package): "
            "HTTP/1.1 only; server.http2: false says so without this warning"
        )
        return None
    return Front(
        binary,
        host=host,
        port=port,
        certificate=files,
        max_streams=settings.server.http2_max_streams,
        max_body_bytes=settings.server.max_body_bytes,
        blobs=blob_dir(settings.packages_dir),
        data_dir=settings.data_dir,
    )


def run(
    app: web.Application,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    on_started: Callable[[], None],
) -> None:
    """Serve until SIGINT or SIGTERM, then shut down cleanly (cleanup contexts run).
    With TLS and `server.http2`, nginx serves the port (HTTP/2 and HTTP/1.1) in front of
    the app (front.py)."""

    async def main() -> None:
        front = _front(app, host, port, ssl_context is not None)
        if front is None:
            runner = ApplianceRunner(app, access_log=None)
        else:
            runner = ApplianceRunner(app, access_log=None, **UPSTREAM_LIMITS)
        await runner.setup()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            if front is None:
                await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
            elif runner.server is not None:  # set up above
                trust_forwarded(runner.server, front)
                await web.UnixSite(runner, str(front.upstream)).start()
                await front.start()
            on_started()
            await stop.wait()
        finally:
            if front is not None:
                await front.stop()  # first: what it has in flight still reaches the app
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
