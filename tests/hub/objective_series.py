"""What a node's heartbeat reports of its service objectives: one series per (class,
account), and the report they make up."""

from __future__ import annotations

from typing import Any

from shared import protocol


def series(
    account: str = "acme",
    service_class: str = "S1",
    *,
    requests: int = 0,
    admitted: int | None = None,
    refused: dict[str, int] | None = None,
    met: int = 0,
    missed: int = 0,
    ttft: dict[int, int] | None = None,
) -> dict[str, Any]:
    """One (class, account) series: `met`/`missed` for first_token (and admit: all that
    were admitted met it), the TTFT histogram's counts by bucket index."""
    refused = refused or {}
    admitted = requests - sum(refused.values()) if admitted is None else admitted
    counts = [0] * BUCKETS
    for i, n in (ttft or {}).items():
        counts[i] = n
    return {
        "service_class": service_class,
        "account": account,
        "requests": requests,
        "admitted": admitted,
        "refused": refused,
        "met": {"first_token": met, "admit": admitted},
        "missed": {"first_token": missed, "admit": requests - admitted - refused.get("quota", 0)},
        "ttft": {"counts": counts, "sum_s": float(sum(counts))},
    }


def objectives(epoch: str, *many: dict[str, Any], restarts: int = 0) -> dict[str, Any]:
    return {"epoch": epoch, "series": list(many), "worker_restarts": restarts}


BUCKETS = len(protocol.LATENCY_BOUNDS_S) + 1
