"""OpenTelemetry spans of the request path, exported over OTLP/HTTP when configured: the
hub's hop of an offloaded request is traced by the same class, so it lives in
`shared/tracing.py` (one :class:`Tracing` per application; no-op spans without an
endpoint)."""

from __future__ import annotations

from shared.tracing import Attribute, Tracing

__all__ = ["Attribute", "Tracing"]
