"""The console's login throttle under attempts sent at once: a real hub over HTTPS on
loopback, many wrong passwords from one address in parallel, and the throttle alone."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from hub.console.auth import SESSION_COOKIE, LoginThrottle
from tests.hub.test_console import PASSWORD, add_user, csrf_of, open_console, settings_for, start

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase
    from tests.hub.test_console import Console

ALLOWED = 3
ATTEMPTS = 24


async def test_parallel_wrong_passwords_get_no_more_tries_than_allowed(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = settings_for(tmp_path, hub_database, login_failures_allowed=ALLOWED)
    add_user(hub)
    server = await start(aiohttp_server, hub)
    async with contextlib.AsyncExitStack() as stack:
        # One browser each (its own login cookie and CSRF token), every one of them
        # connected and holding its login form before the first password is sent.
        consoles: list[Console] = [
            await stack.enter_async_context(open_console(server, hub)) for _ in range(ATTEMPTS)
        ]

        async def form(console: Console) -> None:
            status, page, _ = await console.get("/console/login")
            assert status == 200
            console.csrf = csrf_of(page)

        await asyncio.gather(*(form(c) for c in consoles))

        async def attempt(console: Console, n: int) -> int:
            status, _, _ = await console.post(
                "/console/login", {"name": "ops", "password": f"wrong password {n}"}
            )
            return status

        statuses = await asyncio.gather(*(attempt(c, n) for n, c in enumerate(consoles)))
        # Every attempt past the allowed ones waits, however close together they came:
        # no more than ALLOWED passwords were ever checked.
        assert sorted(statuses) == [401] * ALLOWED + [429] * (ATTEMPTS - ALLOWED), statuses
        # And the address is blocked now, the right password included.
        last = consoles[0]
        await form(last)
        status, page, response = await last.post(
            "/console/login", {"name": "ops", "password": PASSWORD}
        )
        assert status == 429, page
        assert int(response.headers["Retry-After"]) > 0
        assert last.cookie(SESSION_COOKIE) is None


def test_attempts_in_flight_count_against_the_allowance() -> None:
    throttle = LoginThrottle(2, first_wait_s=30, max_wait_s=100)
    assert throttle.wait_s("a", 0.0) == 0  # admitted, being checked
    assert throttle.wait_s("a", 0.0) == 0
    assert throttle.wait_s("a", 0.0) == 30  # two in flight: the third waits
    assert throttle.wait_s("b", 0.0) == 0  # per address
    throttle.failed("a", 1.0)
    assert throttle.wait_s("a", 1.0) == 30  # one failed, one still in flight
    throttle.succeeded("a")  # the one in flight was right: the address is clear
    assert throttle.wait_s("a", 1.0) == 0


def test_an_admitted_attempt_never_settled_counts_as_failed() -> None:
    """A request that died between the check and its outcome still used its try."""
    throttle = LoginThrottle(2, first_wait_s=30, max_wait_s=100, settle_s=10)
    assert throttle.wait_s("a", 0.0) == 0
    assert throttle.wait_s("a", 0.0) == 0
    assert throttle.wait_s("a", 5.0) == 30  # both still counted as in flight
    # After settle_s both count as failures: the second reached the allowance at 10 s.
    assert throttle.wait_s("a", 10.0) == 30
    assert throttle.wait_s("a", 40.0) == 0


def test_past_the_allowance_one_try_at_a_time_once_the_wait_is_over() -> None:
    throttle = LoginThrottle(1, first_wait_s=30, max_wait_s=100)
    throttle.failed("a", 0.0)
    assert throttle.wait_s("a", 0.0) == 30
    assert throttle.wait_s("a", 30.0) == 0  # the wait is over: one more try
    assert throttle.wait_s("a", 30.0) == 60  # and only one, while it is checked
    throttle.failed("a", 31.0)
    assert throttle.wait_s("a", 31.0) == 60
