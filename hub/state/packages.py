"""Content packages known to the fleet (reported by nodes, or uploaded to the hub), the
copies each node holds, and the archives the hub seeds to nodes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hub.state.errors import NotFoundError
from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from hub.state import sql
    from hub.state.nodes import Node
    from hub.state.serials import Serials


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


class Packages:
    """The `packages`, `package_copies` and `package_seeds` tables."""

    def __init__(
        self, database: sql.Database, clock: Callable[[], float], serials: Serials
    ) -> None:
        self._db = database
        self._clock = clock
        self._serials = serials

    def _record(self, summary: Mapping[str, Any], *, origin_node: str | None, now: float) -> None:
        """Record a package version the first time it is heard of; later reports (another
        node's copy, an upload) keep the first origin."""
        self._db.execute(
            "INSERT INTO packages (id, version, title, topic, level, items, size, digest,"
            " lineage, origin_node, created_at, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?,"
            " ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [str(summary["id"]), str(summary["version"]), str(summary["title"]),
             str(summary["topic"]), str(summary["level"]), int(summary["items"]),
             int(summary["size"]), str(summary["digest"]), json.dumps(summary["lineage"]),
             origin_node, str(summary["created_at"]), now],
        )  # fmt: skip

    def add_bundle(self, summary: Mapping[str, Any], sha256: str, size: int) -> None:
        """The hub now holds this package's archive (to seed it to nodes)."""
        with self._db.transaction():
            self._record(summary, origin_node=None, now=self._clock())
            self._db.execute(
                "UPDATE packages SET bundle_sha256 = ?, bundle_size = ? WHERE id = ? AND"
                " version = ?",
                [sha256, size, summary["id"], summary["version"]],
            )

    def find(self, query: str | None = None, limit: int = 200) -> list[PackageRecord]:
        """Packages known to the fleet, newest first, with the nodes that hold each."""
        needle = f"%{(query or '').casefold()}%"
        rows = self._db.query(
            "SELECT p.*, s.site AS seed_site, s.created_at AS seeded_at"
            " FROM packages p LEFT JOIN package_seeds s ON s.package_id = p.id AND"
            " s.version = p.version WHERE lower(p.id || ' ' || p.title || ' ' || p.topic)"
            " LIKE ? ORDER BY p.created_at DESC, p.id LIMIT ?",
            [needle, limit],
        )
        holders: dict[tuple[str, str], list[str]] = {}
        if rows:
            marks = ",".join("?" * len(rows))
            copies = self._db.execute(
                "SELECT package_id, version, node_id FROM package_copies"  # noqa: S608 - placeholders only
                f" WHERE package_id IN ({marks}) ORDER BY node_id",
                sorted({r["id"] for r in rows}),
            )
            for package_id, version, node_id in copies:
                holders.setdefault((package_id, version), []).append(node_id)
        return [package_of(r, holders.get((r["id"], r["version"]), [])) for r in rows]

    def seed(self, package_id: str, version: str | None, site: str | None) -> int:
        """Seed a package version (the newest held when None) to every node, or to the
        nodes of ``site``; the new serial. NotFoundError when the hub holds no archive."""
        with self._db.transaction():
            row = self._db.execute(
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
            self._db.execute(
                "INSERT INTO package_seeds (package_id, version, site, created_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (package_id, version) DO UPDATE SET"
                " site = excluded.site",
                [package_id, row[0], site, self._clock()],
            )
            return self._serials.bump()

    def unseed(self, package_id: str, version: str | None) -> int:
        with self._db.transaction():
            gone = self._db.execute(
                "DELETE FROM package_seeds WHERE package_id = ? AND"
                " (CAST(? AS TEXT) IS NULL OR version = ?)",
                [package_id, version, version],
            ).rowcount
            if not gone:
                raise NotFoundError(f"{package_id} is not seeded")
            return self._serials.bump()

    def seeded_to(self, node: Node) -> list[protocol.SeededPackage]:
        """The package archives seeded to ``node`` (all nodes, or its site)."""
        rows = self._db.execute(
            "SELECT p.id, p.version, p.bundle_sha256, p.bundle_size FROM package_seeds s"
            " JOIN packages p ON p.id = s.package_id AND p.version = s.version"
            " WHERE p.bundle_sha256 IS NOT NULL AND (s.site IS NULL OR s.site = ?)"
            " ORDER BY p.id, p.version",
            [node.site],
        ).fetchall()
        return [protocol.SeededPackage(id=r[0], version=r[1], sha256=r[2], size=r[3]) for r in rows]

    def apply_report(self, node_id: str, event: protocol.Event, now: float) -> None:
        """Inside the ledger's transaction, for an event new to it: a node's package
        report, the package (and its lineage) known to the fleet, held by that node; or no
        longer held. Other kinds change nothing here."""
        if isinstance(event, protocol.PackageEvent):
            body = event.body
            self._record(body.model_dump(mode="json"), origin_node=node_id, now=now)
            self._db.execute(
                "INSERT INTO package_copies (package_id, version, node_id, reported_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (package_id, version, node_id) DO UPDATE SET"
                " reported_at = excluded.reported_at",
                [body.id, body.version, node_id, now],
            )
        elif isinstance(event, protocol.PackageRemovedEvent):
            self._db.execute(
                "DELETE FROM package_copies WHERE package_id = ? AND version = ? AND node_id = ?",
                [event.body.id, event.body.version, node_id],
            )

    def summaries(self, limit: int) -> list[dict[str, Any]]:
        """The packages the fleet reported, newest first, with how many nodes hold each:
        what the console lists."""
        rows = self._db.execute(
            "SELECT p.id, p.version, p.title, p.topic, p.level, p.items, p.size, p.origin_node,"
            " p.created_at, p.received_at, p.bundle_sha256,"
            " (SELECT COUNT(*) FROM package_copies c"
            "  WHERE c.package_id = p.id AND c.version = p.version)"
            " FROM packages p ORDER BY p.received_at DESC, p.id LIMIT ?",
            [limit],
        ).fetchall()
        keys = ("id", "version", "title", "topic", "level", "items", "size", "origin_node",
                "created_at", "received_at", "bundle_sha256", "copies")  # fmt: skip
        return [dict(zip(keys, r, strict=True)) for r in rows]
