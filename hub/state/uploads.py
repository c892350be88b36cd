"""Model files an operator uploads to the hub in pieces (`/v1/admin/models/uploads`,
hub/api/uploads.py): each upload's name, version, size and the sha256 it should have; the
bytes so far are its part file (as many as it holds), so an upload cut off goes on from
there. Once whole and checked, its model is registered in the same transaction that marks
it done: a failed or cancelled upload registers nothing."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hub.state.errors import ConflictError, NotFoundError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from hub.state import sql
    from hub.state.deployments import Deployments, ModelArtifact

UploadState = Literal["open", "done", "failed", "cancelled"]


@dataclass(frozen=True)
class Upload:
    id: str
    name: str
    version: str
    size_bytes: int
    sha256: str | None  # what the operator says it is (None: taken as it comes)
    memory_mib: int | None
    state: UploadState
    model: str | None  # the registered model's ref, once done
    error: str | None
    created_by: str
    created_at: float
    updated_at: float


_COLUMNS = (
    "id, name, version, size_bytes, sha256, memory_mib, state, model, error, created_by,"
    " created_at, updated_at"
)


def _upload(row: Sequence[Any]) -> Upload:
    return Upload(*row)


class Uploads:
    """The `model_uploads` table."""

    def __init__(
        self, database: sql.Database, clock: Callable[[], float], deployments: Deployments
    ) -> None:
        self._db = database
        self._clock = clock
        self._deployments = deployments

    def create(
        self,
        name: str,
        version: str,
        *,
        size_bytes: int,
        sha256: str | None,
        memory_mib: int | None,
        created_by: str,
    ) -> Upload:
        """A new upload; ConflictError when the model is registered already."""
        if f"{name}@{version}" in {m.ref for m in self._deployments.models()}:
            raise ConflictError(f"model {name}@{version} is already registered")
        upload_id = secrets.token_hex(6)
        now = self._clock()
        self._db.execute(
            f"INSERT INTO model_uploads ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, 'open', NULL,"  # noqa: S608 - constant columns
            " NULL, ?, ?, ?)",
            [upload_id, name, version, size_bytes, sha256, memory_mib, created_by, now, now],
        )
        return self.get(upload_id)

    def get(self, upload_id: str) -> Upload:
        row = self._db.execute(
            f"SELECT {_COLUMNS} FROM model_uploads WHERE id = ?",  # noqa: S608 - constant columns
            [upload_id],
        ).fetchone()
        if row is None:
            raise NotFoundError(f"no upload {upload_id!r}")
        return _upload(row)

    def recent(self, limit: int = 50) -> list[Upload]:
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM model_uploads ORDER BY created_at DESC LIMIT ?",  # noqa: S608 - constant columns
            [limit],
        ).fetchall()
        return [_upload(r) for r in rows]

    def end(self, upload_id: str, state: UploadState, error: str | None = None) -> Upload:
        """An open upload failed or cancelled; ConflictError once it has ended."""
        with self._db.transaction():
            moved = self._db.execute(
                "UPDATE model_uploads SET state = ?, error = ?, updated_at = ?"
                " WHERE id = ? AND state = 'open'",
                [state, error, self._clock(), upload_id],
            ).rowcount
            if moved == 0:
                raise ConflictError(f"upload {upload_id} has ended ({self.get(upload_id).state})")
        return self.get(upload_id)

    def finish(self, upload_id: str, model: ModelArtifact) -> Upload:
        """The upload whole and checked: its model registered and the upload done, in one
        transaction. ConflictError when it ended meanwhile or the model is registered."""
        with self._db.transaction():
            moved = self._db.execute(
                "UPDATE model_uploads SET state = 'done', model = ?, updated_at = ?"
                " WHERE id = ? AND state = 'open'",
                [model.ref, self._clock(), upload_id],
            ).rowcount
            if moved == 0:
                raise ConflictError(f"upload {upload_id} has ended")
            self._deployments.add_model(model)
        return self.get(upload_id)
