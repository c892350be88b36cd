"""Model files, the deployments of them, and where the placement reconciler put each
replica (hub/reconciler.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hub.state.errors import ConflictError, NotFoundError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from hub.state import sql
    from hub.state.serials import Serials


@dataclass(frozen=True)
class ModelArtifact:
    name: str
    version: str
    sha256: str
    size_bytes: int
    format: str
    memory_mib: int
    source: str | None = None  # the pinned reference it was pulled by (hf://…@COMMIT/…, a URL)
    license: str | None = None  # as its source states it
    inspection: Mapping[str, Any] | None = None  # what its file says (hub/models/inspect.py)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class DeploymentRecord:
    id: str
    model: str  # name@version
    replicas: int
    service_class: str
    isolation: str
    constraints: Mapping[str, Any]  # sites, regions, labels, gpu, gpu_memory_mib, tenant
    preset: Mapping[str, Any] | None = None  # its model's settings (protocol.ModelPreset)


@dataclass(frozen=True)
class Placed:
    """A model placed on a node, with the preset it is loaded with there."""

    model: ModelArtifact
    preset: Mapping[str, Any] | None


def _model(row: Sequence[Any]) -> ModelArtifact:
    """A model from its row: the columns in the order the model's fields are."""
    name, version, sha256, size_bytes, format_, memory_mib, source, license_, inspection = row
    return ModelArtifact(
        name, version, sha256, size_bytes, format_, memory_mib, source, license_,
        None if inspection is None else json.loads(inspection),
    )  # fmt: skip


class Deployments:
    """The `models`, `deployments` and `placements` tables."""

    def __init__(
        self, database: sql.Database, clock: Callable[[], float], serials: Serials
    ) -> None:
        self._db = database
        self._clock = clock
        self._serials = serials

    def add_model(self, model: ModelArtifact) -> None:
        added = self._db.execute(
            "INSERT INTO models (ref, name, version, sha256, size_bytes, format, memory_mib,"
            " created_at, source, license, inspection) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [model.ref, model.name, model.version, model.sha256, model.size_bytes,
             model.format, model.memory_mib, self._clock(), model.source, model.license,
             None if model.inspection is None else json.dumps(model.inspection)],
        ).rowcount  # fmt: skip
        if added == 0:
            raise ConflictError(f"model {model.ref} is already registered")

    def models(self) -> list[ModelArtifact]:
        rows = self._db.execute(
            "SELECT name, version, sha256, size_bytes, format, memory_mib, source, license,"
            " inspection FROM models ORDER BY ref"
        ).fetchall()
        return [_model(r) for r in rows]

    def model_by_sha256(self, sha256: str) -> ModelArtifact | None:
        row = self._db.execute(
            "SELECT name, version, sha256, size_bytes, format, memory_mib, source, license,"
            " inspection FROM models WHERE sha256 = ? LIMIT 1",
            [sha256],
        ).fetchone()
        return None if row is None else _model(row)

    def add(self, deployment: DeploymentRecord) -> int:
        """Add a deployment; the new serial (the reconciler places it within seconds)."""
        with self._db.transaction():
            if not self._db.execute(
                "SELECT 1 FROM models WHERE ref = ?", [deployment.model]
            ).fetchone():
                raise NotFoundError(
                    f"no model {deployment.model!r}; add it with `kvl hub models add`",
                    param="model",
                )
            self._db.execute(
                "INSERT INTO deployments (id, model, replicas, service_class, isolation,"
                " constraints, created_at, preset) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [deployment.id, deployment.model, deployment.replicas, deployment.service_class,
                 deployment.isolation, json.dumps(deployment.constraints), self._clock(),
                 None if deployment.preset is None else json.dumps(deployment.preset)],
            )  # fmt: skip
            return self._serials.bump()

    def remove(self, deployment_id: str) -> int:
        with self._db.transaction():
            gone = self._db.execute("DELETE FROM deployments WHERE id = ?", [deployment_id])
            if gone.rowcount == 0:
                raise NotFoundError(f"no deployment {deployment_id!r}")
            self._db.execute("DELETE FROM placements WHERE deployment_id = ?", [deployment_id])
            self._db.execute(
                "DELETE FROM placement_models WHERE deployment_id = ?", [deployment_id]
            )
            return self._serials.bump()

    def all(self) -> list[DeploymentRecord]:
        rows = self._db.execute(
            "SELECT id, model, replicas, service_class, isolation, constraints, preset"
            " FROM deployments ORDER BY created_at, id"
        ).fetchall()
        return [
            DeploymentRecord(
                r[0], r[1], int(r[2]), r[3], r[4], json.loads(r[5]),
                None if r[6] is None else json.loads(r[6]),
            )
            for r in rows
        ]  # fmt: skip

    def placements(self) -> list[tuple[str, str, int | None]]:
        """(deployment id, node id, GPU index or None) of every replica placed."""
        rows = self._db.execute(
            "SELECT deployment_id, node_id, gpu FROM placements ORDER BY deployment_id, node_id"
        ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    def apply_placements(self, wanted: Iterable[tuple[str, str, int | None]]) -> bool:
        """Make the placements exactly `wanted` (the planner's answer); True when that
        changed anything (the desired state's serial then moves, so nodes converge).

        Every replica runs the reconciler: the serial's row, locked first, lets one apply
        at a time, and each compares with the placements as the one before left them."""
        target = set(wanted)
        with self._db.transaction():
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES ('desired_serial', '0')"
                " ON CONFLICT DO NOTHING"
            )
            self._db.execute(
                f"SELECT value FROM meta WHERE key = 'desired_serial'{self._db.for_update}"  # noqa: S608 - a constant
            ).fetchall()
            current = set(self.placements())
            if current == target:
                return False
            self._db.executemany(
                "DELETE FROM placements WHERE deployment_id = ? AND node_id = ?",
                sorted((d, n) for d, n, _ in current - target),
            )
            now = self._clock()
            self._db.executemany(
                "INSERT INTO placements (deployment_id, node_id, gpu, created_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (deployment_id, node_id) DO UPDATE SET"
                " gpu = excluded.gpu",
                [(d, n, g, now) for d, n, g in sorted(target - current, key=str)],
            )
            self._serials.bump()
            return True

    def site_peers(self, node_id: str, site: str) -> list[tuple[str, str, str | None]]:
        """The other nodes of `site` (not revoked) that hold placements of the models placed
        on `node_id`, as (the model's sha256, the peer's id, its last capacity as stored):
        where the node can fetch those files within its site (protocol 10)."""
        placed = (
            "SELECT p.node_id, m.sha256 FROM placements p"
            " JOIN deployments d ON d.id = p.deployment_id"
            " LEFT JOIN placement_models o ON o.deployment_id = p.deployment_id"
            " AND o.node_id = p.node_id"
            " JOIN models m ON m.ref = COALESCE(o.model, d.model)"
        )
        rows = self._db.execute(
            f"SELECT DISTINCT theirs.sha256, n.id, n.capacity FROM ({placed}) theirs"  # noqa: S608 - no input in it
            f" JOIN ({placed}) mine ON mine.sha256 = theirs.sha256 AND mine.node_id = ?"
            " JOIN nodes n ON n.id = theirs.node_id"
            " WHERE n.site = ? AND n.id <> ? AND n.revoked_at IS NULL"
            " ORDER BY theirs.sha256, n.id",
            [node_id, site, node_id],
        ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    def placed_models(self, node_id: str) -> list[Placed]:
        """The models placed on a node, for its desired state: each placement's
        deployment's model, or the one a model rollout gave that placement
        (`placement_models`, hub/state/rollouts.py), with its deployment's preset. A model
        two deployments place on one node is loaded once, with the older one's preset."""
        rows = self._db.execute(
            "SELECT m.name, m.version, m.sha256, m.size_bytes, m.format, m.memory_mib,"
            " d.preset FROM placements p JOIN deployments d ON d.id = p.deployment_id"
            " LEFT JOIN placement_models o ON o.deployment_id = p.deployment_id"
            " AND o.node_id = p.node_id"
            " JOIN models m ON m.ref = COALESCE(o.model, d.model) WHERE p.node_id = ?"
            " ORDER BY m.ref, d.created_at, d.id",
            [node_id],
        ).fetchall()
        placed: dict[str, Placed] = {}
        for r in rows:
            model = ModelArtifact(*r[:6])
            if model.ref not in placed:
                placed[model.ref] = Placed(model, None if r[6] is None else json.loads(r[6]))
        return list(placed.values())
