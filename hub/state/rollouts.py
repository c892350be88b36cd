"""Image releases, the sites' update windows, and staged rollouts of a release, of a
deployment's new model, or of a node setting (hub/planning/rollout.py decides;
hub/rollouts.py runs them).

What a rollout gives a node is written where the desired state reads it: a release as the
node's row in `node_releases`, a model as the node's row in `placement_models` (which
overrides the deployment's model for that one placement), a setting as the rollout's own
member row (hub/state/configuration.py reads the changes of the settings rollouts that
reached a node; done, the setting is written to `node_settings`). Nodes a rollout has not
reached never see its target; each change moves the desired serial."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from hub.planning.rollout import ACTIVE, Member, RolloutState, Strategy
from hub.state.errors import ConflictError, NotFoundError
from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from hub.state import sql
    from hub.state.nodes import Node
    from hub.state.serials import Serials

RolloutKind = Literal["release", "model", "settings"]


class RolloutConflictError(ConflictError):
    """A release that exists already, a second rollout of the same thing, or a step the
    rollout cannot take in its state."""


@dataclass(frozen=True)
class Release:
    version: str
    notes: str
    sha256: str
    size_bytes: int
    created_at: float


@dataclass(frozen=True)
class Rollout:
    id: str
    kind: RolloutKind
    # A release: {"release": VERSION}; a model: {"deployment": ID, "model": NAME@VERSION,
    # "from": the deployment's model when it started}; a setting: {"scope": SCOPE, "key":
    # KEY, "value": VALUE} (hub/state/configuration.py).
    target: dict[str, str]
    strategy: Strategy
    state: RolloutState
    wave: int  # 0 the canary, then 1, 2, …
    wave_started_at: float
    reason: str  # why it halted, or how it ended
    created_by: str
    created_at: float
    updated_at: float
    members: list[RolloutMember]


@dataclass(frozen=True)
class RolloutMember:
    """A member as stored: the planner's `Member`, and the target it had before."""

    member: Member
    previous: str | None  # the release version or model ref it had before it was reached


def _strategy_of(text: str) -> Strategy:
    raw = json.loads(text)
    raw["canary_nodes"] = tuple(raw.get("canary_nodes", ()))
    raw["waves"] = tuple(raw.get("waves", (100.0,)))
    raw["sites"] = tuple(tuple(s) for s in raw.get("sites", ()))
    return Strategy(**raw)


class Rollouts:
    """The `releases`, `update_windows`, `node_releases`, `placement_models`, `rollouts`
    and `rollout_nodes` tables."""

    def __init__(
        self, database: sql.Database, clock: Callable[[], float], serials: Serials
    ) -> None:
        self._db = database
        self._clock = clock
        self._serials = serials

    # -- releases ----------------------------------------------------------------------------

    def add_release(self, version: str, notes: str, sha256: str, size_bytes: int) -> Release:
        added = self._db.execute(
            "INSERT INTO releases (version, notes, sha256, size_bytes, created_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [version, notes, sha256, size_bytes, self._clock()],
        ).rowcount
        if added == 0:
            raise RolloutConflictError(f"release {version} exists already")
        return self.release(version)

    def releases(self) -> list[Release]:
        rows = self._db.execute(
            "SELECT version, notes, sha256, size_bytes, created_at FROM releases"
            " ORDER BY created_at DESC, version"
        ).fetchall()
        return [Release(*r) for r in rows]

    def release(self, version: str) -> Release:
        row = self._db.execute(
            "SELECT version, notes, sha256, size_bytes, created_at FROM releases WHERE version = ?",
            [version],
        ).fetchone()
        if row is None:
            raise NotFoundError(f"no release {version!r}", param="version")
        return Release(*row)

    def release_nodes(self, version: str) -> dict[str, str | None]:
        """The nodes given this release as their target, and the rollout that did."""
        rows = self._db.execute(
            "SELECT node_id, rollout_id FROM node_releases WHERE version = ?", [version]
        ).fetchall()
        return {r[0]: r[1] for r in rows}

    def set_update_window(self, site: str, window: protocol.UpdateWindow | None) -> int:
        """A site's update window (None: any time); the new serial."""
        with self._db.transaction():
            self._db.execute("DELETE FROM update_windows WHERE site = ?", [site])
            if window is not None:
                self._db.execute(
                    "INSERT INTO update_windows (site, start_min, end_min) VALUES (?, ?, ?)",
                    [site, window.start_min, window.end_min],
                )
            return self._serials.bump()

    def update_windows(self) -> dict[str, protocol.UpdateWindow]:
        rows = self._db.execute("SELECT site, start_min, end_min FROM update_windows").fetchall()
        return {r[0]: protocol.UpdateWindow(start_min=r[1], end_min=r[2]) for r in rows}

    def set_bandwidth(self, site: str, bytes_per_s: int | None) -> None:
        """A site's bandwidth for the files its nodes fetch (None: as fast as they can)."""
        with self._db.transaction():
            self._db.execute("DELETE FROM site_bandwidth WHERE site = ?", [site])
            if bytes_per_s is not None:
                self._db.execute(
                    "INSERT INTO site_bandwidth (site, bytes_per_s) VALUES (?, ?)",
                    [site, bytes_per_s],
                )

    def bandwidth_of(self, site: str) -> int | None:
        row = self._db.execute(
            "SELECT bytes_per_s FROM site_bandwidth WHERE site = ?", [site]
        ).fetchone()
        return None if row is None else int(row[0])

    def bandwidths(self) -> dict[str, int]:
        rows = self._db.execute("SELECT site, bytes_per_s FROM site_bandwidth").fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def window_of(self, site: str) -> protocol.UpdateWindow | None:
        """A site's update window (None: any time)."""
        row = self._db.execute(
            "SELECT start_min, end_min FROM update_windows WHERE site = ?", [site]
        ).fetchone()
        return None if row is None else protocol.UpdateWindow(start_min=row[0], end_min=row[1])

    def release_target(self, node: Node) -> protocol.ReleaseTarget | None:
        """The release ``node`` should run, for its desired state."""
        row = self._db.execute(
            "SELECT r.version, r.sha256, r.size_bytes, w.start_min, w.end_min"
            " FROM node_releases n JOIN releases r ON r.version = n.version"
            " LEFT JOIN update_windows w ON w.site = ? WHERE n.node_id = ?",
            [node.site, node.id],
        ).fetchone()
        if row is None:
            return None
        window = None if row[3] is None else protocol.UpdateWindow(start_min=row[3], end_min=row[4])
        return protocol.ReleaseTarget(
            version=row[0], sha256=row[1], size_bytes=row[2], window=window
        )

    # -- rollouts ----------------------------------------------------------------------------

    def start(
        self,
        kind: RolloutKind,
        target: Mapping[str, str],
        *,
        strategy: Strategy,
        waves: Mapping[str, int],
        previous: Mapping[str, str | None],
        names: Mapping[str, str],
        created_by: str,
    ) -> Rollout:
        """Record a rollout with its members (`waves`: node id → wave) and what each had
        before; RolloutConflictError while another of the same release kind, or of the
        same deployment, is active."""
        rollout_id = uuid.uuid4().hex[:12]
        now = self._clock()
        with self._db.transaction():
            for other in self._active(kind):
                if kind != "model" or other.target.get("deployment") == target.get("deployment"):
                    raise RolloutConflictError(_busy(other))
            self._db.execute(
                "INSERT INTO rollouts (id, kind, target, strategy, state, wave, wave_started_at,"
                " reason, created_by, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, 'pending', 0, ?, '', ?, ?, ?)",
                [rollout_id, kind, json.dumps(dict(target)), json.dumps(asdict(strategy)),
                 now, created_by, now, now],
            )  # fmt: skip
            self._db.executemany(
                "INSERT INTO rollout_nodes (rollout_id, node_id, name, wave, state, previous,"
                " note) VALUES (?, ?, ?, ?, 'waiting', ?, '')",
                [(rollout_id, node_id, names.get(node_id, node_id), wave, previous.get(node_id))
                 for node_id, wave in sorted(waves.items())],
            )  # fmt: skip
        return self.get(rollout_id)

    def _active(self, kind: RolloutKind) -> list[Rollout]:
        marks = ",".join("?" * len(ACTIVE))
        rows = self._db.execute(
            f"SELECT id FROM rollouts WHERE kind = ? AND state IN ({marks})",  # noqa: S608 - placeholders only
            [kind, *ACTIVE],
        ).fetchall()
        return [self.get(r[0]) for r in rows]

    def all(self, *, active_only: bool = False) -> list[Rollout]:
        if active_only:
            marks = ",".join("?" * len(ACTIVE))
            rows = self._db.execute(
                f"SELECT id FROM rollouts WHERE state IN ({marks}) ORDER BY created_at",  # noqa: S608 - placeholders only
                list(ACTIVE),
            ).fetchall()
        else:
            rows = self._db.execute(
                "SELECT id FROM rollouts ORDER BY created_at DESC LIMIT 200"
            ).fetchall()
        return [self.get(r[0]) for r in rows]

    def get(self, rollout_id: str) -> Rollout:
        row = self._db.query("SELECT * FROM rollouts WHERE id = ?", [rollout_id])
        if not row:
            raise NotFoundError(f"no rollout {rollout_id!r}")
        r = row[0]
        members = [
            RolloutMember(
                Member(
                    node_id=m["node_id"],
                    name=m["name"],
                    wave=int(m["wave"]),
                    state=m["state"],
                    targeted_at=m["targeted_at"],
                    healthy_since=m["healthy_since"],
                    note=m["note"] or "",
                ),
                m["previous"],
            )
            for m in self._db.query(
                "SELECT * FROM rollout_nodes WHERE rollout_id = ? ORDER BY wave, name",
                [rollout_id],
            )
        ]
        return Rollout(
            id=r["id"],
            kind=r["kind"],
            target=json.loads(r["target"]),
            strategy=_strategy_of(r["strategy"]),
            state=r["state"],
            wave=int(r["wave"]),
            wave_started_at=float(r["wave_started_at"]),
            reason=r["reason"] or "",
            created_by=r["created_by"],
            created_at=float(r["created_at"]),
            updated_at=float(r["updated_at"]),
            members=members,
        )

    def save_round(
        self,
        rollout: Rollout,
        *,
        state: RolloutState,
        wave: int,
        wave_started_at: float,
        reason: str,
        members: Sequence[Member],
    ) -> bool:
        """Write one round of a rollout: its state, the members that moved, and the targets
        of the members it reached or finished with. Only if the rollout is still as it was
        read (another replica's round, or the operator, may have moved it): False then."""
        now = self._clock()
        by_id = {m.member.node_id: m for m in rollout.members}
        with self._db.transaction():
            moved = self._db.execute(
                "UPDATE rollouts SET state = ?, wave = ?, wave_started_at = ?, reason = ?,"
                " updated_at = ? WHERE id = ? AND state = ? AND updated_at = ?",
                [state, wave, wave_started_at, reason, now, rollout.id, rollout.state,
                 rollout.updated_at],
            ).rowcount  # fmt: skip
            if moved == 0:
                return False
            serial_moves = False
            for m in members:
                before = by_id.get(m.node_id)
                if before is None or before.member == m:
                    continue
                self._db.execute(
                    "UPDATE rollout_nodes SET state = ?, targeted_at = ?, healthy_since = ?,"
                    " note = ? WHERE rollout_id = ? AND node_id = ?",
                    [m.state, m.targeted_at, m.healthy_since, m.note[:2000], rollout.id,
                     m.node_id],
                )  # fmt: skip
                if before.member.state == "waiting" and m.state == "targeted":
                    self._give(rollout, m.node_id)
                    serial_moves = True
            if state == "done" and rollout.kind == "model":
                self._finish_model(rollout)
                serial_moves = True
            if state == "done" and rollout.kind == "settings":
                self._finish_settings(rollout)
                serial_moves = True
            if serial_moves:
                self._serials.bump()
        return True

    def _give(self, rollout: Rollout, node_id: str) -> None:
        """The rollout's target for one node, where its desired state reads it (a setting's:
        the member's row, now `targeted`)."""
        if rollout.kind == "settings":
            return
        if rollout.kind == "release":
            self._db.execute(
                "INSERT INTO node_releases (node_id, version, rollout_id, set_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE SET"
                " version = excluded.version, rollout_id = excluded.rollout_id,"
                " set_at = excluded.set_at",
                [node_id, rollout.target["release"], rollout.id, self._clock()],
            )
        else:
            self._db.execute(
                "INSERT INTO placement_models (deployment_id, node_id, model, rollout_id)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (deployment_id, node_id) DO UPDATE SET"
                " model = excluded.model, rollout_id = excluded.rollout_id",
                [rollout.target["deployment"], node_id, rollout.target["model"], rollout.id],
            )

    def _finish_model(self, rollout: Rollout) -> None:
        """A model rollout done: the deployment runs the new model everywhere, and the
        placements' own models go (the deployment's now says the same)."""
        deployment = rollout.target["deployment"]
        self._db.execute(
            "UPDATE deployments SET model = ? WHERE id = ?", [rollout.target["model"], deployment]
        )
        self._db.execute("DELETE FROM placement_models WHERE deployment_id = ?", [deployment])

    def _finish_settings(self, rollout: Rollout) -> None:
        """A settings rollout done: its value is the scope's, for every node of it."""
        t = rollout.target
        self._db.execute(
            "INSERT INTO node_settings (scope, key, value, set_by, set_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (scope, key) DO UPDATE SET"
            " value = excluded.value, set_by = excluded.set_by, set_at = excluded.set_at",
            [t["scope"], t["key"], t["value"], f"rollout {rollout.id}", self._clock()],
        )

    def set_state(
        self, rollout_id: str, state: RolloutState, reason: str, *, allowed: Sequence[str]
    ) -> Rollout:
        """The operator's pause, resume or abort: from one of the `allowed` states only
        (RolloutConflictError otherwise). Abort gives the members it reached their
        previous target back, at once. Resume from a halt gives the failed members
        another chance (they were halting it; the rounds judge them again)."""
        with self._db.transaction():
            rollout = self.get(rollout_id)
            if rollout.state not in allowed:
                raise RolloutConflictError(
                    f"rollout {rollout_id} is {rollout.state}: it cannot be {_verb(state)}"
                )
            self._db.execute(
                "UPDATE rollouts SET state = ?, reason = ?, updated_at = ? WHERE id = ?",
                [state, reason, self._clock(), rollout_id],
            )
            if state == "running" and rollout.state == "halted":
                self._db.execute(
                    "UPDATE rollout_nodes SET state = 'targeted', healthy_since = NULL,"
                    " targeted_at = ?, note = '' WHERE rollout_id = ? AND state = 'failed'",
                    [self._clock(), rollout_id],
                )
            if state == "rolling-back":
                self._take_back(rollout)
                self._serials.bump()
        return self.get(rollout_id)

    def _take_back(self, rollout: Rollout) -> None:
        if rollout.kind == "settings":
            return  # a rolling-back rollout's change counts for no node (configuration.py)
        if rollout.kind == "model":
            # The placements' own models go: the deployment's model (the old one) again.
            self._db.execute("DELETE FROM placement_models WHERE rollout_id = ?", [rollout.id])
            return
        for m in rollout.members:
            if m.member.state == "waiting":
                continue
            if m.previous is None:
                # Nothing to go back to that the hub holds: no release target at all (the
                # node keeps what it runs).
                self._db.execute(
                    "DELETE FROM node_releases WHERE node_id = ? AND rollout_id = ?",
                    [m.member.node_id, rollout.id],
                )
            else:
                self._db.execute(
                    "UPDATE node_releases SET version = ?, rollout_id = ?, set_at = ?"
                    " WHERE node_id = ? AND rollout_id = ?",
                    [m.previous, rollout.id, self._clock(), m.member.node_id, rollout.id],
                )

    def node_release_versions(self) -> dict[str, str]:
        """Each node's release target (node id → version)."""
        rows = self._db.execute("SELECT node_id, version FROM node_releases").fetchall()
        return {r[0]: r[1] for r in rows}


def _busy(other: Rollout) -> str:
    """Why a rollout cannot start while `other` is active, and what the operator can do."""
    what = _what(other.kind, other.target)
    if other.state == "rolling-back":
        return (
            f"rollout {other.id} is rolling back {what}: let the nodes it reached report what "
            "they had before, or finish it (the nodes that never did are recorded)"
        )
    return f"rollout {other.id} ({other.state}) is rolling out {what}: let it complete, or abort it"


def _what(kind: str, target: Mapping[str, str]) -> str:
    if kind == "release":
        return f"release {target.get('release')}"
    if kind == "settings":
        return f"{target.get('key')}={target.get('value')} ({target.get('scope')})"
    return f"{target.get('model')} to deployment {target.get('deployment')}"


def _verb(state: str) -> str:
    return {"paused": "paused", "running": "resumed", "rolling-back": "aborted"}.get(state, state)
