"""OpenTelemetry spans, exported over OTLP/HTTP when configured: the appliance's request
path and the hub's hop of an offloaded request, so one request is one trace across them;
and their settings, the `tracing:` section both sides' configurations share.

One :class:`Tracing` per application (never OpenTelemetry's global provider, so several
apps in one process, as in the tests, keep their own). Without an endpoint every span is
OpenTelemetry's no-op span: the instrumented code costs next to nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel, ConfigDict, Field

from shared.protocol import TRACE_HEADERS

# W3C Trace Context: `traceparent` and `tracestate`, in and out.
_PROPAGATOR = TraceContextTextMapPropagator()

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from opentelemetry.sdk.trace import TracerProvider

Attribute = str | bool | int | float | Sequence[str]

# Request ids: this process's random prefix, then a counter. Unique across processes and
# restarts as a random id is, without asking the kernel for randomness on every request
# (at 10,000 nodes `secrets.token_hex` was 2 % of the hub's event loop); an id names a
# request in the logs and answers, it grants nothing, so it need not be unguessable.
_ID_PREFIX = secrets.token_hex(8)
_ID_COUNTER = itertools.count()


# Each side's subclass gives its own default: `service_name: ServiceName = "kovenlab-hub"`.
ServiceName = Annotated[str, Field(min_length=1, max_length=200, description="`service.name`.")]


class TracingSettings(BaseModel):
    """The `tracing:` section of the appliance's and the hub's settings, less the default
    `service.name`, which each side's subclass gives."""

    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = Field(
        None,
        min_length=1,
        max_length=2000,
        pattern=r"^https?://",
        description=(
            "OTLP/HTTP traces endpoint (`http://collector:4318/v1/traces`); when set, this "
            "side's part of each request is OpenTelemetry spans of the client's trace: on the "
            "appliance every stage of the request, on the hub its hop of an offloaded request "
            "(`hub.offload`). Unset: no tracing."
        ),
    )
    service_name: ServiceName
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="Share of requests traced (parent-based sampling)."
    )


def new_request_id() -> str:
    """A request id no other request of any process is likely to have: 32 hex digits."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


class Tracing:
    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._provider = provider
        self.tracer: trace.Tracer = (
            provider.get_tracer("kovenlab") if provider is not None else trace.NoOpTracer()
        )

    @classmethod
    def otlp(
        cls,
        endpoint: str | None,
        *,
        service: str,
        attributes: Mapping[str, Attribute] | None = None,
        sample_ratio: float = 1.0,
        export_delay_ms: int = 1000,
    ) -> Tracing:
        """Spans batched to an OTLP/HTTP endpoint (``http://collector:4318/v1/traces``);
        disabled when ``endpoint`` is None."""
        if endpoint is None:
            return cls()
        # The SDK and the OTLP exporter (protobuf with it: about 13 MiB) only when spans
        # are exported; without an endpoint the API's no-op tracer is all there is.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
        from opentelemetry.sdk.trace.sampling import (  # noqa: PLC0415
            ParentBased,
            TraceIdRatioBased,
        )

        resource = Resource.create({"service.name": service, **(attributes or {})})
        provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
        )
        processor = BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, timeout=5),
            schedule_delay_millis=export_delay_ms,
        )
        provider.add_span_processor(processor)
        return cls(provider)

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        attributes: Mapping[str, Attribute | None] | None = None,
        *,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        parent: Mapping[str, str] | None = None,
    ) -> Iterator[trace.Span]:
        """A span around a block, the child of the current one (context variables carry it
        across awaits in the same task), or of the W3C `traceparent` in `parent` (a
        request's headers). An exception escaping the block marks it. With tracing off,
        nothing: the no-op tracer's context switches cost ~15 us a span, and a request has
        a dozen (`inject` passes a request's own trace headers on without them)."""
        if self._provider is None:
            yield trace.INVALID_SPAN
            return
        context = _PROPAGATOR.extract(carrier=parent) if parent is not None else None
        with self.tracer.start_as_current_span(
            name, context=context, kind=kind, attributes=_clean(attributes or {})
        ) as span:
            yield span

    def inject(self, headers: dict[str, str], incoming: Mapping[str, str]) -> None:
        """The current trace's W3C headers into `headers` (an outgoing request), so the next
        hop joins it; with tracing off here, the incoming ones pass on as they came."""
        if self.enabled:
            _PROPAGATOR.inject(headers)
            return
        for name in TRACE_HEADERS:
            if (value := incoming.get(name)) is not None:
                headers[name] = value

    def record(
        self,
        name: str,
        start_s: float,
        end_s: float,
        attributes: Mapping[str, Attribute | None] | None = None,
    ) -> None:
        """A finished span from wall-clock times (seconds since the epoch) measured elsewhere,
        such as the worker's queue and decode times, as a child of the current span."""
        span = self.tracer.start_span(
            name, start_time=int(start_s * 1e9), attributes=_clean(attributes or {})
        )
        span.end(end_time=int(end_s * 1e9))

    def flush(self, timeout_ms: int = 5000) -> bool:
        return self._provider.force_flush(timeout_ms) if self._provider is not None else True

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def _clean(attributes: Mapping[str, Attribute | None]) -> dict[str, Attribute]:
    return {k: v for k, v in attributes.items() if v is not None}
