"""OpenMetrics for every service, on a registry per application (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvl_http_requests",
            "HTTP requests by route, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.errors = Counter(
            "kvl_http_errors",
            "Error responses by route and error code.",
            ["route", "code"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvl_http_request_duration_seconds",
            "Time from request to the last byte, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvl_prompt_tokens", "Prompt tokens evaluated, by model.", ["model"], registry=r
        )
        self.completion_tokens = Counter(
            "kvl_completion_tokens", "Tokens generated, by model.", ["model"], registry=r
        )
        self.ttft_seconds = Histogram(
            "kvl_time_to_first_token_seconds",
            "Time from admission to the first token, by model.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_seconds = Histogram(
            "kvl_generation_duration_seconds",
            "Time from admission to the last token, by model.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.model_ready = Gauge(
            "kvl_model_ready", "1 when the model is loaded and serving.", ["model"], registry=r
        )
        self.worker_restarts = Counter(
            "kvl_worker_restarts",
            "Model worker restarts, by model and kind (exited, heartbeat, hung, memory).",
            ["model", "kind"],
            registry=r,
        )
        self.queue_waiting = Gauge(
            "kvl_queue_waiting", "Requests waiting for a model.", ["model"], registry=r
        )

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition body and its content type: OpenMetrics unless only the classic
        Prometheus text format is acceptable to the scraper."""
        if "application/openmetrics-text" in accept or "text/plain" not in accept:
            return generate_openmetrics(self.registry), OPENMETRICS_CONTENT_TYPE  # type: ignore[no-untyped-call]
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
