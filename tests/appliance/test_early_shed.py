"""A queued request the prediction says will not hold a slot by its first-token deadline is
dropped at once, not at the deadline: the door's `doomed` on a deployment's queue as it
stands, and the generation that asks it twice a second. No model: fakes of the replicas'
flights and of a run that never starts (the prediction and the loop are the subject)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from appliance.inference.admission import AdmissionControl
from appliance.inference.completions import Generation
from appliance.observability.metrics import Metrics
from appliance.serving.engine import EngineOptions
from appliance.serving.predictor import InFlight, Rates
from appliance.settings import ClassSettings
from shared.errors import Overloaded


@dataclass
class _Replica:
    queue: list[InFlight]
    ready: bool = True

    def flights(self) -> list[InFlight]:
        return list(self.queue)


@dataclass
class _Record:
    ref: str = "m@1"


@dataclass
class _Deployment:
    replicas: list[_Replica]
    options: EngineOptions = field(default_factory=lambda: EngineOptions(n_slots=1))
    record: _Record = field(default_factory=_Record)
    calibration: Rates | None = None
    slowdown: float = 1.0


class _Run:
    """A run still queued, or seated, that never yields an event."""

    def __init__(self, flight: InFlight | None) -> None:
        self._flight = flight
        self.seated = False
        self.cancelled = False

    def flight(self) -> InFlight | None:
        return self._flight

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self) -> _Run:
        return self

    async def __anext__(self) -> Any:
        await asyncio.Event().wait()


def _door() -> AdmissionControl:
    return AdmissionControl(ClassSettings(), store=None, metrics=Metrics())  # type: ignore[arg-type]


def test_a_request_behind_more_work_than_its_deadline_allows_is_doomed() -> None:
    door = _door()
    # One slot, held by a stream expected to take 64 tokens x 0.05 s (Rates' defaults):
    # 3.2 s until it frees. Behind it, three queued requests of 1,000 prompt tokens
    # (2.5 s each at 400 tokens/s), then ours.
    running = InFlight(1, 10, 200, produced=0, running=True, arrival=0)
    ahead = [InFlight(1, 1000, 64, arrival=i) for i in (1, 2, 3)]
    ours = InFlight(1, 10, 64, arrival=4)
    deployment: Any = _Deployment([_Replica([running, *ahead, ours])])
    run: Any = _Run(ours)
    assert door.doomed(deployment, [run], waited_s=0.5, by_s=5.0)
    assert not door.doomed(deployment, [run], waited_s=0.5, by_s=60.0)
    # First in the queue, it would hold the slot in 3.2 s: within 5 s.
    first = InFlight(1, 10, 64, arrival=1)
    alone: Any = _Deployment([_Replica([running, first])])
    assert not door.doomed(alone, [_Run(first)], waited_s=0.5, by_s=5.0)  # type: ignore[list-item]
    # Seated, or finished: never dropped.
    seated = InFlight(1, 10, 64, running=True, arrival=4)
    assert not door.doomed(deployment, [_Run(seated)], waited_s=0.5, by_s=5.0)  # type: ignore[list-item]
    assert not door.doomed(deployment, [_Run(None)], waited_s=0.5, by_s=5.0)  # type: ignore[list-item]


async def test_a_doomed_request_is_shed_at_once_and_one_that_is_not_waits_its_deadline() -> None:
    def shed(waited: float) -> Overloaded:
        return Overloaded(f"dropped after {waited:.1f} s", retry_after=1.0)

    run: Any = _Run(InFlight(1, 10, 64))
    started = time.monotonic()
    generation = Generation([run], 30.0, shed, doomed=lambda waited: waited > 0.2)
    with pytest.raises(Overloaded):
        await anext(generation)
    assert time.monotonic() - started < 10  # the deadline was 30 s away
    assert run.cancelled

    patient: Any = _Run(InFlight(1, 10, 64))
    started = time.monotonic()
    generation = Generation([patient], 1.2, shed, doomed=lambda waited: False)
    with pytest.raises(Overloaded):
        await anext(generation)
    assert time.monotonic() - started >= 1.2  # shed at its deadline, not before
