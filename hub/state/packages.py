"""Content packages known to the fleet (reported by nodes, or uploaded to the hub), the
copies each node holds, and the archives the hub seeds to nodes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hub.state.base import NotFoundError, StoreBase
from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hub.state.nodes import Node


@dataclass(frozen=True)
class PackageRecord:
    """A content package known to the fleet: reported by a node, or uploaded here."""

    id: str
    version: str
    title: str
    topic: str
    level: str
    items: int
    size: int
    digest: str
    lineage: dict[str, Any]
    origin_node: str | None  # the node that made it (None: uploaded to the hub)
    created_at: str
    received_at: float
    bundle_sha256: str | None  # the archive the hub holds to seed it (None: not held)
    bundle_size: int | None
    nodes: list[str]  # the nodes that hold it, as they last reported
    seeded_to: str | None  # "*" every node, a site, or None: not seeded


def package_of(row: Mapping[str, Any], nodes: list[str]) -> PackageRecord:
    return PackageRecord(
        id=row["id"],
        version=row["version"],
        title=row["title"],
        topic=row["topic"],
        level=row["level"],
        items=row["items"],
        size=row["size"],
        digest=row["digest"],
        lineage=json.loads(row["lineage"]),
        origin_node=row["origin_node"],
        created_at=row["created_at"],
        received_at=row["received_at"],
        bundle_sha256=row["bundle_sha256"],
        bundle_size=row["bundle_size"],
        nodes=sorted(nodes),
        seeded_to=None if row["seeded_at"] is None else (row["seed_site"] or "*"),
    )


class PackagesMixin(StoreBase):
    """The `packages`, `package_copies` and `package_seeds` tables."""

    def _upsert_package(
        self, summary: Mapping[str, Any], *, origin_node: str | None, now: float
    ) -> None:
        """Record a package version the first time it is heard of; later reports (another
        node's copy, an upload) keep the first origin."""
        self.db.execute(
            "INSERT INTO packages (id, version, title, topic, level, items, size, digest,"
            " lineage, origin_node, created_at, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?,"
            " ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [str(summary["id"]), str(summary["version"]), str(summary["title"]),
             str(summary["topic"]), str(summary["level"]), int(summary["items"]),
             int(summary["size"]), str(summary["digest"]), json.dumps(summary["lineage"]),
             origin_node, str(summary["created_at"]), now],
        )  # fmt: skip

    def add_package_bundle(self, summary: Mapping[str, Any], sha256: str, size: int) -> None:
        """The hub now holds this package's archive (to seed it to nodes)."""
        with self.db.transaction():
            self._upsert_package(summary, origin_node=None, now=self.clock())
            self.db.execute(
                "UPDATE packages SET bundle_sha256 = ?, bundle_size = ? WHERE id = ? AND"
                " version = ?",
                [sha256, size, summary["id"], summary["version"]],
            )

    def packages(self, query: str | None = None, limit: int = 200) -> list[PackageRecord]:
        """Packages known to the fleet, newest first, with the nodes that hold each."""
        needle = f"%{(query or '').casefold()}%"
        rows = self.db.query(
            "SELECT p.*, s.site AS seed_site, s.created_at AS seeded_at"
            " FROM packages p LEFT JOIN package_seeds s ON s.package_id = p.id AND"
            " s.version = p.version WHERE lower(p.id || ' ' || p.title || ' ' || p.topic)"
            " LIKE ? ORDER BY p.created_at DESC, p.id LIMIT ?",
            [needle, limit],
        )
        holders: dict[tuple[str, str], list[str]] = {}
        if rows:
            marks = ",".join("?" * len(rows))
            copies = self.db.execute(
                "SELECT package_id, version, node_id FROM package_copies"  # noqa: S608 - placeholders only
                f" WHERE package_id IN ({marks}) ORDER BY node_id",
                sorted({r["id"] for r in rows}),
            )
            for package_id, version, node_id in copies:
                holders.setdefault((package_id, version), []).append(node_id)
        return [package_of(r, holders.get((r["id"], r["version"]), [])) for r in rows]

    def seed_package(self, package_id: str, version: str | None, site: str | None) -> int:
        """Seed a package version (the newest held when None) to every node, or to the
        nodes of ``site``; the new serial. NotFoundError when the hub holds no archive."""
        with self.db.transaction():
            row = self.db.execute(
                "SELECT version FROM packages WHERE id = ? AND (CAST(? AS TEXT) IS NULL OR"
                " version = ?) AND"
                " bundle_sha256 IS NOT NULL ORDER BY created_at DESC LIMIT 1",
                [package_id, version, version],
            ).fetchone()
            if row is None:
                raise NotFoundError(
                    f"the hub holds no archive of {package_id}"
                    + (f"@{version}" if version else "")
                    + "; add one with `kvl hub packages add FILE`"
                )
            self.db.execute(
                "INSERT INTO package_seeds (package_id, version, site, created_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (package_id, version) DO UPDATE SET"
                " site = excluded.site",
                [package_id, row[0], site, self.clock()],
            )
            return self._bump()

    def unseed_package(self, package_id: str, version: str | None) -> int:
        with self.db.transaction():
            gone = self.db.execute(
                "DELETE FROM package_seeds WHERE package_id = ? AND"
                " (CAST(? AS TEXT) IS NULL OR version = ?)",
                [package_id, version, version],
            ).rowcount
            if not gone:
                raise NotFoundError(f"{package_id} is not seeded")
            return self._bump()

    def seeded_packages(self, node: Node) -> list[protocol.SeededPackage]:
        """The package archives seeded to ``node`` (all nodes, or its site)."""
        rows = self.db.execute(
            "SELECT p.id, p.version, p.bundle_sha256, p.bundle_size FROM package_seeds s"
            " JOIN packages p ON p.id = s.package_id AND p.version = s.version"
            " WHERE p.bundle_sha256 IS NOT NULL AND (s.site IS NULL OR s.site = ?)"
            " ORDER BY p.id, p.version",
            [node.site],
        ).fetchall()
        return [protocol.SeededPackage(id=r[0], version=r[1], sha256=r[2], size=r[3]) for r in rows]
