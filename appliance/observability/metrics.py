"""OpenMetrics for every service, on a registry per application (never the global one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector

from shared import protocol
from shared.supervise import Failures

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from prometheus_client import Metric

    from appliance.observability.objectives import ObjectiveBook

# Up to an hour: S0's objectives are 600-3600 s, and a sample past the last bound lands
# in +Inf, where no objective can be read from it.
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900,
    1800, 3600,
)  # fmt: skip


def latency_buckets(objectives: Iterable[float] = ()) -> tuple[float, ...]:
    """The latency buckets, with every objective a bound of its own, so the share of
    requests that met it is read off the histogram exactly, not interpolated."""
    return tuple(sorted({*_LATENCY_BUCKETS, *(float(o) for o in objectives if o > 0)}))


_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self, objectives: Iterable[float] = ()) -> None:
        """`objectives`: the service classes' objectives in seconds (bounds of the latency
        histograms)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency_buckets = buckets = latency_buckets(objectives)
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
            buckets=buckets,
            registry=r,
        )
        # The gRPC API's calls: its own family, as gRPC statuses are not HTTP's.
        self.grpc_calls = Counter(
            "kvl_grpc_calls",
            "gRPC calls by method and status code.",
            ["method", "status"],
            registry=r,
        )
        self.grpc_errors = Counter(
            "kvl_grpc_errors",
            "gRPC calls that ended in an error, by method and error code.",
            ["method", "code"],
            registry=r,
        )
        self.grpc_call_seconds = Histogram(
            "kvl_grpc_call_duration_seconds",
            "Time from a gRPC call to its status, by method.",
            ["method"],
            buckets=buckets,
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
            buckets=buckets,
            registry=r,
        )
        self.generation_seconds = Histogram(
            "kvl_generation_duration_seconds",
            "Time from admission to the last token, by model.",
            ["model"],
            buckets=buckets,
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
        self.queue_seconds = Histogram(
            "kvl_queue_duration_seconds",
            "Time from arrival at the worker to a batch slot, by model.",
            ["model"],
            buckets=buckets,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "kvl_time_per_output_token_seconds",
            "Mean time between a request's tokens after the first (inter-token latency), "
            "one observation per request, by model.",
            ["model"],
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.slots = Gauge("kvl_slots", "Batch slots of a model's replicas.", ["model"], registry=r)
        self.slots_busy = Gauge(
            "kvl_slots_busy", "Batch slots holding a sequence, by model.", ["model"], registry=r
        )
        self.batch_tokens = Histogram(
            "kvl_batch_tokens",
            "Tokens per llama_decode call (decode tokens plus prompt chunks), by model.",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=r,
        )
        self.decode_tokens_per_second = Gauge(
            "kvl_decode_tokens_per_second",
            "Tokens generated per second by a model's replicas, over the last heartbeat.",
            ["model"],
            registry=r,
        )
        self.admission = Counter(
            "kvl_admission_decisions",
            "Admission decisions at the door, by class and outcome (admitted, or the "
            "objective that refused it: admit, first_token; prompt_too_long: refused for "
            "good, as no wait would meet the class).",
            ["class", "decision"],
            registry=r,
        )
        self.sheds = Counter(
            "kvl_admission_sheds",
            "Queued requests dropped when they missed their first-token objective, by class.",
            ["class"],
            registry=r,
        )
        self.quota_refusals = Counter(
            "kvl_quota_refusals",
            "Requests refused for an account quota, by class and quota.",
            ["class", "quota"],
            registry=r,
        )
        self.auth_throttled = Counter(
            "kvl_auth_throttled",
            "Requests refused because their address failed authentication too often.",
            registry=r,
        )
        self.refusals_held = Counter(
            "kvl_refusals_held",
            "429s held before they were answered: their key was refused more than "
            "classes.refusals_per_second times a second (a client not waiting its Retry-After).",
            registry=r,
        )
        self.class_ttft_seconds = Histogram(
            "kvl_class_time_to_first_token_seconds",
            "Time from arrival at the worker to the first token, by service class.",
            ["class"],
            buckets=buckets,
            registry=r,
        )
        self.class_completion_seconds = Histogram(
            "kvl_class_completion_seconds",
            "Time from arrival at the worker to the last token, by service class.",
            ["class"],
            buckets=buckets,
            registry=r,
        )
        self.slo_misses = Counter(
            "kvl_slo_misses",
            "Served requests that missed an objective of their class (admit, first_token, "
            "complete).",
            ["class", "objective"],
            registry=r,
        )
        self.preemptions = Counter(
            "kvl_preemptions",
            "S0 sequences that yielded their batch slot to a higher class, by model.",
            ["model"],
            registry=r,
        )
        self.outbox_lag = Gauge(
            "kvl_outbox_lag",
            "Usage events committed here and not yet acknowledged by the hub.",
            registry=r,
        )
        self.offloads = Counter(
            "kvl_offloads",
            "Burst offload: requests this node handed to the fleet (sent) and took from it "
            "(served), by outcome.",
            ["direction", "outcome"],
            registry=r,
        )
        self.outbox_synced = Counter(
            "kvl_outbox_synced", "Usage events the hub acknowledged.", registry=r
        )
        self.prefix_tokens_reused = Counter(
            "kvl_prefix_tokens_reused",
            "Prompt tokens whose KV was copied from a shared prefix, or kept in a slot from "
            "the request before, instead of computed.",
            ["model"],
            registry=r,
        )
        self.embedding_inputs = Counter(
            "kvl_embedding_inputs", "Input texts embedded, by model.", ["model"], registry=r
        )
        self.embedding_batch_requests = Histogram(
            "kvl_embedding_batch_requests",
            "Requests embedded together per batcher run, by model.",
            ["model"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.embedding_batch_texts = Histogram(
            "kvl_embedding_batch_texts",
            "Texts embedded per batcher run, by model.",
            ["model"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.speech_characters = Counter(
            "kvl_speech_characters",
            "Input characters read aloud by /v1/audio/speech, by voice engine.",
            ["engine"],
            registry=r,
        )
        self.speech_audio_seconds = Counter(
            "kvl_speech_audio_seconds",
            "Seconds of speech synthesised, by voice engine.",
            ["engine"],
            registry=r,
        )
        self.speech_first_audio_seconds = Histogram(
            "kvl_speech_first_audio_seconds",
            "Time from a speech request to its first audio, by voice engine.",
            ["engine"],
            buckets=buckets,
            registry=r,
        )
        self.embedding_model = Info(
            "kvl_embedding_model",
            "The embedding model loaded: its onnxruntime execution provider and dimension.",
            ["model"],
            registry=r,
        )

        self.jobs = Counter(
            "kvl_jobs",
            "Jobs that entered each status (queued, running, completed, failed, cancelled).",
            ["status"],
            registry=r,
        )
        self.job_items = Counter(
            "kvl_job_items",
            "Job items by outcome: completed (a 2xx result), failed (an error result), retried "
            "(a transient model error; the item runs again later).",
            ["outcome"],
            registry=r,
        )
        self.job_items_running = Gauge(
            "kvl_job_items_running", "Job items generating now.", registry=r
        )
        self.webhook_deliveries = Counter(
            "kvl_webhook_deliveries",
            "Webhook delivery attempts by outcome: delivered (a 2xx), retried (tried again "
            "later), failed (given up after `jobs.webhook_retry_s`).",
            ["outcome"],
            registry=r,
        )
        self.peer_bytes_served = Counter(
            "kvl_fleet_peer_bytes_served",
            "Bytes of model files this node sent to other nodes of its site (each fetched "
            "from here, not over the site's link to the hub).",
            registry=r,
        )
        self.background_failures = Counter(
            "kvl_background_failures",
            "Exceptions a background loop survived (logged with their traceback; the loop "
            "went on with its next round), by loop.",
            ["loop"],
            registry=r,
        )
        # The application's one record of its loops' failures, counted above.
        self.failures = Failures(self.background_failures)

    def watch_objectives(self, book: ObjectiveBook) -> None:
        """`kvl_slo_events_total` and `kvl_requests_by_outcome_total`, read off the live
        objectives' book at each scrape (the same counts the heartbeats carry)."""
        self.registry.register(_ObjectivesCollector(book))

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition body and its content type: OpenMetrics unless only the classic
        Prometheus text format is acceptable to the scraper."""
        if "application/openmetrics-text" in accept or "text/plain" not in accept:
            return generate_openmetrics(self.registry), OPENMETRICS_CONTENT_TYPE  # type: ignore[no-untyped-call]
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ObjectivesCollector(Collector):
    """The objective book per class (its accounts summed): counters that resume across
    restarts, as the book does."""

    def __init__(self, book: ObjectiveBook) -> None:
        self._book = book

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        events, outcomes = families
        met: dict[tuple[str, str], int] = {}
        missed: dict[tuple[str, str], int] = {}
        ended: dict[tuple[str, str], int] = {}
        for klass, _, s in self._book.items():
            for i, objective in enumerate(protocol.OBJECTIVES):
                met[klass, objective] = met.get((klass, objective), 0) + s.met[i]
                missed[klass, objective] = missed.get((klass, objective), 0) + s.missed[i]
            ended[klass, "admitted"] = ended.get((klass, "admitted"), 0) + s.admitted
            for i, reason in enumerate(protocol.REFUSALS):
                ended[klass, reason] = ended.get((klass, reason), 0) + s.refused[i]
        for (klass, name), n in sorted(met.items()):
            events.add_metric([klass, name, "met"], n)
            events.add_metric([klass, name, "missed"], missed[klass, name])
        for (klass, outcome), n in sorted(ended.items()):
            outcomes.add_metric([klass, outcome], n)
        return iter(families)

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily]:
        return (
            CounterMetricFamily(
                "kvl_slo_events",
                "Requests measured against an objective of their class (admit, first_token, "
                "complete), by outcome (met, missed); every refusal but a quota's misses all "
                "three.",
                labels=["class", "objective", "outcome"],
            ),
            CounterMetricFamily(
                "kvl_requests_by_outcome",
                "Requests that reached admission, by class and how they ended: admitted, or "
                "the refusal's reason (admit, first_token, shed, outbox, error, quota).",
                labels=["class", "outcome"],
            ),
        )
