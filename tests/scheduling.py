"""How `just test` shares the modules among its workers (pytest-xdist, `--dist loadfile`).

A module is one unit of work, so its module-scoped servers start once, in one worker. Two
changes to xdist's own order, which hands out the modules with the most tests first:

- The modules that take longest go first, heaviest first (HEAVIEST, from a run's
  `--durations`), then the rest by their number of tests. By count, a module of one test
  that runs two minutes (kill -9 fifty times) came last, and the run ended on it alone while
  three workers stood idle.
- A module whose tests run once per database (PER_BACKEND: a module-scoped fixture
  parametrized `sqlite`/`postgres`) is a unit per database: the hub's fuzzing was one unit of
  570 s, a fifth of the whole run, on one worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xdist.scheduler import LoadFileScheduling

if TYPE_CHECKING:
    import pytest
    from xdist.remote import Producer

# Measured: every tier on four workers, each module's time summed (2026-12). The image's
# modules first (QEMU under TCG: about ten minutes each, the hub-less boot four): the rest of
# the suite runs beside them.
IMAGE = (
    "tests/image/test_rollback_image.py",
    "tests/image/test_image.py",
    "tests/image/test_hubless_image.py",
)
HEAVIEST = (
    *IMAGE,
    "tests/hub/test_fuzz.py",
    "tests/hub/test_rollouts.py",
    "tests/appliance/test_durability.py",
    "tests/hub/test_placement.py",
    "tests/appliance/test_grammar.py",
    "tests/appliance/test_structured_output.py",
    "tests/appliance/test_fuzz.py",
    "tests/appliance/test_gateway.py",
    "tests/appliance/test_openai_sdk.py",
    "tests/hub/test_hub.py",
    "tests/hub/test_console.py",
    "tests/appliance/test_sampling.py",
    "tests/hub/test_alerts.py",
    "tests/appliance/test_tools.py",
    "tests/appliance/test_speech.py",
    "tests/appliance/test_batching.py",
    "tests/test_fleet_netns.py",
)
PER_BACKEND = frozenset({"tests/hub/test_fuzz.py"})


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def rank(module: str) -> int:
    """Where a module goes in the order: its place in HEAVIEST, or after all of them."""
    try:
        return HEAVIEST.index(module)
    except ValueError:
        return len(HEAVIEST)


def heaviest_first(items: list[pytest.Item]) -> None:
    """Reorder the collection in place: HEAVIEST's modules first, in its order, then the
    rest by their number of tests; each module's tests keep their order and stay together."""
    counts: dict[str, int] = {}
    for item in items:
        module = module_of(item.nodeid)
        counts[module] = counts.get(module, 0) + 1
    items.sort(key=lambda item: _key(module_of(item.nodeid), counts))


def _key(module: str, counts: dict[str, int]) -> tuple[int, int, str]:
    return (rank(module), -counts[module], module)


class HeaviestFirst(LoadFileScheduling):  # type: ignore[misc]  # xdist has no types
    """`--dist loadfile` in the collection's order (heaviest_first), with the modules of
    PER_BACKEND split by their first parameter."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        # The collection is already in the order wanted; xdist's reorder (by test count)
        # would undo it.
        config.option.loadscopereorder = False
        super().__init__(config, log)

    def _assign_work_unit(self, node: Any) -> None:
        """xdist's, except behind a module of IMAGE: a worker runs its last test only once
        it holds another (or is told to stop), so xdist queues a unit behind every module of
        one or two tests; behind a boot of minutes that is the lightest unit left (the
        queue's last), not the next heavy one, which would wait there for the whole boot."""
        held = self.assigned_work.get(node, {})
        if self.workqueue and any(
            module_of(scope) in IMAGE and not all(done.values()) for scope, done in held.items()
        ):
            self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
        super()._assign_work_unit(node)

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        if module in PER_BACKEND and "[" in nodeid:
            backend = nodeid.split("[", 1)[1].split("-", 1)[0].rstrip("]")
            return f"{module}::{backend}"
        return module
