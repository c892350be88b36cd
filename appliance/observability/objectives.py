"""The node's live objectives: per service class and account, how many requests reached
admission, how each ended (admitted, or refused under one of `protocol.REFUSALS`), and
each objective met or missed (`protocol.ObjectiveSeries` states the rules), with the
first-token and completion latencies on `protocol.LATENCY_BOUNDS_S`.

Cumulative over the node's epoch (the database's): the book is loaded at start and stored
(one transaction) before every heartbeat and at stop, so a restart resumes the counts and
the node never sends a counter lower than one it sent before. A hard crash loses what was
counted since the last store.

A request is counted once, when it ends (a :class:`Ticket` ends once), so
`admitted + sum(refused) == requests` holds at every moment; one still in flight is not
counted yet. Per request: a dict lookup and a few integer adds, no I/O.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared import protocol
from shared.classes import ServiceClass

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

OTHER = "(other)"  # the account the pairs past the bound are counted under, per class
# Each class keeps room for its "(other)", so a snapshot never exceeds the protocol's bound.
_OWN_SERIES = protocol.MAX_OBJECTIVE_SERIES - len(ServiceClass)
_BOUNDS = protocol.LATENCY_BOUNDS_S
_REFUSAL = {reason: i for i, reason in enumerate(protocol.REFUSALS)}
_ADMIT, _FIRST, _COMPLETE = range(3)  # protocol.OBJECTIVES


@dataclass(frozen=True)
class ClassObjectives:
    """A class's objectives in seconds: SLO.A admit, SLO.B first token, SLO.C complete."""

    admit_s: float
    first_token_s: float
    complete_s: float

    def as_protocol(self) -> dict[protocol.Objective, float]:
        return {
            "admit": self.admit_s,
            "first_token": self.first_token_s,
            "complete": self.complete_s,
        }


class Series:
    """One (class, account)'s counters, as plain integers (mutated on the event loop)."""

    __slots__ = (
        "admitted",
        "completion",
        "completion_sum",
        "dirty",
        "met",
        "missed",
        "refused",
        "requests",
        "ttft",
        "ttft_sum",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.admitted = 0
        self.refused = [0] * len(protocol.REFUSALS)
        self.met = [0] * len(protocol.OBJECTIVES)
        self.missed = [0] * len(protocol.OBJECTIVES)
        self.ttft = [0] * (len(_BOUNDS) + 1)
        self.ttft_sum = 0.0
        self.completion = [0] * (len(_BOUNDS) + 1)
        self.completion_sum = 0.0
        self.dirty = False  # counted since it was last stored

    def measure(self, objective: int, seconds: float, target: float) -> None:
        if seconds <= target:
            self.met[objective] += 1
        else:
            self.missed[objective] += 1

    def to_protocol(self, klass: str, account: str) -> protocol.ObjectiveSeries:
        return protocol.ObjectiveSeries.model_validate(self.to_json(klass, account))

    def to_json(self, klass: str, account: str) -> dict[str, Any]:
        return {
            "service_class": klass,
            "account": account,
            "requests": self.requests,
            "admitted": self.admitted,
            "refused": {r: n for r, n in zip(protocol.REFUSALS, self.refused, strict=True) if n},
            "met": {o: n for o, n in zip(protocol.OBJECTIVES, self.met, strict=True) if n},
            "missed": {o: n for o, n in zip(protocol.OBJECTIVES, self.missed, strict=True) if n},
            "ttft": {"counts": list(self.ttft), "sum_s": self.ttft_sum},
            "completion": {"counts": list(self.completion), "sum_s": self.completion_sum},
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Series:
        s = cls()
        s.requests = int(body["requests"])
        s.admitted = int(body["admitted"])
        s.refused = [int(body["refused"].get(r, 0)) for r in protocol.REFUSALS]
        s.met = [int(body["met"].get(o, 0)) for o in protocol.OBJECTIVES]
        s.missed = [int(body["missed"].get(o, 0)) for o in protocol.OBJECTIVES]
        s.ttft = [int(n) for n in body["ttft"]["counts"]]
        s.ttft_sum = float(body["ttft"]["sum_s"])
        s.completion = [int(n) for n in body["completion"]["counts"]]
        s.completion_sum = float(body["completion"]["sum_s"])
        return s


class ObjectiveBook:
    """Every (class, account)'s series on this node. `objectives`: each class's objectives
    (by class name, S0-S4)."""

    def __init__(self, objectives: Mapping[str, ClassObjectives]) -> None:
        self.objectives = dict(objectives)
        self._series: dict[tuple[str, str], Series] = {}

    # -- counting ----------------------------------------------------------------------------

    def series(self, klass: str, account: str) -> Series:
        """The pair's series, made on first use. Past the protocol's bound a new pair is
        counted under its class's "(other)" from then on: a pair once sent on its own
        stays on its own, as folding it later would count its past twice at the hub."""
        key = (klass, account)
        found = self._series.get(key)
        if found is None:
            if len(self._series) >= _OWN_SERIES or not _sendable(account):
                key = (klass, OTHER)
                found = self._series.get(key)
            if found is None:
                found = self._series[key] = Series()
        return found

    def ticket(self, klass: str, account: str) -> Ticket:
        """A request on its way to admission; counted when its ticket ends."""
        return Ticket(self, klass, account)

    def refused(self, klass: str, account: str, reason: protocol.Refusal) -> None:
        """A request refused at once (a quota, a full outbox): reached admission, ended."""
        s = self.series(klass, account)
        s.requests += 1
        s.refused[_REFUSAL[reason]] += 1
        if reason != "quota":  # the account's limit, not the service's failure
            for objective in range(3):
                s.missed[objective] += 1
        s.dirty = True

    def served(
        self,
        klass: str,
        account: str,
        *,
        queue_s: float | None,
        ttft_s: float | None,
        duration_s: float,
        cancelled: bool,
        targets: ClassObjectives | None = None,
    ) -> None:
        """An admitted request that ended with its worker's timings (from its arrival
        there), against `targets` (the request's own: its class's with their allowances
        for its tokens), else its class's. Cancelled, it counts for `complete` neither
        way, and for an objective it had not reached yet only once it had waited past it."""
        s = self.series(klass, account)
        o = targets or self.objectives[klass]
        s.requests += 1
        s.admitted += 1
        if queue_s is not None:
            s.measure(_ADMIT, queue_s, o.admit_s)
        elif not cancelled or duration_s > o.admit_s:
            s.measure(_ADMIT, duration_s, o.admit_s)
        if ttft_s is not None:
            s.measure(_FIRST, ttft_s, o.first_token_s)
            s.ttft[bisect.bisect_left(_BOUNDS, ttft_s)] += 1
            s.ttft_sum += ttft_s
        elif not cancelled or duration_s > o.first_token_s:
            # Done without a token: its answer, whole, was its first.
            s.measure(_FIRST, duration_s, o.first_token_s)
        if not cancelled:
            s.measure(_COMPLETE, duration_s, o.complete_s)
            s.completion[bisect.bisect_left(_BOUNDS, duration_s)] += 1
            s.completion_sum += duration_s
        s.dirty = True

    def admitted_unmeasured(self, klass: str, account: str) -> None:
        """An admitted request that ended without timings (its client went away, or it
        failed for its own fault after the door): admitted, no objective measured."""
        s = self.series(klass, account)
        s.requests += 1
        s.admitted += 1
        s.dirty = True

    # -- reading, storing, loading -------------------------------------------------------------

    def snapshot(self) -> list[protocol.ObjectiveSeries]:
        """Every series as the protocol sends it (at most MAX_OBJECTIVE_SERIES)."""
        return [s.to_protocol(k, a) for (k, a), s in self._series.items()]

    def items(self) -> Iterable[tuple[str, str, Series]]:
        return [(k, a, s) for (k, a), s in self._series.items()]

    def take_dirty(self) -> list[dict[str, Any]]:
        """The series counted since the last call, as JSON rows to store (their dirty marks
        cleared: call it on the event loop, right before the store)."""
        rows = []
        for (klass, account), s in self._series.items():
            if s.dirty:
                s.dirty = False
                rows.append(s.to_json(klass, account))
        return rows

    def mark_dirty(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Rows `take_dirty` gave that could not be stored: stored with the next ones."""
        for body in rows:
            found = self._series.get((body["service_class"], body["account"]))
            if found is not None:
                found.dirty = True

    def load(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """The series stored before (at start, before any request)."""
        for body in rows:
            self._series[(str(body["service_class"]), str(body["account"]))] = Series.from_json(
                body
            )

    def objectives_s(self) -> dict[str, dict[protocol.Objective, float]]:
        return {klass: o.as_protocol() for klass, o in self.objectives.items()}


def _sendable(account: str) -> bool:
    """A name the protocol carries (`protocol.Name`); another is counted as "(other)"."""
    try:
        protocol.ObjectiveSeries(service_class="S0", account=account)
    except ValueError:
        return False
    return True


class Ticket:
    """One request's way through admission: it ends once, admitted or refused; what the
    admission control and the completion service say after its end changes nothing."""

    __slots__ = ("_book", "account", "at_door", "klass", "open", "targets")

    def __init__(self, book: ObjectiveBook, klass: str, account: str) -> None:
        self._book = book
        self.klass = klass
        self.account = account
        self.open = True
        self.at_door = False  # past the quotas, at the door's prediction
        # The request's own objectives (its class's with the allowances for its tokens),
        # set at the door; None: its class's.
        self.targets: ClassObjectives | None = None

    def refuse(self, reason: protocol.Refusal) -> None:
        if self.open:
            self.open = False
            self._book.refused(self.klass, self.account, reason)

    def serve(
        self, *, queue_s: float | None, ttft_s: float | None, duration_s: float, cancelled: bool
    ) -> None:
        if self.open:
            self.open = False
            self._book.served(
                self.klass,
                self.account,
                queue_s=queue_s,
                ttft_s=ttft_s,
                duration_s=duration_s,
                cancelled=cancelled,
                targets=self.targets,
            )

    def close(self) -> None:
        """The request ended without a refusal or timings: admitted if it was at the door
        (its client went away, or it was the client's fault after it), else it never
        reached admission (a bad request) and counts nowhere."""
        if self.open:
            self.open = False
            if self.at_door:
                self._book.admitted_unmeasured(self.klass, self.account)
