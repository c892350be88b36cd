"""The fleet's objectives as the store counts them: what one heartbeat flush added
(`Ingested`, one `SloDelta` per node, class and account), what a window of buckets holds
(`SloTotals`, `totals_of`, `histogram`), and how a node's cumulative counters become those
deltas (`Counters`, `delta`): pure, so the store's flush (hub/state/objectives.py), the
views (hub/fleet/objectives.py) and the tests share one rule.

A node counts cumulatively within an epoch (shared/protocol.py `Objectives`); the hub
keeps the last values it counted of each (node, class, account) in its database and adds
the difference. A new epoch is counted whole; a value lower than the last one within an
epoch is a reset (a node's counters never go down), counted whole too, as Prometheus
does: what a node can do with its numbers changes only its own share of the roll-up."""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

# The accounts a node names that the hub does not know are counted under this name, so a
# node cannot add accounts to the roll-up (an account an operator named so would share it).
OTHER_ACCOUNT = "(other)"
Grouping = Literal["class", "account", "site", "node"]
GROUPINGS: tuple[Grouping, ...] = ("class", "account", "site", "node")
HISTOGRAM_BUCKETS = len(protocol.LATENCY_BOUNDS_S) + 1


@dataclass(frozen=True)
class SloDelta:
    """What one node's heartbeat added for one (class, account)."""

    node_id: str
    node: str
    site: str
    service_class: str
    account: str
    requests: int
    admitted: int
    refused: dict[str, int]  # by protocol.REFUSALS reason
    met: dict[str, int]  # by protocol.OBJECTIVES
    missed: dict[str, int]


@dataclass(frozen=True)
class Ingested:
    """What one heartbeat flush added."""

    series: list[SloDelta]
    worker_restarts: list[tuple[str, str, str, int]]  # (node_id, node name, site, added)

    def __bool__(self) -> bool:
        return bool(self.series or self.worker_restarts)


@dataclass(frozen=True)
class SloTotals:
    """A window's sums for one class and group (the account, site or node name; "" when
    grouped by class alone)."""

    service_class: str
    group: str
    requests: int
    admitted: int
    refused: dict[str, int] = field(default_factory=dict)
    met: dict[str, int] = field(default_factory=dict)
    missed: dict[str, int] = field(default_factory=dict)


def totals_of(service_class: str, group: str, c: dict[str, float]) -> SloTotals:
    """A window's totals out of its summed counters (columns named as `COUNTER_NAMES`)."""
    return SloTotals(
        service_class=service_class,
        group=group,
        requests=int(c["requests"]),
        admitted=int(c["admitted"]),
        refused={r: int(c[f"refused_{r}"]) for r in protocol.REFUSALS},
        met={o: int(c[f"met_{o}"]) for o in protocol.OBJECTIVES},
        missed={o: int(c[f"missed_{o}"]) for o in protocol.OBJECTIVES},
    )


def histogram(counters: dict[str, float], name: str) -> list[float]:
    """A bucket's histogram (`ttft` or `completion`) out of its counters."""
    return [counters.get(f"{name}_{i}", 0.0) for i in range(HISTOGRAM_BUCKETS)]


# -- counters --------------------------------------------------------------------------------

# The counters of one series, flat and in this order: requests, admitted, refused by reason,
# met and missed by objective, the two histograms' counts. The histograms' sums (seconds,
# floats) go beside them.
COUNTER_NAMES: tuple[str, ...] = (
    "requests",
    "admitted",
    *(f"refused_{r}" for r in protocol.REFUSALS),
    *(f"met_{o}" for o in protocol.OBJECTIVES),
    *(f"missed_{o}" for o in protocol.OBJECTIVES),
    *(f"ttft_{i}" for i in range(HISTOGRAM_BUCKETS)),
    *(f"completion_{i}" for i in range(HISTOGRAM_BUCKETS)),
)
SUM_NAMES: tuple[str, ...] = ("ttft_sum_s", "completion_sum_s")
_TTFT = COUNTER_NAMES.index("ttft_0")
_COMPLETION = COUNTER_NAMES.index("completion_0")


_N = len(COUNTER_NAMES)
_AT = {name: i for i, name in enumerate(COUNTER_NAMES)}
_REFUSED = [(r, _AT[f"refused_{r}"]) for r in protocol.REFUSALS]
_MET = [(o, _AT[f"met_{o}"]) for o in protocol.OBJECTIVES]
_MISSED = [(o, _AT[f"missed_{o}"]) for o in protocol.OBJECTIVES]


@dataclass(frozen=True)
class Counters:
    """One series' cumulative values, flat: the counts (`COUNTER_NAMES`), then the sums
    (`SUM_NAMES`). One tuple, as the flush handles thousands a second."""

    values: tuple[float, ...]

    @classmethod
    def zero(cls) -> Counters:
        return cls((0,) * _N + (0.0,) * len(SUM_NAMES))

    @classmethod
    def of(cls, series: protocol.ObjectiveSeries) -> Counters:
        refused, met, missed = series.refused, series.met, series.missed
        return cls(
            (
                series.requests,
                series.admitted,
                *[refused.get(r, 0) for r in protocol.REFUSALS],
                *[met.get(o, 0) for o in protocol.OBJECTIVES],
                *[missed.get(o, 0) for o in protocol.OBJECTIVES],
                *series.ttft.counts,
                *series.completion.counts,
                series.ttft.sum_s,
                series.completion.sum_s,
            )
        )

    def __add__(self, other: Counters) -> Counters:
        return Counters(tuple(map(operator.add, self.values, other.values)))

    def __bool__(self) -> bool:
        return any(self.values[:_N])

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.values[:_N])

    @property
    def sums(self) -> tuple[float, ...]:
        return self.values[_N:]

    def dump(self) -> str:
        """As the cursor table keeps them: the values, comma-separated."""
        return ",".join(map(str, self.values))

    @classmethod
    def load(cls, text: str) -> Counters:
        """What `dump` wrote; zero for anything else (a row of another layout)."""
        try:
            values = json.loads(f"[{text}]")  # the C parser: half the time of int() each
        except ValueError:
            return cls.zero()
        if len(values) != _N + len(SUM_NAMES) or not all(type(v) is int for v in values[:_N]):
            return cls.zero()
        return cls((*values[:_N], *map(float, values[_N:])))

    @property
    def ttft(self) -> tuple[int, ...]:
        return self.counts[_TTFT : _TTFT + HISTOGRAM_BUCKETS]

    @property
    def completion(self) -> tuple[int, ...]:
        return self.counts[_COMPLETION : _COMPLETION + HISTOGRAM_BUCKETS]


def delta(now: Counters, epoch: str, last: Counters | None, last_epoch: str | None) -> Counters:
    """What `now` adds to `last`: all of it in a new epoch (or with nothing before), all of
    it after a reset (a value lower than before), else the difference."""
    if last is None or last_epoch != epoch:
        return now
    diff = tuple(map(operator.sub, now.values, last.values))
    return now if min(diff) < 0 else Counters(diff)


def merged(
    series: Iterable[protocol.ObjectiveSeries], known: frozenset[str] | set[str]
) -> dict[tuple[str, str], Counters]:
    """A heartbeat's series by (class, account), the accounts the hub does not know summed
    under OTHER_ACCOUNT (a sum of cumulative counters is cumulative)."""
    out: dict[tuple[str, str], Counters] = {}
    for one in series:
        account = one.account if one.account in known else OTHER_ACCOUNT
        key = (one.service_class, account)
        counters = Counters.of(one)
        out[key] = out[key] + counters if key in out else counters
    return out


def slo_delta(node_id: str, node: str, site: str, key: tuple[str, str], d: Counters) -> SloDelta:
    v = d.values
    return SloDelta(
        node_id=node_id,
        node=node,
        site=site,
        service_class=key[0],
        account=key[1],
        requests=int(v[0]),
        admitted=int(v[1]),
        refused={r: int(v[i]) for r, i in _REFUSED},
        met={o: int(v[i]) for o, i in _MET},
        missed={o: int(v[i]) for o, i in _MISSED},
    )


def quantile(counts: Sequence[int | float], q: float) -> float | None:
    """The `q` quantile of a histogram of `protocol.LATENCY_BOUNDS_S` (linear within the
    bucket it falls in, as Prometheus' histogram_quantile); None when it holds nothing.
    One above the last bound is the last bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    bounds = protocol.LATENCY_BOUNDS_S
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            if i >= len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - seen) / count
        seen += count
    return bounds[-1]
