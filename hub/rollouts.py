"""Staged rollouts of an image release or of a deployment's new model: the one place that
does I/O around the pure planner (hub/planning/rollout.py).

`begin` records a rollout: its nodes (every node not revoked that speaks protocol 6, for a
release; the nodes holding a replica of the deployment, for a model), the wave of each,
and what each had before (to give it back on abort). Every `fleet.rollout_every_s` the
loop (`rollouts_forever`) reads each active rollout with the fleet's last heartbeats and
the objectives measured on the wave's nodes, asks `step` what follows, and writes it in
one transaction (hub/state/rollouts.py): the nodes it reaches get the target in their
desired state, and the serial moves.

What counts as healthy. A release: the node's heartbeat says it runs the version and has
marked it good (`Capacity.image`). A model: the node serves the new ref (`Capacity.models`)
and names no placement error for it. Either for `soak_s` without a break. What halts:
the node reports a failed update or a rollback (in any wave), or, in the current wave, it
goes unheard for `offline_after_s`, or one of its objectives burns its error budget faster
than `max_burn_rate` over the wave (at least `min_requests` counted: the live objectives,
hub/state/objectives.py, by node and to the 5-minute bucket).

An abort gives the nodes reached what they had before, and the rollout is `rolling-back`
until each reports it (`rollback`), or is offline by the fleet's own window
(`fleet.offline_after_s`), or the operator finishes the rollback (`finish`); a node that
never confirmed is recorded as such, and keeps its previous target for when it returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from hub.fleet.budgets import burn_rate
from hub.node_settings import observe_settings, settings_digest, settings_reach
from hub.planning.health import status_of
from hub.planning.rollout import STEPS, Candidate, Seen, assign_waves, rollback, step
from hub.state.configuration import key_protocol, node_protocol
from hub.state.errors import NotFoundError
from hub.state.rollouts import RolloutConflictError
from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hub.planning.rollout import Member, Report, RolloutState, Strategy
    from hub.settings import HubSettings
    from hub.state.nodes import Node
    from hub.state.rollouts import Release, Rollout, RolloutKind
    from hub.state.store import AsyncHubStore, HubStore
    from shared.supervise import Failures

log = logging.getLogger(__name__)

RELEASE_PROTOCOL = 6  # the first protocol with release targets and image status
EVALUATION_PROTOCOL = 7  # the first whose nodes evaluate the models placed on them


def begin(
    store: HubStore, kind: RolloutKind, target: Mapping[str, str], strategy: Strategy, by: str
) -> Rollout:
    """Plan and record a rollout (on the store's thread). NotFoundError for a release,
    deployment, model or canary node that is not there; RolloutConflictError for a
    rollout that would reach no node, or change nothing."""
    nodes = [n for n in store.nodes.all() if not n.revoked]
    if kind == "release":
        version = target["release"]
        store.rollouts.release(version)  # NotFoundError when the hub holds no such release
        known = {r.version for r in store.rollouts.releases()}
        given = store.rollouts.node_release_versions()
        reach = [n for n in nodes if node_protocol(n) >= RELEASE_PROTOCOL]
        previous: dict[str, str | None] = {}
        for n in reach:
            running = n.capacity.image.version if n.capacity.image is not None else None
            # What the node had before: its last release target, else the release it runs
            # if the hub holds it (an abort can give back only what the hub can serve).
            previous[n.id] = given.get(n.id) or (running if running in known else None)
        stored_target = {"release": version}
    elif kind == "settings":
        reach, previous, stored_target = settings_reach(store, nodes, target)
    else:
        deployment_id, ref = target["deployment"], target["model"]
        deployment = next((d for d in store.deployments.all() if d.id == deployment_id), None)
        if deployment is None:
            raise NotFoundError(f"no deployment {deployment_id!r}", param="deployment")
        if ref not in {m.ref for m in store.deployments.models()}:
            raise NotFoundError(
                f"no model {ref!r}; add it with `kvl hub models add`", param="model"
            )
        if deployment.model == ref:
            raise RolloutConflictError(f"deployment {deployment_id} runs {ref} already")
        placed = {node for d, node, _ in store.deployments.placements() if d == deployment_id}
        reach = [n for n in nodes if n.id in placed]
        previous = {n.id: deployment.model for n in reach}
        stored_target = {"deployment": deployment_id, "model": ref, "from": deployment.model}
    if not reach:
        raise RolloutConflictError("no node to roll out to" + _unreached(kind, target))
    candidates = [Candidate(n.id, n.name, n.site) for n in reach]
    missing = set(strategy.canary_nodes) - {c.name for c in candidates} - {c.id for c in candidates}
    if missing:
        raise NotFoundError(
            f"no node {min(missing)!r} among the rollout's nodes", param="strategy.canary_nodes"
        )
    waves = assign_waves(strategy, candidates)
    names = {n.id: n.name for n in reach}
    return store.rollouts.start(
        kind, stored_target, strategy=strategy, waves=waves, previous=previous, names=names,
        created_by=by,
    )  # fmt: skip


def _unreached(kind: RolloutKind, target: Mapping[str, str]) -> str:
    if kind == "release":
        return f" (a release reaches nodes of protocol {RELEASE_PROTOCOL} on)"
    if kind == "settings":
        first = key_protocol(target["key"])
        return f" (the setting reaches the scope's nodes of protocol {first} on)"
    return " (the deployment has no replica placed)"


def observe_release(node: Node | None, version: str | None) -> Seen:
    """What a node's last heartbeat says of release `version` (None: nothing to wait
    for)."""
    if node is None or node.revoked or version is None:
        return Seen("gone")
    capacity = node.capacity
    image = capacity.image
    report: Report = "pending"
    detail = ""
    if image is None:
        if capacity.release_error:
            report, detail = "failed", capacity.release_error
        elif node_protocol(node) < RELEASE_PROTOCOL:
            report = "failed"
            detail = f"it speaks protocol {node_protocol(node)}: no release reaches it"
    elif image.version == version and image.state == "good":
        report = "healthy"
    elif image.target == version and image.state == "failed":
        report, detail = "failed", image.error or ""
    elif image.target == version and image.state == "rolled-back":
        report, detail = "rolled-back", image.error or ""
    return Seen(report, detail, node.last_seen)


def observe_model(
    node: Node | None, ref: str, placed: set[str], min_score: int | None = None
) -> Seen:
    """What a node's last heartbeat says of model `ref` of a deployment placed on the
    nodes `placed`; with `min_score`, it is healthy only once its evaluation of the model
    (protocol 7) saw that many instructions followed, and failed below it."""
    if node is None or node.revoked or node.id not in placed:
        return Seen("gone")
    capacity = node.capacity
    if ref in capacity.placement_errors:
        return Seen("failed", capacity.placement_errors[ref], node.last_seen)
    if ref not in capacity.models:
        return Seen("pending", last_seen=node.last_seen)
    if min_score is None:
        return Seen("healthy", last_seen=node.last_seen)
    return _scored(node, ref, min_score)


def _scored(node: Node, ref: str, min_score: int) -> Seen:
    """A node serving `ref`, judged by its evaluation of it."""
    score = node.capacity.evaluations.get(ref)
    if score is None and node_protocol(node) < EVALUATION_PROTOCOL:
        why = f"it speaks protocol {node_protocol(node)}: it evaluates no model"
        return Seen("failed", why, node.last_seen)
    if score is None:
        return Seen("pending", last_seen=node.last_seen)  # evaluating
    if score.followed < min_score:
        why = (
            f"its evaluation of {ref} followed {score.followed} of {score.total} "
            f"instructions; the rollout requires {min_score}"
        )
        return Seen("failed", why, node.last_seen)
    return Seen("healthy", last_seen=node.last_seen)


def burn_rates(
    store: HubStore,
    settings: HubSettings,
    names: set[str],
    *,
    since: float,
    now: float,
    least: int,
) -> dict[str, float]:
    """The worst burn rate of any objective of any class on each named node since
    `since`, where at least `least` requests counted for it."""
    worst: dict[str, float] = {}
    if not names:
        return worst
    for totals in store.objectives.totals(since, now, "node"):
        if totals.group not in names:
            continue
        for objective in protocol.OBJECTIVES:
            met, missed = totals.met.get(objective, 0), totals.missed.get(objective, 0)
            if met + missed < max(1, least):
                continue
            target = settings.objectives.target(totals.service_class, objective)
            rate = burn_rate(missed, met + missed, target)
            worst[totals.group] = max(worst.get(totals.group, 0.0), rate)
    return worst


def evaluate(store: HubStore, settings: HubSettings, now: float) -> list[str]:
    """One round of every active rollout (on the store's thread); the ids that moved."""
    active = [
        r for r in store.rollouts.all(active_only=True) if r.state not in {"paused", "halted"}
    ]
    if not active:
        return []
    nodes = {n.id: n for n in store.nodes.all()}
    return [r.id for r in active if _round(store, settings, r, nodes, now)]


def _seen(
    store: HubStore, rollout: Rollout, nodes: Mapping[str, Node], *, back: bool
) -> dict[str, Seen]:
    """Each member's report of the rollout's target (`back`: of what it had before)."""
    if rollout.kind == "release":
        return {
            m.member.node_id: observe_release(
                nodes.get(m.member.node_id), m.previous if back else rollout.target["release"]
            )
            for m in rollout.members
        }
    if rollout.kind == "settings":
        return {
            m.member.node_id: observe_settings(
                nodes.get(m.member.node_id), settings_digest(store, rollout, nodes, m, back=back)
            )
            for m in rollout.members
        }
    deployment = rollout.target["deployment"]
    placed = {node for d, node, _ in store.deployments.placements() if d == deployment}
    ref = rollout.target["from"] if back else rollout.target["model"]
    # Going back, the model it had served before: no score gates the way back.
    least = None if back else rollout.strategy.min_score
    return {
        m.member.node_id: observe_model(nodes.get(m.member.node_id), ref, placed, least)
        for m in rollout.members
    }


def _round(
    store: HubStore, settings: HubSettings, rollout: Rollout, nodes: Mapping[str, Node], now: float
) -> bool:
    members = [m.member for m in rollout.members]
    if rollout.state == "rolling-back":
        back = rollback(
            members, _seen(store, rollout, nodes, back=True), now=now,
            offline_after_s=settings.fleet.offline_after_s,
        )  # fmt: skip
        if not back.done:
            return False
        reason = rollout.reason
        if back.unconfirmed:
            reason += f"; never confirmed (offline): {', '.join(back.unconfirmed)}"
            log.warning("rollout %s: %s", rollout.id, reason)
        return _end_rollback(store, rollout, back.members, reason)
    seen = _seen(store, rollout, nodes, back=False)
    strategy = rollout.strategy
    if strategy.max_burn_rate is not None:
        names = {m.name for m in members if m.wave == rollout.wave and m.state == "targeted"}
        rates = burn_rates(
            store,
            settings,
            names,
            since=rollout.wave_started_at,
            now=now,
            least=strategy.min_requests,
        )
        for m in members:
            if m.name in rates:
                s = seen[m.node_id]
                seen[m.node_id] = Seen(s.report, s.detail, s.last_seen, rates[m.name])
    result = step(
        strategy, members, seen, wave=rollout.wave, wave_started_at=rollout.wave_started_at,
        now=now,
    )  # fmt: skip
    state: RolloutState = "done" if result.done else "halted" if result.halted else "running"
    if state == rollout.state and not result.changed and result.wave == rollout.wave:
        return False
    reason = result.halted or ("every wave updated" if result.done else "")
    if result.halted:
        log.warning("rollout %s halted: %s", rollout.id, result.halted)
    elif result.done:
        log.info("rollout %s done", rollout.id)
    return store.rollouts.save_round(
        rollout, state=state, wave=result.wave, wave_started_at=result.wave_started_at,
        reason=reason, members=result.members,
    )  # fmt: skip


def _end_rollback(store: HubStore, rollout: Rollout, members: list[Member], reason: str) -> bool:
    """A rollback over: the rollout aborted, with the members as the last round left them
    (False where another writer moved it first)."""
    return store.rollouts.save_round(
        rollout, state="aborted", wave=rollout.wave, wave_started_at=rollout.wave_started_at,
        reason=reason, members=members,
    )  # fmt: skip


# Reads of a rollout that another writer moved before the finish was written (the loop's
# round, another replica, another operator): more than a couple means something is wrong.
_FINISH_TRIES = 5


def finish(
    store: HubStore, settings: HubSettings, rollout_id: str, *, by: str, now: float
) -> Rollout:
    """The operator's finish of a rolling-back rollout (on the store's thread): aborted
    now, the members that have not reported their previous target marked `unconfirmed`
    (their nodes keep it as their target). RolloutConflictError from any other state;
    NotFoundError for no such rollout."""
    for _ in range(_FINISH_TRIES):
        rollout = store.rollouts.get(rollout_id)
        if rollout.state != "rolling-back":
            raise RolloutConflictError(
                f"rollout {rollout_id} is {rollout.state}: only a rolling-back rollout can be "
                "finished" + (" (abort it first)" if rollout.state in STEPS["abort"][1] else "")
            )
        nodes = {n.id: n for n in store.nodes.all()}
        back = rollback(
            [m.member for m in rollout.members], _seen(store, rollout, nodes, back=True),
            now=now, offline_after_s=settings.fleet.offline_after_s, finished_by=by,
        )  # fmt: skip
        reason = f"{rollout.reason}; rollback finished by {by}"
        if back.unconfirmed:
            reason += f"; never confirmed: {', '.join(back.unconfirmed)}"
        if _end_rollback(store, rollout, back.members, reason):
            log.info("rollout %s: rollback finished by %s", rollout.id, by)
            return store.rollouts.get(rollout_id)
    raise RolloutConflictError(f"rollout {rollout_id} kept changing: finish it again")


def take_step(
    store: HubStore, settings: HubSettings, rollout_id: str, action: str, *, by: str, now: float
) -> Rollout:
    """One of the operator's steps (`STEPS`) on a rollout, by `by` (on the store's thread):
    the one call of the operator API, the console and `kvl hub rollouts`."""
    state, allowed, done = STEPS[action]
    if action == "finish":
        return finish(store, settings, rollout_id, by=by, now=now)
    return store.rollouts.set_state(rollout_id, state, f"{done} by {by}", allowed=allowed)


async def rollouts_forever(store: AsyncHubStore, settings: HubSettings, loops: Failures) -> None:
    """The rollout loop: a round every `fleet.rollout_every_s`, under the loops' guard."""

    async def once() -> None:
        await store.run(evaluate, store.sync, settings, time.time())

    await loops.forever("rollouts", once, settings.fleet.rollout_every_s)


# -- views -------------------------------------------------------------------------------------


def phase(rollout: Rollout) -> str:
    """Where a rollout is, for people: pending, canary, wave N, paused at …, done, …"""
    at = "canary" if rollout.wave == 0 else f"wave {rollout.wave}"
    if rollout.state == "running":
        return at
    if rollout.state in {"paused", "halted"}:
        return f"{rollout.state} at {at}"
    return rollout.state


def release_view(release: Release, nodes: int) -> dict[str, Any]:
    """A release and how many nodes run it (or were given it)."""
    return {**asdict(release), "nodes": nodes}


def rollout_view(
    rollout: Rollout, nodes: Mapping[str, Node], settings: HubSettings, now: float
) -> dict[str, Any]:
    """A rollout with each wave's nodes and what each last reported."""
    waves: dict[int, list[dict[str, Any]]] = {}
    for stored in rollout.members:
        m = stored.member
        node = nodes.get(m.node_id)
        report: dict[str, Any] = {"status": "gone" if node is None else "unknown"}
        if node is not None:
            image = node.capacity.image
            report = {
                "status": status_of(node, settings.fleet, now).value,
                "image": None if image is None else image.model_dump(mode="json"),
                "models": list(node.capacity.models),
                "release_error": node.capacity.release_error,
            }
        waves.setdefault(m.wave, []).append(
            {
                "id": m.node_id,
                "name": m.name,
                "state": m.state,
                "note": m.note,
                "previous": stored.previous,
                "targeted_at": m.targeted_at,
                "healthy_since": m.healthy_since,
                **report,
            }
        )
    return {
        "id": rollout.id,
        "kind": rollout.kind,
        "target": rollout.target,
        "state": rollout.state,
        "phase": phase(rollout),
        "wave": rollout.wave,
        "reason": rollout.reason,
        "strategy": _strategy_view(rollout.strategy),
        "created_by": rollout.created_by,
        "created_at": rollout.created_at,
        "updated_at": rollout.updated_at,
        "waves": [
            {
                "wave": i,
                "name": "canary" if i == 0 else f"wave {i}",
                "updated": sum(1 for n in members if n["state"] == "updated"),
                "nodes": members,
            }
            for i, members in sorted(waves.items())
        ],
    }


def _strategy_view(strategy: Strategy) -> dict[str, Any]:
    return {
        "canary": strategy.canary,
        "canary_nodes": list(strategy.canary_nodes),
        "waves": list(strategy.waves),
        "sites": [list(s) for s in strategy.sites],
        "soak_s": strategy.soak_s,
        "max_unavailable": strategy.max_unavailable,
        "offline_after_s": strategy.offline_after_s,
        "max_burn_rate": strategy.max_burn_rate,
        "min_requests": strategy.min_requests,
        "min_score": strategy.min_score,
    }
