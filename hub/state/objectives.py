"""The fleet's objectives in the store: heartbeats' cumulative counters made deltas against
the last values counted (`slo_cursors`, `slo_node_cursors`: in the database, so a restarted
hub or another replica counts the same), added into time buckets (`slo_buckets`: five
minutes kept two days, an hour kept 35 days; `slo_fleet_buckets`, the same without the
node), and the windows' sums read back.

Grain: (bucket width, bucket start, node, class, account), the node's name and site beside
it; counters as columns (hub/planning/slo.py `COUNTER_NAMES`), the histograms' sums, and
the node's worker restarts on a row of its own (class and account "")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hub.planning.slo import (
    COUNTER_NAMES,
    SUM_NAMES,
    Counters,
    Ingested,
    SloDelta,
    delta,
    merged,
    slo_delta,
    totals_of,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from hub.planning.slo import Grouping, SloTotals
    from hub.state import sql
    from hub.state.nodes import Heartbeat
    from shared import protocol

FIVE_MINUTES = 300
HOUR = 3600
# How long each width of bucket is kept, in seconds.
KEPT_S = {FIVE_MINUTES: 2 * 86_400, HOUR: 35 * 86_400}
# Windows up to this long are summed from five-minute buckets (while those reach back far
# enough), longer ones from hourly buckets.
FINE_WINDOW_S = 6 * 3600
PRUNE_EVERY_S = 60.0
# A bucket's counter stops growing here (exact in a double): a node resetting on purpose
# can add at most this much to a row, and no sum can overflow the database's integers.
CAP = 1 << 53
_IN_CHUNK = 500  # ids in one IN (…) list
_SEEN_MAX = 200_000  # nodes whose last objectives are remembered

_COLUMNS = (*COUNTER_NAMES, *SUM_NAMES, "worker_restarts")


def _upsert(
    table: str, keys: tuple[str, ...], beside: tuple[str, ...], columns: tuple[str, ...]
) -> str:
    """An INSERT that adds its counters to the row's when the row is there (each stopping
    at CAP). The names are this module's constants, never input."""
    added = ", ".join(
        f"{c} = {table}.{c} + excluded.{c}"
        if c in SUM_NAMES
        else f"{c} = CASE WHEN {table}.{c} + excluded.{c} > {CAP} THEN {CAP}"
        f" ELSE {table}.{c} + excluded.{c} END"
        for c in columns
    )
    kept = "".join(f"{c} = excluded.{c}, " for c in beside)
    names = (*keys, *beside, *columns)
    return (
        f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(['?'] * len(names))})"  # noqa: S608
        f" ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {kept}{added}"
    )


_INSERT_BUCKET = _upsert(
    "slo_buckets",
    ("width", "start", "node_id", "service_class", "account"),
    ("node", "site"),
    _COLUMNS,
)
# The fleet's buckets: the same sums without the node, what windows by class, account or
# site read (a few rows a bucket, not one per node).
_INSERT_FLEET_BUCKET = _upsert(
    "slo_fleet_buckets",
    ("width", "start", "service_class", "account", "site"),
    (),
    _COLUMNS[:-1],
)
_GROUP_SQL: dict[Grouping, str] = {
    "class": "''",
    "account": "account",
    "site": "site",
    "node": "node_id",
}


@dataclass(frozen=True)
class SloFilters:
    """What a read keeps: one class, account, site or node (by id or name); None: all."""

    service_class: str | None = None
    account: str | None = None
    site: str | None = None
    node: str | None = None

    def where(self) -> tuple[str, list[Any]]:
        sql, params = "", []
        for column, value in (
            ("service_class", self.service_class),
            ("account", self.account),
            ("site", self.site),
        ):
            if value is not None:
                sql += f" AND {column} = ?"
                params.append(value)
        if self.node is not None:
            sql += " AND (node_id = ? OR node = ?)"
            params += [self.node, self.node]
        return sql, params


@dataclass(frozen=True)
class SloBucket:
    """One class's (and group's) sums over one bucket of time, histograms included."""

    start: float
    service_class: str
    group: str
    counters: dict[str, float]

    def totals(self) -> SloTotals:
        return totals_of(self.service_class, self.group, self.counters)


def _chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(ids), _IN_CHUNK):
        yield ids[i : i + _IN_CHUNK]


def _marks(n: int) -> str:
    return ", ".join(["?"] * n)


@dataclass
class _Cursors:
    """What a flush counts from: each node's (name, site), each series' last (epoch, at,
    values), each node's last (epoch, at, worker restarts)."""

    nodes: dict[str, tuple[str, str]] = field(default_factory=dict)
    series: dict[tuple[str, str, str], tuple[str, float, Counters]] = field(default_factory=dict)
    restarts: dict[str, tuple[str, float, int]] = field(default_factory=dict)


@dataclass
class _Counted:
    """What a flush adds, and the rows it writes."""

    series: list[SloDelta] = field(default_factory=list)
    restarts: list[tuple[str, str, str, int]] = field(default_factory=list)
    cursor_rows: list[tuple[Any, ...]] = field(default_factory=list)
    node_cursor_rows: list[tuple[Any, ...]] = field(default_factory=list)
    bucket_rows: list[tuple[Any, ...]] = field(default_factory=list)
    # By (five-minute start, hourly start, class, account, site): added once a series.
    fleet: dict[tuple[int, int, str, str, str], Counters] = field(default_factory=dict)

    def fleet_rows(self) -> list[tuple[Any, ...]]:
        # In the order of their keys: replicas adding to the same rows lock them in one
        # order, so neither waits on the other in a cycle. Each count at most CAP: the sum
        # of many hostile nodes' would not fit the database's integers.
        rows = []
        for (fine, hourly, *key), c in self.fleet.items():
            values = (*(min(v, CAP) for v in c.counts), *c.sums)
            rows += [(FIVE_MINUTES, fine, *key, *values), (HOUR, hourly, *key, *values)]
        return sorted(rows, key=lambda r: r[:5])

    def beat(self, beat: Heartbeat, known: set[str], last: _Cursors) -> None:
        objectives = beat.objectives
        if objectives is None or beat.node_id not in last.nodes:
            return
        name, site = last.nodes[beat.node_id]
        epoch = objectives.epoch
        starts = [(w, int(beat.at // w * w)) for w in (FIVE_MINUTES, HOUR)]
        for key, now in merged(objectives.series, known).items():
            before = last.series.get((beat.node_id, *key))
            if before is not None and (
                beat.at < before[1]  # older than what was counted (another replica's, late)
                or (before[0] == epoch and before[2] == now)  # nothing new
            ):
                continue
            added = now if before is None else delta(now, epoch, before[2], before[0])
            self.cursor_rows.append((beat.node_id, *key, epoch, beat.at, now.dump()))
            if added:
                self.series.append(slo_delta(beat.node_id, name, site, key, added))
                self.bucket_rows += [
                    (width, start, beat.node_id, *key, name, site, *added.values, 0)
                    for width, start in starts
                ]
                at = (starts[0][1], starts[1][1], key[0], key[1], site)
                self.fleet[at] = self.fleet[at] + added if at in self.fleet else added
        restarted = objectives.worker_restarts
        before_node = last.restarts.get(beat.node_id)
        if before_node is not None and (
            beat.at < before_node[1] or (before_node[0] == epoch and before_node[2] == restarted)
        ):
            return
        added_restarts = restarted
        if before_node is not None and before_node[0] == epoch and restarted >= before_node[2]:
            added_restarts = restarted - before_node[2]
        self.node_cursor_rows.append((beat.node_id, epoch, beat.at, restarted))
        if added_restarts:
            self.restarts.append((beat.node_id, name, site, added_restarts))
            zero = Counters.zero()
            self.bucket_rows += [
                (width, start, beat.node_id, "", "", name, site, *zero.values,
                 added_restarts)
                for width, start in starts
            ]  # fmt: skip


class Objectives:
    """The `slo_*` tables."""

    def __init__(self, database: sql.Database, clock: Callable[[], float]) -> None:
        self._db = database
        self._clock = clock
        self._pruned_at = 0.0
        # Each node's objectives as this store last counted them (`ingest`).
        self._seen: dict[str, protocol.Objectives] = {}

    def ingest(self, beats: Sequence[Heartbeat]) -> Ingested:
        """Inside the heartbeats' transaction: each beat's objectives as deltas, into the
        buckets, the cursors moved. The cursors of the nodes are read locked, in the
        order of their ids (as the nodes' rows were just updated), so two replicas
        flushing one node's heartbeats count each value once."""
        # A node's objectives as this store last counted them: the same again (an idle
        # node's, a resend) add nothing whatever the cursors say (counters never go
        # down), so they cost no read. Remembered only as a shortcut: the cursors decide.
        seen = self._seen
        beats = sorted(
            (b for b in beats if b.objectives is not None and seen.get(b.node_id) != b.objectives),
            key=lambda b: b.node_id,
        )
        if len(seen) + len(beats) > _SEEN_MAX:
            seen.clear()
        for b in beats:
            assert b.objectives is not None  # noqa: S101 - filtered above
            seen[b.node_id] = b.objectives
        counted = _Counted()
        if beats:
            known = {str(r[0]) for r in self._db.execute("SELECT name FROM accounts").fetchall()}
            last = self._cursors([b.node_id for b in beats])
            for beat in beats:
                counted.beat(beat, known, last)
            self._write(counted)
        self._prune_when_due()
        return Ingested(counted.series, counted.restarts)

    def _cursors(self, ids: Sequence[str]) -> _Cursors:
        """The nodes' names and sites and their cursors, the cursors locked."""
        found = _Cursors()
        for chunk in _chunks(ids):
            marks = _marks(len(chunk))
            for node_id, name, site in self._db.execute(
                f"SELECT id, name, site FROM nodes WHERE id IN ({marks})",  # noqa: S608 - marks
                chunk,
            ).fetchall():
                found.nodes[node_id] = (name, site)
            for row in self._db.execute(
                "SELECT node_id, service_class, account, epoch, at, counters FROM slo_cursors"  # noqa: S608 - marks
                f" WHERE node_id IN ({marks}) ORDER BY node_id, service_class, account"
                + self._db.for_update,
                chunk,
            ).fetchall():
                found.series[(row[0], row[1], row[2])] = (row[3], row[4], Counters.load(row[5]))
            for row in self._db.execute(
                "SELECT node_id, epoch, at, worker_restarts FROM slo_node_cursors"  # noqa: S608 - marks
                f" WHERE node_id IN ({marks}) ORDER BY node_id" + self._db.for_update,
                chunk,
            ).fetchall():
                found.restarts[row[0]] = (row[1], row[2], int(row[3]))
        return found

    def _write(self, counted: _Counted) -> None:
        if counted.cursor_rows:
            self._db.executemany(
                "INSERT INTO slo_cursors (node_id, service_class, account, epoch, at, counters)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (node_id, service_class, account)"
                " DO UPDATE SET epoch = excluded.epoch, at = excluded.at,"
                " counters = excluded.counters",
                counted.cursor_rows,
            )
        if counted.node_cursor_rows:
            self._db.executemany(
                "INSERT INTO slo_node_cursors (node_id, epoch, at, worker_restarts)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE SET"
                " epoch = excluded.epoch, at = excluded.at,"
                " worker_restarts = excluded.worker_restarts",
                counted.node_cursor_rows,
            )
        if counted.bucket_rows:
            self._db.executemany(_INSERT_BUCKET, counted.bucket_rows)
        if counted.fleet:
            self._db.executemany(_INSERT_FLEET_BUCKET, counted.fleet_rows())

    def _prune_when_due(self) -> None:
        now = self._clock()
        if now - self._pruned_at >= PRUNE_EVERY_S:
            self.prune(now)

    def prune(self, now: float) -> int:
        """Delete the buckets older than they are kept; how many."""
        self._pruned_at = now
        deleted = 0
        for table in ("slo_buckets", "slo_fleet_buckets"):
            for width, kept in KEPT_S.items():
                deleted += self._db.execute(
                    f"DELETE FROM {table} WHERE width = ? AND start < ?",  # noqa: S608 - constants
                    [width, now - kept],
                ).rowcount
        return deleted

    # -- reads -------------------------------------------------------------------------------

    def _width(self, since: float) -> int:
        """The finest buckets that still reach back to `since`."""
        return FIVE_MINUTES if since > self._clock() - KEPT_S[FIVE_MINUTES] + FIVE_MINUTES else HOUR

    def buckets(
        self,
        since: float,
        until: float,
        by: Grouping = "class",
        filters: SloFilters | None = None,
        *,
        width: int | None = None,
        per_bucket: bool = False,
    ) -> list[SloBucket]:
        """The sums of the buckets that overlap [since, until) per class and group (and per
        bucket start with `per_bucket`; else start is `since`). Sums are read as doubles:
        exact below 2**53, and no database's integers overflow."""
        if width is None:
            width = FIVE_MINUTES if until - since <= FINE_WINDOW_S else HOUR
            width = max(width, self._width(since))
        filters = filters or SloFilters()
        where, params = filters.where()
        group = _GROUP_SQL[by]
        keys = ["start"] if per_bucket else []
        keys.append("service_class")
        if by != "class":
            keys.append(group)
        sums = ", ".join(f"SUM(CAST({c} AS DOUBLE PRECISION)) AS {c}" for c in _COLUMNS[:-1])
        # By node, or for one node: the nodes' rows; else the fleet's, far fewer.
        per_node = by == "node" or filters.node is not None
        table = "slo_buckets" if per_node else "slo_fleet_buckets"
        name = "MAX(node)" if per_node else "''"
        rows = self._db.query(
            f"SELECT {'start' if per_bucket else '0'} AS bucket, service_class,"  # noqa: S608 - constants
            f" {group} AS grp, {name} AS node_name, {sums}"
            f" FROM {table} WHERE width = ? AND start > ? AND start < ?"
            f" AND service_class <> ''{where} GROUP BY {', '.join(keys)}"
            f" ORDER BY {', '.join(keys)}",
            [width, since - width, until, *params],
        )
        out = []
        for row in rows:
            name = row.pop("node_name")
            grp = row.pop("grp")
            out.append(
                SloBucket(
                    start=float(row.pop("bucket")) if per_bucket else since,
                    service_class=str(row.pop("service_class")),
                    group=str(name if by == "node" else grp),
                    counters={k: float(v or 0) for k, v in row.items()},
                )
            )
        return out

    def totals(
        self,
        since: float,
        until: float,
        by: Grouping,
        filters: SloFilters | None = None,
    ) -> list[SloTotals]:
        """Each class's (and account's, site's or node's) sums over [since, until), to the
        bucket: every bucket that overlaps the window counts whole."""
        return [b.totals() for b in self.buckets(since, until, by, filters)]

    def series(
        self, since: float, until: float, step: float, filters: SloFilters | None = None
    ) -> tuple[int, list[SloBucket]]:
        """Per class, the sums of each `step` of [since, until) (step rounded to the buckets'
        width, at least one bucket; the step used is answered too): the points of a
        chart."""
        buckets = self.buckets(since, until, "class", filters, per_bucket=True)
        width = FIVE_MINUTES if until - since <= FINE_WINDOW_S else HOUR
        width = max(width, self._width(since))
        step = max(width, int(step // width * width))
        joined: dict[tuple[float, str], dict[str, float]] = {}
        for b in buckets:
            at = b.start // step * step
            into = joined.setdefault((at, b.service_class), dict.fromkeys(b.counters, 0.0))
            for k, v in b.counters.items():
                into[k] += v
        return step, [
            SloBucket(at, cls, "", counters) for (at, cls), counters in sorted(joined.items())
        ]

    def worker_restarts_since(self, since: float) -> dict[str, int]:
        """Model workers restarted on each node (by id) since `since`, to the bucket."""
        width = self._width(since)
        rows = self._db.execute(
            "SELECT node_id, SUM(CAST(worker_restarts AS DOUBLE PRECISION)) FROM slo_buckets"
            " WHERE width = ? AND start > ? AND service_class = '' GROUP BY node_id",
            [width, since - width],
        ).fetchall()
        return {str(node_id): int(total) for node_id, total in rows if total}
