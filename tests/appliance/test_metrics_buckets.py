"""The latency histograms cover every service class's objectives: each objective is a
bucket bound (the share that met it is exact), and an S0 sample of minutes is not lost
in +Inf."""

from __future__ import annotations

from prometheus_client.exposition import generate_latest

from appliance.observability.metrics import Metrics, latency_buckets
from appliance.settings import ClassObjectives, ClassSettings


def test_every_objective_is_a_bound_and_s0_fits() -> None:
    classes = ClassSettings()
    metrics = Metrics(objectives=classes.objective_seconds())
    for seconds in classes.objective_seconds():
        assert float(seconds) in metrics.latency_buckets
    assert max(metrics.latency_buckets) >= classes.s0.complete_s
    metrics.class_ttft_seconds.labels("S0").observe(700.0)
    text = generate_latest(metrics.registry).decode()
    # 700 s is counted under the 900 s bound (S0's SLO.B), not only under +Inf.
    assert 'kvl_class_time_to_first_token_seconds_bucket{class="S0",le="900.0"} 1.0' in text
    assert 'kvl_class_time_to_first_token_seconds_bucket{class="S0",le="600.0"} 0.0' in text


def test_an_operators_objective_becomes_a_bound() -> None:
    s1 = ClassObjectives(
        admit_s=2, first_token_s=7, complete_s=45, requests_per_minute=0, tokens_per_day=0
    )
    classes = ClassSettings(s1=s1)
    buckets = latency_buckets(classes.objective_seconds())
    assert {2.0, 7.0, 45.0} <= set(buckets)
    assert list(buckets) == sorted(set(buckets))
