"""The console's login throttle under attempts sent at once: a real hub over HTTPS on
loopback, many wrong passwords from one address in parallel, and the throttle alone; its
counts per source (an IPv4 address, an IPv6 /64) and per account, and their bounds."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import pytest

from hub.console.auth import SESSION_COOKIE, LoginThrottle, source_key
from hub.console.web import CONSOLE
from tests.console import PASSWORD, add_user, console_settings, csrf_of, open_console, start

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.console import Console
    from tests.hub.conftest import HubDatabase

ALLOWED = 3
ATTEMPTS = 24


async def test_parallel_wrong_passwords_get_no_more_tries_than_allowed(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = console_settings(tmp_path, hub_database, login_failures_allowed=ALLOWED)
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


# -- per source (an IPv6 /64) and per account ---------------------------------------------------


def _fail(throttle: LoginThrottle, address: str, account: str, now: float = 0.0) -> None:
    """One wrong password, let through and settled as a real login is."""
    assert throttle.wait_s(address, now, account=account) == 0, (address, account)
    throttle.failed(address, now, account=account)


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:aaaa:bbbb:cccc:dddd", "2001:db8:1:2::/64"),
        ("2001:DB8:1:2::1", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::ffff:192.0.2.7", "192.0.2.7"),  # IPv4-mapped: the IPv4 address it is
        ("unknown", "unknown"),
        ("/run/hub.sock", "/run/hub.sock"),
    ],
)
def test_sources_are_ipv4_addresses_and_ipv6_64s(address: str, key: str) -> None:
    assert source_key(address) == key


def test_failures_spread_over_one_ipv6_64_are_throttled_together() -> None:
    throttle = LoginThrottle(ALLOWED, first_wait_s=30, max_wait_s=100)
    # Each attempt from another address of the /64, and under another name, so that
    # only the /64's count can hold the next one back.
    for n in range(ALLOWED):
        _fail(throttle, f"2001:db8:1:2::{n + 1:x}", f"name{n}")
    assert throttle.wait_s("2001:db8:1:2:ffff:ffff:ffff:ffff", 1.0, account="other") == 29
    assert throttle.wait_s("2001:db8:1:3::1", 1.0, account="other") == 0  # the next /64


def test_ipv4_is_throttled_per_address_and_mapped_ipv6_as_ipv4() -> None:
    throttle = LoginThrottle(ALLOWED, first_wait_s=30, max_wait_s=100)
    for n in range(ALLOWED):
        _fail(throttle, "192.0.2.1", f"name{n}")
    assert throttle.wait_s("::ffff:192.0.2.1", 0.0, account="other") == 30
    assert throttle.wait_s("192.0.2.2", 0.0, account="other") == 0  # its neighbour


def test_failures_against_one_account_from_many_addresses_are_throttled() -> None:
    throttle = LoginThrottle(ALLOWED, first_wait_s=30, max_wait_s=100)
    for n in range(ALLOWED):  # a botnet: each address fails once, below its own allowance
        _fail(throttle, f"198.51.100.{n + 1}", "ops")
    assert throttle.wait_s("203.0.113.9", 0.0, account="ops") == 30
    # Another account from another address is not held back...
    assert throttle.wait_s("203.0.113.10", 0.0, account="alice") == 0
    # ... nor are the attackers' addresses under other names: each failed once.
    assert throttle.wait_s("198.51.100.1", 0.0, account="alice") == 0
    # The account's wait doubles with each further failure, as an address's does.
    _fail(throttle, "198.51.100.1", "ops", 30.0)  # the one try let in once the wait is over
    assert throttle.wait_s("203.0.113.9", 30.0, account="ops") == 60


def test_an_unknown_name_is_throttled_as_a_real_one() -> None:
    """Which names are users is not told by which ones get throttled: the throttle never
    knows it."""
    throttle = LoginThrottle(1, first_wait_s=30, max_wait_s=100)
    _fail(throttle, "198.51.100.1", "no-such-user")
    assert throttle.wait_s("198.51.100.2", 0.0, account="no-such-user") == 30


def test_a_source_that_logged_in_before_is_not_held_back_by_its_accounts_count() -> None:
    """The price of the count per account bounded: an attacker failing against `ops`
    from everywhere does not lock its operator out of where they logged in from."""
    throttle = LoginThrottle(ALLOWED, first_wait_s=30, max_wait_s=100)
    desk = "2001:db8:aa:bb::10"
    assert throttle.wait_s(desk, 0.0, account="ops") == 0
    throttle.succeeded(desk, account="ops")
    for n in range(ALLOWED):
        _fail(throttle, f"198.51.100.{n + 1}", "ops")
    assert throttle.wait_s("203.0.113.9", 1.0, account="ops") == 29  # a new place waits
    # The desk's /64 (another address of it, as SLAAC would give) logs in; its own typos
    # count against it alone, and its success leaves the attackers' count standing.
    _fail(throttle, "2001:db8:aa:bb::11", "ops", 1.0)
    assert throttle.wait_s(desk, 2.0, account="ops") == 0
    throttle.succeeded(desk, account="ops")
    assert throttle.wait_s("203.0.113.9", 2.0, account="ops") == 28
    # The account's wait ends with the attackers' last failure's backoff.
    assert throttle.wait_s("203.0.113.9", 30.0, account="ops") == 0


def test_a_success_from_a_new_place_clears_its_accounts_count() -> None:
    """An operator's own typos, somewhere new, do not stay against the account."""
    throttle = LoginThrottle(2, first_wait_s=30, max_wait_s=100)
    _fail(throttle, "198.51.100.1", "ops")
    assert throttle.wait_s("198.51.100.1", 0.0, account="ops") == 0
    throttle.succeeded("198.51.100.1", account="ops")
    _fail(throttle, "203.0.113.1", "ops")
    assert throttle.wait_s("203.0.113.2", 0.0, account="ops") == 0  # one failure, not two


def test_the_throttles_tables_are_bounded_the_oldest_forgotten_first() -> None:
    throttle = LoginThrottle(1, first_wait_s=30, max_wait_s=100, max_keys=3)
    _fail(throttle, "198.51.100.1", "ops")
    assert throttle.wait_s("203.0.113.1", 0.0, account="ops") == 30
    # Three more names (and sources) fail after it: `ops` is the oldest of four, dropped.
    for n in range(3):
        _fail(throttle, f"198.51.100.{n + 2}", f"name{n}")
    assert throttle.wait_s("203.0.113.1", 0.0, account="ops") == 0
    assert throttle.wait_s("198.51.100.1", 0.0, account="other") == 0  # its source too
    # A refused attempt adds nothing: ten of them later, the blocked name2 is still kept.
    for n in range(10):
        assert throttle.wait_s("198.51.100.4", 0.0, account=f"refused{n}") == 30
    assert throttle.wait_s("203.0.113.2", 0.0, account="name2") == 30


async def test_the_console_throttles_an_account_failed_against_from_elsewhere(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    """The login page counts the name tried: `ops`, failed against from other addresses,
    waits even with its right password; `alice`, from the same address, logs in."""
    hub = console_settings(tmp_path, hub_database, login_failures_allowed=ALLOWED)
    add_user(hub)
    add_user(hub, "alice")
    server = await start(aiohttp_server, hub)
    throttle = server.app[CONSOLE].throttle
    for n in range(ALLOWED):  # an attacker elsewhere
        _fail(throttle, f"2001:db8:{n}::1", "ops", time.time())
    async with open_console(server, hub) as console:
        assert await console.login("ops") == 429
        assert console.cookie(SESSION_COOKIE) is None
        assert await console.login("alice") == 303
