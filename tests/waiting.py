"""Waiting on a condition held elsewhere (a database, another process, a background
loop): poll it until it holds or a deadline passes. The one way tests wait; no test
sleeps a fixed time and hopes."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable


async def until(
    condition: Callable[[], object],
    what: str = "the condition",
    timeout_s: float = 60.0,
    *,
    every_s: float = 0.05,
) -> Any:
    """Until `condition()` (a function or a coroutine function) is truthy, and that
    value; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return held
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(every_s)


def until_sync(
    condition: Callable[[], bool],
    what: str = "the condition",
    timeout_s: float = 60.0,
    *,
    every_s: float = 0.2,
) -> None:
    """`until` for tests without an event loop (processes in namespaces, VMs)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(every_s)
