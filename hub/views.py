"""What the hub shows of its state, to the API and the CLI alike (plain JSON values)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from hub.planning.health import status_of
from hub.state.configuration import digest_for

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hub.settings import HubSettings
    from hub.state.alerts import AlertRecord, Silence
    from hub.state.configuration import Configuration
    from hub.state.deployments import DeploymentRecord
    from hub.state.leases import Quota
    from hub.state.nodes import Node
    from hub.state.packages import PackageRecord
    from hub.state.tokens import EnrollmentToken


def tenancy_text(tenant: str | None, private: bool) -> str:
    """A node's (or an enrollment token's) tenancy in a few words."""
    if tenant is None:
        return "private" if private else "shared"
    return f"private:{tenant}" if private else f"dedicated:{tenant}"


def node_view(node: Node, settings: HubSettings, now: float) -> dict[str, Any]:
    status = status_of(node, settings.fleet, now)
    return {
        "id": node.id,
        "name": node.name,
        "site": node.site,
        "status": status.value,
        "overlay_address": node.overlay_address,
        "last_seen": node.last_seen,
        "versions": node.versions,
        "capacity": node.capacity.model_dump(mode="json"),
        "labels": node.labels,
        "draining": node.draining,
        "tenant": node.tenant,
        "private": node.private,
        "certificate_refused": node.certificate_refused,
    }


def quota_view(quota: Quota, names: dict[str, str]) -> dict[str, Any]:
    """An account's quota for people and JSON: nodes by name, times in ISO 8601."""
    return {
        "account": quota.account,
        "budget_tokens": quota.budget.tokens,
        "period_s": quota.budget.period_s,
        "period_start": _iso(quota.period_start),
        "period_end": _iso(quota.period_end),
        "consumed": quota.consumed,
        "leased": {names.get(node, node): tokens for node, tokens in quota.leased.items()},
        "remaining": quota.remaining,
    }


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def deployment_view(
    deployment: DeploymentRecord, placed: list[tuple[str, str, int | None]], names: dict[str, str]
) -> dict[str, Any]:
    nodes = sorted(names.get(n, n) for d, n, _ in placed if d == deployment.id)
    return {
        "id": deployment.id,
        "model": deployment.model,
        "replicas": deployment.replicas,
        "service_class": deployment.service_class,
        "isolation": deployment.isolation,
        "constraints": dict(deployment.constraints),
        "preset": dict(deployment.preset or {}),
        "nodes": nodes,
    }


def package_view(p: PackageRecord, names: Mapping[str, str]) -> dict[str, Any]:
    """A package known to the fleet, as the operator API and the console show it."""
    return {
        "id": p.id,
        "version": p.version,
        "title": p.title,
        "topic": p.topic,
        "level": p.level,
        "items": p.items,
        "size": p.size,
        "digest": p.digest,
        "lineage": p.lineage,
        "origin_node": p.origin_node and names.get(p.origin_node, p.origin_node),
        "created_at": p.created_at,
        "held_by_hub": p.bundle_sha256 is not None,
        "nodes": [names.get(n, n) for n in p.nodes],
        "seeded_to": p.seeded_to,
    }


def token_view(token: EnrollmentToken, now: float) -> dict[str, Any]:
    """An enrollment token without its secret (shown once, when it is made)."""
    return {
        "prefix": token.prefix,
        "site": token.site,
        "uses_left": token.uses_left,
        "expires_at": datetime.fromtimestamp(token.expires_at, UTC).isoformat(),
        "state": token.state(now),
        "tenant": token.tenant,
        "private": token.private,
    }


def alert_view(alert: AlertRecord) -> dict[str, Any]:
    """An alert as the operator API, the CLI and the console show it (times in ISO 8601)."""
    return {
        "id": alert.id,
        "rule": alert.rule,
        "labels": alert.labels,
        "severity": alert.severity,
        "state": alert.state,
        "fired_at": _iso(alert.fired_at),
        "resolved_at": None if alert.resolved_at is None else _iso(alert.resolved_at),
        "value": alert.value,
        "summary": alert.summary,
        "silenced": alert.silenced,
    }


def silence_view(silence: Silence, now: float) -> dict[str, Any]:
    return {
        "id": silence.id,
        "matchers": silence.matchers,
        "until": _iso(silence.until),
        "active": silence.until > now,
        "created_by": silence.created_by,
        "comment": silence.comment,
        "created_at": _iso(silence.created_at),
    }


def configuration_view(node: Node, configuration: Configuration) -> dict[str, Any]:
    """What the hub sets of a node's settings (with the changes rollouts in flight gave it),
    where each value came from, and whether its last heartbeat says it applied them (on
    the store's thread)."""
    values, origins = configuration.effective(node, configuration.staged(node))
    digest = digest_for(configuration.desired(node), node)
    return {
        "node": node.name,
        "values": {k: {"value": v, "from": origins[k]} for k, v in sorted(values.items())},
        "digest": digest,
        "applied": node.capacity.settings_digest == digest,
    }
