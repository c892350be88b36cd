"""The route table's part for image releases, update windows and staged rollouts
(hub/api/rollouts.py); joined into the one table by hub/api/route_table.py."""

from __future__ import annotations

from hub.api.requests import ReleaseQuery, RolloutRequest, WindowRequest
from hub.api.route_kinds import Auth, Param, Route
from shared.errors import ErrorCode

_NOT_FOUND = (ErrorCode.not_found,)
_CONFLICT = (ErrorCode.not_found, ErrorCode.rollout_conflict)
_VERSION = ReleaseQuery.model_json_schema()["properties"]["version"]


def _step(action: str, summary: str) -> Route:
    return Route(
        "POST", f"/v1/admin/rollouts/{{id}}/{action}", summary, Auth.operator, errors=_CONFLICT
    )


ROLLOUT_ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/admin/releases",
        "Image releases the hub holds: version, notes, sha256, size, and how many nodes "
        "have it as their target.",
        Auth.operator,
    ),
    Route(
        "POST",
        "/v1/admin/releases",
        "Keep an image release: the body is its bundle (a RAUC `.raucb`, opaque to the "
        "hub), kept under its sha256.",
        Auth.operator,
        status=201,
        body_type="application/octet-stream",
        errors=(ErrorCode.request_too_large, ErrorCode.rollout_conflict),
        params=(
            Param(
                "version",
                "query",
                "the image version the bundle installs",
                _VERSION,
                required=True,
            ),
            Param("notes", "query", "release notes", {"type": "string", "maxLength": 2000}),
        ),
    ),
    Route(
        "GET",
        "/v1/admin/releases/{version}",
        "One release.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    Route(
        "PUT",
        "/v1/admin/update-windows/{site}",
        "A site's update window (UTC): its nodes fetch and install a release only then.",
        Auth.operator,
        WindowRequest,
    ),
    Route(
        "DELETE",
        "/v1/admin/update-windows/{site}",
        "A site's nodes may update at any time again.",
        Auth.operator,
    ),
    Route(
        "GET",
        "/v1/admin/rollouts",
        "Staged rollouts, newest first, each with its waves and their nodes' reports.",
        Auth.operator,
    ),
    Route(
        "POST",
        "/v1/admin/rollouts",
        "Start a staged rollout of a release to the fleet, or of a deployment's new model: "
        "a canary, then waves, each gated on its nodes' health for a soak time.",
        Auth.operator,
        RolloutRequest,
        status=201,
        errors=_CONFLICT,
    ),
    Route(
        "GET",
        "/v1/admin/rollouts/{id}",
        "One rollout: state, phase, reason, strategy, and each wave's nodes.",
        Auth.operator,
        errors=_NOT_FOUND,
    ),
    _step("pause", "Pause a rollout: no node more is reached until it is resumed."),
    _step("resume", "Resume a paused or halted rollout (a halt's failed nodes are judged again)."),
    _step("abort", "Abort a rollout: the nodes it reached get what they had before."),
    _step(
        "finish",
        "Finish a rolling-back rollout now: aborted, the nodes that have not reported what "
        "they had before recorded as never confirmed (they keep it as their target).",
    ),
)
