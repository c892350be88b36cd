"""The gRPC API, `kovenlab.edge.v1.Inference` on grpc.aio (HTTP/2), for service-to-service
callers: a door beside the LAN API onto the same services. A call is authenticated as a
REST request is (appliance/inference/authentication.py), its request is the REST body
parsed by the same schema (appliance/grpc/messages.py), and a completion is driven by
`CompletionService` with a `Sink` that writes each text delta as a reply: the same
classes, admission, quotas, usage records and metrics. A client that cancels stops its
sequence, and the tokens it spent are recorded (status 499), as for a REST stream.

Not here: burst offload (a shed call gets RESOURCE_EXHAUSTED with its retry time) and
the admin routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from opentelemetry.trace import SpanKind

from appliance.grpc import messages
from appliance.grpc.credentials import CertificateFiles
from appliance.grpc.errors import status_code, trailing_metadata
from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2 as pb
from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2_grpc as pb_grpc
from appliance.inference.authentication import authenticate
from appliance.inference.completions import Sink, invalid_output
from appliance.inference.schemas import EmbeddingRequest, completion_request, parse_body
from shared.errors import DomainError, InternalError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from appliance.inference.admission import AdmissionControl
    from appliance.inference.completions import CompletionService
    from appliance.inference.embeddings import EmbeddingService
    from appliance.observability.metrics import Metrics
    from appliance.observability.tracing import Tracing
    from appliance.serving.engine import Event
    from appliance.serving.registry import ModelRegistry
    from appliance.settings import GrpcSettings
    from appliance.state.store import ApiKey, AsyncStore

log = logging.getLogger(__name__)

SERVICE = "kovenlab.edge.v1.Inference"
T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]
Context = grpc.aio.ServicerContext[object, object]


@dataclass(frozen=True)
class Services:
    """What the gRPC API serves from: the application's own services."""

    completions: CompletionService
    embeddings: EmbeddingService
    registry: ModelRegistry
    admission: AdmissionControl
    store: AsyncStore
    metrics: Metrics
    tracing: Tracing


def route(method: str) -> str:
    """A method's full name, as its usage records and spans name it."""
    return f"/{SERVICE}/{method}"


def client_address(peer: str) -> str:
    """The address of `context.peer()` (`ipv4:10.0.0.7:51234`, `ipv6:%5B::1%5D:51234`),
    which the authentication throttle counts failures against."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind in {"ipv4", "ipv6"}:
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer or "unknown"


def _metadata(context: Context, name: str) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == name and isinstance(value, str):
            return value
    return ""


class _Replies(Sink):
    """A completion as a stream of replies: its metadata with the first event, then a
    reply per text delta."""

    stream_span = True
    record_when_gone = True

    def __init__(self, context: Context, metadata: Metadata) -> None:
        self._context = context
        self._metadata = metadata

    async def first(self, event: Event) -> None:
        await self._context.send_initial_metadata(self._metadata)

    async def text(self, text: str) -> None:
        await self._context.write(pb.GenerateReply(text=text))


class Inference(pb_grpc.InferenceServicer):
    """The servicer. The streaming methods write with `context.write` (not `yield`), so
    that a client's cancellation lands inside the completion's drive, which stops the
    sequence and records what it spent."""

    def __init__(self, services: Services) -> None:
        self._s = services

    async def Generate(  # type: ignore[override]
        self, request: pb.GenerateRequest, context: Context
    ) -> None:
        await self._serve(
            "Generate",
            context,
            lambda key, request_id: self._complete(
                messages.generate_body(request), key, context, request_id, method="Generate"
            ),
        )

    async def Chat(  # type: ignore[override]
        self, request: pb.ChatRequest, context: Context
    ) -> None:
        await self._serve(
            "Chat",
            context,
            lambda key, request_id: self._complete(
                messages.chat_body(request), key, context, request_id, method="Chat"
            ),
        )

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedReply:
        async def embed(key: ApiKey, request_id: str) -> pb.EmbedReply:
            req = parse_body(EmbeddingRequest, messages.embed_body(request))
            embedded = await self._s.embeddings.embed(req, key, route("Embed"))
            # Thousands of floats to copy: off the event loop, which other calls share.
            reply = await asyncio.to_thread(messages.embed_reply, embedded)
            await context.send_initial_metadata(
                (("x-request-id", request_id), ("kvl-model", embedded.model.ref))
            )
            return reply

        return await self._serve("Embed", context, embed)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsReply:
        async def models(key: ApiKey, request_id: str) -> pb.ListModelsReply:
            del key, request_id
            served = [messages.completion_model(r) for r in self._s.registry.replicas()]
            served += [messages.embedding_model(m) for m in self._s.embeddings.served()]
            return pb.ListModelsReply(models=served)

        return await self._serve("ListModels", context, models)

    async def _complete(
        self, body: dict[str, Any], key: ApiKey, context: Context, request_id: str, *, method: str
    ) -> None:
        service = self._s.completions
        req = completion_request(body, chat=method == "Chat")
        prepared = await service.prepare(req, key, route(method), refuse_early=True)
        replies = _Replies(context, (("x-request-id", request_id), ("kvl-model", prepared.model)))
        completed = await service.complete(prepared, replies)
        if completed.problems:
            # The text went out as it came; the call fails closed at its end.
            raise invalid_output(completed)
        await context.write(messages.last_reply(completed.finished))

    async def _serve(
        self, method: str, context: Context, run: Callable[[ApiKey, str], Awaitable[T]]
    ) -> T:
        """Authenticate the call and run it, with its span and metrics; a DomainError (or
        a bug) ends it with its status code and the error's trailing metadata."""
        s = self._s
        request_id = _metadata(context, "x-request-id") or uuid.uuid4().hex
        started = time.perf_counter()
        status = grpc.StatusCode.OK
        error: DomainError | None = None
        key: ApiKey | None = None
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": SERVICE,
            "rpc.method": method,
            "kvl.request_id": request_id,
        }
        try:
            with s.tracing.span(route(method), attributes, kind=SpanKind.SERVER) as span:
                try:
                    with s.tracing.span("auth"):
                        key = await authenticate(
                            _metadata(context, "authorization"),
                            client_address(context.peer()),
                            store=s.store,
                            admission=s.admission,
                            metrics=s.metrics,
                        )
                    result = await run(key, request_id)
                except DomainError as err:
                    error = err
                except Exception:
                    log.exception("unhandled error in gRPC %s (request %s)", method, request_id)
                    error = InternalError(f"internal error; request id {request_id}")
                else:
                    span.set_attribute("rpc.grpc.status_code", status.value[0])
                    return result
                status = status_code(error.code)
                span.set_attribute("rpc.grpc.status_code", status.value[0])
                span.set_attribute("error.type", error.code.value)
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED  # the client went away (or the server stops)
            raise
        finally:
            s.metrics.grpc_calls.labels(method, status.name).inc()
            if error is not None:
                s.metrics.grpc_errors.labels(method, error.code.value).inc()
            s.metrics.grpc_call_seconds.labels(method).observe(time.perf_counter() - started)
        if key is not None:
            # A key that calls again at once after refusals for load or a quota waits here
            # first (past its rate), as on HTTP.
            await s.admission.hold_refusal(key.id, error.code, context.peer(), error.retry_after)
        return await context.abort(status, error.message, trailing_metadata(error, request_id))


class GrpcServer:
    """The gRPC API's server: TLS with the LAN API's certificate when it has one
    (`tls`, followed as it is renewed), plaintext otherwise. It takes its port first
    (`listen`, before anything else of the appliance starts, so a port that is taken or
    a certificate that cannot be served stops the start at once), and serves once the
    services exist (`serve`)."""

    def __init__(
        self,
        settings: GrpcSettings,
        *,
        host: str,
        tls: tuple[Path, Path] | None,
        max_message_bytes: int,
    ) -> None:
        self._settings = settings
        self._host = host
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._server: grpc.aio.Server | None = None
        self._serving = False  # started, and not stopped
        self.port: int | None = None

    @property
    def tls(self) -> bool:
        return self._tls is not None

    def listen(self) -> int:
        """Take the port (not serving yet); the port. OSError when it cannot, ValueError
        when TLS is on and the certificate cannot be served."""
        settings = self._settings
        host = f"[{self._host}]" if ":" in self._host else self._host
        address = f"{host}:{settings.port}"
        if self._tls is None and settings.client_ca_file is not None:
            raise ValueError(
                "grpc.client_ca_file asks for client certificates, which need TLS: set "
                "server.tls_cert_file (or enroll the node, for the fleet's certificate)"
            )
        server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
                ("grpc.max_receive_message_length", self._max_message_bytes),
                # grpc shares a port with any other process by default: a second
                # appliance on the same port must fail to start, not split the calls.
                ("grpc.so_reuseport", 0),
            ]
        )
        try:
            if self._tls is None:
                port = server.add_insecure_port(address)
            else:
                files = CertificateFiles(*self._tls, settings.client_ca_file)
                port = server.add_secure_port(address, files.credentials())
        except RuntimeError as err:  # grpc's "failed to bind"
            raise OSError(f"the gRPC API cannot listen on {address}: {err}") from err
        if port == 0:
            raise OSError(f"the gRPC API cannot listen on {address}")
        self._server, self.port = server, port
        return port

    async def serve(self, services: Services) -> None:
        if self._server is None:
            raise RuntimeError("listen first")
        pb_grpc.add_InferenceServicer_to_server(Inference(services), self._server)
        await self._server.start()
        self._serving = True

    async def stop(self) -> None:
        """Stop serving: calls in flight have `grpc.shutdown_grace_s` to finish."""
        if self._server is None:
            return
        server, self._server = self._server, None
        # A server that never served (the start failed later) gives its port back now.
        await server.stop(self._settings.shutdown_grace_s if self._serving else 0)
