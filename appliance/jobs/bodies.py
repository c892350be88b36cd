"""The JSON bodies of the jobs API and of its webhook events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.state.jobs import Delivery, ItemResult, Job


def _unix(at: float | None) -> int | None:
    return None if at is None else int(at)


def job_object(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "object": "job",
        "status": job.status,
        "progress": {"total": job.total, "completed": job.completed, "failed": job.failed},
        "created_at": _unix(job.created_at),
        "started_at": _unix(job.started_at),
        # When it ended: completed, failed or cancelled.
        "completed_at": _unix(job.ended_at),
        "metadata": job.metadata,
        "webhook": _webhook(job),
    }


def _webhook(job: Job) -> dict[str, Any] | None:
    if job.webhook_url is None:
        return None
    d = job.delivery
    if d is None:  # the job has not ended: nothing to deliver yet
        return {"url": job.webhook_url, "status": "waiting", "delivery_id": None, "attempts": 0}
    return {
        "url": d.url,
        "status": d.status,
        "delivery_id": d.id,
        "attempts": d.attempts,
        "last_status_code": d.last_status,
        "last_error": d.last_error,
        "next_attempt_at": _unix(d.next_attempt_at),
        "delivered_at": _unix(d.delivered_at),
    }


def result_object(result: ItemResult) -> dict[str, Any]:
    return {
        "custom_id": result.custom_id,
        "status_code": result.status_code,
        "body": result.response,
    }


def event_body(delivery: Delivery, job: Job) -> dict[str, Any]:
    """A webhook event: the job as it ended."""
    return {
        "id": delivery.id,
        "object": "event",
        "type": delivery.event,
        "created": int(delivery.created_at),
        "data": job_object(job),
    }
