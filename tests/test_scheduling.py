"""The suite's own scheduler (tests/scheduling.py): the order of the modules, and what xdist
queues behind a module that boots the image."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tests.scheduling import IMAGE, HeaviestFirst


@dataclass(eq=False)
class Worker:
    """What the scheduler calls on an xdist worker: the tests it is sent."""

    sent: list[list[int]] = field(default_factory=list)

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.append(indexes)


def scheduler(units: dict[str, list[str]], worker: Worker) -> HeaviestFirst:
    """A HeaviestFirst with `units` (scope -> node ids) queued in order, without xdist's
    session around it."""
    made = HeaviestFirst.__new__(HeaviestFirst)
    made.workqueue = OrderedDict((scope, dict.fromkeys(ids, False)) for scope, ids in units.items())
    made.assigned_work = {}
    made.registered_collections = {worker: [i for ids in units.values() for i in ids]}
    return made


def test_behind_an_image_boot_xdist_queues_the_lightest_unit_not_the_next_heavy_one() -> None:
    worker = Worker()
    units = {
        IMAGE[0]: [f"{IMAGE[0]}::test_boot"],
        "tests/hub/test_fuzz.py": [f"tests/hub/test_fuzz.py::test_{n}" for n in range(3)],
        "tests/hub/test_rollouts.py": ["tests/hub/test_rollouts.py::test_a"],
        "tests/shared/test_small.py": ["tests/shared/test_small.py::test_one"],
    }
    schedule = scheduler(units, worker)
    schedule._assign_work_unit(worker)
    schedule._assign_work_unit(worker)
    assert list(schedule.assigned_work[worker]) == [IMAGE[0], "tests/shared/test_small.py"]
    assert list(schedule.workqueue) == ["tests/hub/test_fuzz.py", "tests/hub/test_rollouts.py"]

    # Once the boot is over, the heaviest unit comes next again.
    schedule.assigned_work[worker][IMAGE[0]][f"{IMAGE[0]}::test_boot"] = True
    schedule._assign_work_unit(worker)
    assert list(schedule.workqueue) == ["tests/hub/test_rollouts.py"]
    assert worker.sent == [[0], [5], [1, 2, 3]]
