"""Staged rollouts, as pure decisions: which wave each node is in, and, from what the nodes
report, what the next round of a rollout does (target more nodes, count one updated,
advance a wave, finish, or halt with a reason). The rollout loop (hub/rollouts.py) reads the
snapshot, calls `step`, and writes what it answers; nothing here reads a clock or a
database.

The shape follows the tools that do this well: a canary first, then waves by share of the
fleet or by site (Mender's phases), at most `max_unavailable` nodes changing at once
(Kubernetes), each wave promoted only while what the nodes report stays healthy for a
soak time (Argo Rollouts, Flagger), and, past them, gated on the service's own objectives
measured on the wave's nodes (their error budget's burn rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from hub.planning.health import seen_within

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# A rollout's states: pending (made, not yet evaluated) → running (canary, then wave N) →
# done; paused by the operator; halted by a failing node (with the reason); aborted:
# rolling back, then aborted once the nodes it reached report their previous target again,
# or are offline, or the operator finishes the rollback (`rollback`).
RolloutState = Literal["pending", "running", "paused", "halted", "rolling-back", "aborted", "done"]
ACTIVE: tuple[RolloutState, ...] = ("pending", "running", "paused", "halted", "rolling-back")
# The operator's steps: the state each leads to, the states it is taken from, and how a
# rollout's reason says it.
STEPS: dict[str, tuple[RolloutState, tuple[RolloutState, ...], str]] = {
    "pause": ("paused", ("pending", "running"), "paused"),
    "resume": ("running", ("paused", "halted"), "resumed"),
    "abort": ("rolling-back", ("pending", "running", "paused", "halted"), "aborted"),
    # Ends a rollback that waits on nodes which never report back (hub/rollouts.py's
    # `finish`: it records them; the others' steps only move the state).
    "finish": ("aborted", ("rolling-back",), "finished"),
}

# A member of a rollout: waiting for its wave; targeted (given the new target, not yet
# healthy for the soak time); updated; failed (it reported so; the rollout halted);
# skipped (it left: revoked, or no longer holds a replica of the deployment); unconfirmed
# (the rollout was rolled back without it reporting its previous target: it was offline,
# or the operator finished the rollback; the note says which).
MemberState = Literal["waiting", "targeted", "updated", "failed", "skipped", "unconfirmed"]
# What a node reports of a target: not there yet, there and healthy, failed to get there,
# went back from it, or no longer concerned (see MemberState's `skipped`).
Report = Literal["pending", "healthy", "failed", "rolled-back", "gone"]


@dataclass(frozen=True)
class Strategy:
    """How a rollout moves (the operator's `strategy`, checked by hub/api/requests.py)."""

    canary: int = 1  # nodes in the canary wave (when `canary_nodes` names none)
    canary_nodes: tuple[str, ...] = ()  # the canary's nodes, by name or id
    waves: tuple[float, ...] = (100.0,)  # cumulative shares of the rollout's nodes, in %
    sites: tuple[tuple[str, ...], ...] = ()  # or: the sites of each wave, in order
    soak_s: float = 300.0  # how long a node must report healthy to count as updated
    max_unavailable: int = 1  # nodes changing at once
    offline_after_s: float = 300.0  # a node of the wave unheard this long halts it
    max_burn_rate: float | None = 14.4  # a node of the wave burning faster halts it
    min_requests: int = 20  # what a node must have served before its burn rate counts
    # A model rollout: instructions of the node's evaluation the new model must follow
    # (None: not gated); a node's score below it halts the rollout.
    min_score: int | None = None


@dataclass(frozen=True)
class Candidate:
    """A node a rollout may reach."""

    id: str
    name: str
    site: str


def assign_waves(strategy: Strategy, candidates: Sequence[Candidate]) -> dict[str, int]:
    """Each candidate's wave: 0 the canary, then 1, 2, …; every candidate is in one.

    By site, wave i+1 holds the nodes of `sites[i]`, and nodes of sites not named come
    last; by share, wave i+1 fills the rollout up to `waves[i]` % of its nodes (rounded
    up), and the last wave takes the rest whatever its share says."""
    ordered = sorted(candidates, key=lambda c: (c.name, c.id))
    named = set(strategy.canary_nodes)
    if named:
        canary = [c for c in ordered if c.name in named or c.id in named]
    else:
        canary = ordered[: strategy.canary]
    waves = {c.id: 0 for c in canary}
    rest = [c for c in ordered if c.id not in waves]
    if strategy.sites:
        for i, group in enumerate(strategy.sites, start=1):
            for c in rest:
                if c.site in group and c.id not in waves:
                    waves[c.id] = i
        last = len(strategy.sites) + 1
        for c in rest:
            waves.setdefault(c.id, last)
        return waves
    total = len(ordered)
    placed = len(canary)
    for i, share in enumerate(strategy.waves, start=1):
        upto = total if i == len(strategy.waves) else math.ceil(total * share / 100)
        for c in rest:
            if placed >= upto:
                break
            if c.id not in waves:
                waves[c.id] = i
                placed += 1
    for c in rest:  # shares that stop short of 100: the rest in the last wave
        waves.setdefault(c.id, len(strategy.waves))
    return waves


@dataclass(frozen=True)
class Member:
    node_id: str
    name: str
    wave: int
    state: MemberState = "waiting"
    targeted_at: float | None = None
    healthy_since: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Seen:
    """What the hub knows of a member's node this round."""

    report: Report
    detail: str = ""  # what the node said of a failure or a rollback
    last_seen: float | None = None
    burn_rate: float | None = None  # the worst of its objectives in the wave (None: too few)


@dataclass(frozen=True)
class Step:
    """What a round decided: the members as they now are, the wave, and whether the
    rollout finished or halted (with why)."""

    members: list[Member]
    wave: int
    wave_started_at: float
    done: bool = False
    halted: str | None = None
    changed: list[str] = field(default_factory=list)  # members whose state moved


def last_wave(members: Sequence[Member]) -> int:
    return max((m.wave for m in members), default=0)


def step(
    strategy: Strategy,
    members: Sequence[Member],
    seen: Mapping[str, Seen],
    *,
    wave: int,
    wave_started_at: float,
    now: float,
) -> Step:
    """One round of a running rollout at `wave`: the members it reached judged, then
    more of the wave reached (at most `max_unavailable` changing at once), or the next
    wave begun once every member of this one is updated."""
    book = _Book({m.node_id: m for m in members})
    halted = _judge(strategy, members, seen, book, wave=wave, now=now)
    if halted is not None:
        return Step(book.members(), wave, wave_started_at, halted=halted, changed=book.changed)
    final = last_wave(members)
    while True:
        current = [m.node_id for m in members if m.wave == wave]
        waiting = sorted(
            (book.out[n] for n in current if book.out[n].state == "waiting"), key=lambda m: m.name
        )
        for m in waiting:
            if seen.get(m.node_id, Seen("pending")).report == "gone":
                book.put(replace(m, state="skipped", note="left the rollout"))
        waiting = [m for m in waiting if book.out[m.node_id].state == "waiting"]
        in_flight = sum(1 for n in current if book.out[n].state == "targeted")
        for m in waiting[: max(0, strategy.max_unavailable - in_flight)]:
            book.put(replace(m, state="targeted", targeted_at=now, healthy_since=None))
        if any(book.out[n].state in {"waiting", "targeted"} for n in current):
            return Step(book.members(), wave, wave_started_at, changed=book.changed)
        if wave >= final:
            return Step(book.members(), wave, wave_started_at, done=True, changed=book.changed)
        wave, wave_started_at = wave + 1, now  # this wave is through: on to the next


@dataclass
class _Book:
    """The members as a round changes them, and which it changed."""

    out: dict[str, Member]
    changed: list[str] = field(default_factory=list)

    def put(self, member: Member) -> None:
        if self.out[member.node_id] != member:
            self.out[member.node_id] = member
            self.changed.append(member.node_id)

    def members(self) -> list[Member]:
        return list(self.out.values())


def _judge(
    strategy: Strategy,
    members: Sequence[Member],
    seen: Mapping[str, Seen],
    book: _Book,
    *,
    wave: int,
    now: float,
) -> str | None:
    """The members reached so far judged from what their nodes report: failed ones
    marked (the first one's reason halts the rollout: returned), healthy ones counted
    updated after `soak_s` without a break."""
    halted: str | None = None
    for m in sorted(members, key=lambda m: (m.wave, m.name)):
        if m.state not in {"targeted", "updated"}:
            continue
        s = seen.get(m.node_id, Seen("pending"))
        if s.report == "gone":
            book.put(replace(m, state="skipped", note="left the rollout"))
            continue
        why = _failure(strategy, m, s, current=m.wave == wave, now=now)
        if why is not None:
            book.put(replace(m, state="failed", note=why))
            halted = halted or f"node {m.name}: {why}"
        elif m.state == "targeted" and s.report == "healthy":
            since = m.healthy_since if m.healthy_since is not None else now
            soaked = now - since >= strategy.soak_s
            book.put(replace(m, state="updated" if soaked else "targeted", healthy_since=since))
        elif m.state == "targeted" and m.healthy_since is not None:
            book.put(replace(m, healthy_since=None))  # not healthy again: the soak starts over
    return halted


def _failure(strategy: Strategy, m: Member, s: Seen, *, current: bool, now: float) -> str | None:
    """Why a targeted or updated member halts the rollout, or None. A failure or a rollback
    counts in any wave; silence and a burning budget in the current wave only."""
    if s.report == "failed":
        return f"failed to update{': ' + s.detail if s.detail else ''}"
    if s.report == "rolled-back":
        return f"rolled back{': ' + s.detail if s.detail else ''}"
    if not current:
        return None
    since = s.last_seen if s.last_seen is not None else m.targeted_at
    if since is not None and now - since >= strategy.offline_after_s:
        return f"offline: not heard for {now - since:.0f} s"
    limit = strategy.max_burn_rate
    if limit is not None and s.burn_rate is not None and s.burn_rate > limit:
        return f"burns its error budget {s.burn_rate:.1f}x (the limit is {limit:g}x)"
    return None


@dataclass(frozen=True)
class Rollback:
    """What a round of a rolling-back rollout decided: whether it is over, the members as
    they now are, and the names of those that never confirmed (marked `unconfirmed`)."""

    done: bool
    members: list[Member]
    unconfirmed: list[str] = field(default_factory=list)


def rollback(
    members: Sequence[Member],
    seen: Mapping[str, Seen],
    *,
    now: float,
    offline_after_s: float,
    finished_by: str | None = None,
) -> Rollback:
    """One round of an aborted rollout (`seen`: what each node reports of its previous
    target). Each member it had reached holds the rollback open until its node reports
    that target healthy or leaves; except while the node is offline (unheard for
    `offline_after_s`, the fleet's window: the registry's own notion, so the rollback stops
    waiting exactly when the node shows as offline), and except when the operator
    finishes it (`finished_by`): then no member holds it open. A node that never reports
    back would otherwise keep it rolling back, and every release rollout refused, forever.

    Once none holds it open the rollback is done, and the members that never confirmed
    are marked `unconfirmed` with why. Their nodes keep their previous target, so one that
    returns is given what the rest went back to, not the aborted target."""
    open_on: list[str] = []
    marks: dict[str, str] = {}
    for m in members:
        if m.state in {"waiting", "skipped", "unconfirmed"}:
            continue
        s = seen.get(m.node_id, Seen("pending"))
        if s.report in {"healthy", "gone"}:
            continue
        if not seen_within(s.last_seen, now, offline_after_s):
            heard = "never heard" if s.last_seen is None else (
                f"not heard for {now - s.last_seen:.0f} s"
            )  # fmt: skip
            marks[m.node_id] = f"offline, {heard}"
        elif finished_by is not None:
            said = f" ({s.report}{': ' + s.detail if s.detail else ''})"
            marks[m.node_id] = f"the rollback was finished by {finished_by}" + (
                said if s.report != "pending" else ""
            )
        else:
            open_on.append(m.node_id)
    if open_on:
        return Rollback(done=False, members=list(members))
    out = []
    for m in members:
        why = marks.get(m.node_id)
        if why is None:
            out.append(m)
            continue
        before = f"; before: {m.note}" if m.note else ""
        out.append(replace(m, state="unconfirmed", note=f"never confirmed: {why}{before}"))
    unconfirmed = sorted(m.name for m in members if m.node_id in marks)
    return Rollback(done=True, members=out, unconfirmed=unconfirmed)
