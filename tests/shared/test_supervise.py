"""Waiting for a wake-up with a deadline, as every background loop does between rounds."""

from __future__ import annotations

import asyncio

from shared.supervise import wait_until_set


async def test_a_loop_cancelled_in_the_turn_it_is_woken_stops() -> None:
    """The race that `asyncio.wait_for` loses on Python 3.11: the event is set, the inner
    wait ends, and the cancellation lands before the waiting task runs again. Each number
    of turns between the wake and the cancel is tried, so one of them is that moment."""
    for turns in range(8):
        event = asyncio.Event()
        rounds: list[int] = []

        async def loop(event: asyncio.Event, rounds: list[int]) -> None:
            while True:
                event.clear()
                rounds.append(1)
                await wait_until_set(event, 60)

        task = asyncio.create_task(loop(event, rounds))
        await asyncio.sleep(0)
        event.set()
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done == {task}, f"the loop ran on after its cancellation ({turns} turns)"
        assert task.cancelled()
        assert len(rounds) <= 2


async def test_the_answer_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_until_set(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_until_set(event, 5) is True
    assert await wait_until_set(event, 0) is True  # already set: no wait at all
