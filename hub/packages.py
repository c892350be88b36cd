"""Content package archives the hub holds to seed to nodes.

An archive is one OCI image layout in a tar (shared.oci), as an appliance exports it
(`GET /v1/packages/{id}/exports/oci`). The hub checks it whole (every blob against its
digest, the package manifest readable), keeps it under its own sha256 beside the model
files, and records the package; seeding it puts it in the desired state of the chosen
nodes, which fetch it through the tunnel, check it again and pin it in their cache.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from shared.files import write_private
from shared.oci import package_summary, read_layout

if TYPE_CHECKING:
    from pathlib import Path

    from hub.state.packages import PackageRecord
    from hub.state.store import HubStore

MAX_BUNDLE = 1 << 30  # bytes; an appliance refuses bigger archives too


def keep_bundle(artifacts_dir: Path, data: bytes) -> tuple[dict[str, Any], str]:
    """Check an archive and keep it by its sha256: (the package's summary, that sha256).
    Raises shared.oci.LayoutError when it is not one intact content package."""
    summary = package_summary(read_layout(data, max_bytes=MAX_BUNDLE))
    sha256 = hashlib.sha256(data).hexdigest()
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    target = artifacts_dir / sha256
    if not target.exists():
        write_private(target, data)
    return summary, sha256


def add_bundle(store: HubStore, artifacts_dir: Path, data: bytes) -> PackageRecord:
    """``keep_bundle``, then the package recorded as held by the hub; its record."""
    summary, sha256 = keep_bundle(artifacts_dir, data)
    store.packages.add_bundle(summary, sha256, len(data))
    return next(p for p in store.packages.find(summary["id"]) if p.version == summary["version"])
