"""Where webhooks may go: the destination check alone, and the real webhook sender on a real
store posting to real aiohttp receivers on loopback (DNS answers are the test's: a name
that resolves to a public address when the job is created and to loopback at delivery is
how DNS rebinding looks); and what the operator's log shows of a failed one."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpServer

from appliance.jobs.delivery import REFUSED, TIMEOUT, WebhookSender
from appliance.jobs.destinations import WebhookDestinations
from appliance.observability.metrics import Metrics
from appliance.settings import JobSettings
from appliance.state.jobs import Delivery, JobStore, NewItem
from appliance.state.store import AsyncStore

SECRET_BODY = "stack trace of the internal service at 10.9.8.7"
SERVER_HEADER = "internal-billing/4.2 (do-not-expose)"


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd12:3456::1", "private"),
        ("fc00::1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),  # noqa: S104 - an address judged, not bound
        ("::", "unspecified"),
        ("224.0.0.251", "multicast"),
        ("ff02::1", "multicast"),
        ("100.64.0.1", "shared"),
        ("100.127.255.254", "shared"),
        ("255.255.255.255", "private"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::ffff:10.0.0.1", "private"),
        ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("9.9.9.9", "overlay"),  # the node's own overlay prefix, in this test
        ("2001:db8::1", "private"),  # documentation
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_which_addresses_webhooks_may_go_to(address: str, why: str | None) -> None:
    destinations = WebhookDestinations([], overlay_prefix=lambda: "9.9.9.0/24")
    refusal = destinations.refusal(ipaddress.ip_address(address))
    if why is None:
        assert refusal is None
    else:
        assert refusal is not None
        assert why in refusal


def test_the_operators_allow_list_opens_networks_and_host_names() -> None:
    destinations = WebhookDestinations(["127.0.0.1/8", "10.20.0.0/16", "Hooks.School.LAN."])
    for allowed in ("127.0.0.5", "::ffff:127.0.0.1", "10.20.3.4"):
        assert destinations.refusal(ipaddress.ip_address(allowed)) is None, allowed
    for refused in ("10.21.0.1", "::1", "192.168.0.1"):
        assert destinations.refusal(ipaddress.ip_address(refused)) is not None, refused
    assert destinations.allows_host("hooks.school.lan")
    assert destinations.allows_host("HOOKS.school.lan.")
    assert not destinations.allows_host("school.lan")


def test_the_allow_list_setting_is_checked_at_start() -> None:
    assert JobSettings(webhook_allow=["127.0.0.1/8", "Hooks.LAN."]).webhook_allow == [
        "127.0.0.0/8",
        "hooks.lan",
    ]
    for bad in ("not a host!", "300.1.2.3/8", "-bad-.lan", ""):
        with pytest.raises(ValueError, match="neither a CIDR network nor a host name"):
            JobSettings(webhook_allow=[bad])


async def test_at_creation_names_are_judged_by_what_they_resolve_to() -> None:
    destinations = WebhookDestinations([], resolve_timeout_s=5)
    assert await destinations.check_url("http://localhost:8080/hook") == "loopback"
    # Legacy IPv4 spellings are names to a URL parser and 127.0.0.1 to the resolver.
    for url in ("http://2130706433/", "http://127.1/", "http://0x7f.0.0.1/"):
        assert await destinations.check_url(url) == "loopback", url
    assert await destinations.check_url("http://[::ffff:7f00:1]/") is not None
    assert await destinations.check_url("https://8.8.8.8/hook") is None
    named = WebhookDestinations(["localhost"])
    assert await named.check_url("http://localhost:8080/hook") is None


# -- the sender, at delivery time ---------------------------------------------------------------


@dataclass
class Receivers:
    """Loopback endpoints: one that takes a delivery, one that fails and says too much,
    one that never answers."""

    port: int = 0
    arrived: list[str] = field(default_factory=list)
    never: asyncio.Event = field(default_factory=asyncio.Event)

    async def ok(self, request: web.Request) -> web.Response:
        self.arrived.append(request.path)
        return web.Response(status=204)

    async def fail(self, request: web.Request) -> web.Response:
        self.arrived.append(request.path)
        return web.Response(status=500, text=SECRET_BODY, headers={"Server": SERVER_HEADER})

    async def hang(self, request: web.Request) -> web.Response:
        self.arrived.append(request.path)
        await self.never.wait()  # set by nobody: no answer within the timeout
        return web.Response(status=204)


@pytest.fixture
async def receivers(aiohttp_server: AiohttpServer) -> Receivers:
    hooks = Receivers()
    app = web.Application()
    app.router.add_post("/ok", hooks.ok)
    app.router.add_post("/fail", hooks.fail)
    app.router.add_post("/hang", hooks.hang)
    server = await aiohttp_server(app)  # on 127.0.0.1
    assert server.port is not None
    hooks.port = server.port
    return hooks


class Dns:
    """The test's answers for some names; every other name goes to the system resolver."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def getaddrinfo(host: Any, port: Any, **kwargs: Any) -> list[Any]:
            if isinstance(host, str) and host in self.answers:
                address = self.answers[host]
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                return [(family, socket.SOCK_STREAM, 6, "", (address, int(port or 0)))]
            return await real(host, port, **kwargs)

        monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)


@pytest.fixture
async def dns(monkeypatch: pytest.MonkeyPatch) -> Dns:
    return Dns(monkeypatch)


@dataclass
class Sending:
    store: AsyncStore
    jobs: JobStore
    destinations: WebhookDestinations
    sender: WebhookSender
    account_id: int

    async def deliver(self, url: str, timeout_s: float = 30.0) -> Delivery:
        """A job that ends with this webhook URL; its delivery after the first attempt."""
        job = await self.store.run(
            self.jobs.create,
            account_id=self.account_id,
            key_prefix="p",
            items=[NewItem("a", "/v1/completions", {"model": "m", "prompt": "x"})],
            metadata={},
            webhook_url=url,
        )
        await self.store.run(self.jobs.finish_item, job.id, 0, 200, {})
        self.sender.wake()
        async with asyncio.timeout(timeout_s):
            while True:  # the attempt is a row in the database: poll it
                ended = await self.store.run(self.jobs.get, job.id)
                if ended.delivery is not None and ended.delivery.attempts >= 1:
                    return ended.delivery
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def sending(
    tmp_path: Path, allow: list[str], overlay: Callable[[], str | None] = lambda: None
) -> AsyncIterator[Sending]:
    """The appliance's webhook sender on a real store of its own."""
    store = AsyncStore(tmp_path / "appliance.db")
    await store.open()
    account = await store.run(store.sync.ensure_account, "alice")
    jobs = JobStore(store.sync.db)
    # One attempt per delivery in the test: the retry would come a minute later.
    settings = JobSettings(
        webhook_allow=allow,
        webhook_timeout_s=0.5,
        webhook_backoff_initial_s=60,
        webhook_backoff_max_s=60,
    )
    destinations = WebhookDestinations(settings.webhook_allow, overlay_prefix=overlay)
    sender = WebhookSender(store, jobs, settings, Metrics(), destinations)
    sender.start()
    try:
        yield Sending(store, jobs, destinations, sender, account.id)
    finally:
        await sender.close()
        await store.close()


async def test_a_name_that_rebinds_to_loopback_after_creation_is_refused_at_delivery(
    tmp_path: Path, receivers: Receivers, dns: Dns
) -> None:
    url = f"http://rebind.example:{receivers.port}/ok"
    dns.answers["rebind.example"] = "93.184.216.34"  # public when the job is created
    async with sending(tmp_path, allow=[]) as s:
        assert await s.destinations.check_url(url) is None
        dns.answers["rebind.example"] = "127.0.0.1"  # and loopback when it is delivered
        delivery = await s.deliver(url)
        assert (delivery.status, delivery.last_status, delivery.last_error) == (
            "pending",
            None,
            REFUSED,
        )
        # A literal address is checked too: it reaches no resolver.
        literal = await s.deliver(f"http://127.0.0.1:{receivers.port}/ok")
        assert (literal.last_status, literal.last_error) == (None, REFUSED)
    assert receivers.arrived == []  # nothing reached the receiver on loopback


async def test_the_allow_list_lets_named_hosts_and_networks_through(
    tmp_path: Path, receivers: Receivers, dns: Dns
) -> None:
    dns.answers["hooks.school.lan"] = "127.0.0.1"
    async with sending(tmp_path, allow=["hooks.school.lan"]) as s:
        by_name = await s.deliver(f"http://hooks.school.lan:{receivers.port}/ok")
        assert (by_name.status, by_name.last_status, by_name.last_error) == ("delivered", 204, None)
        by_address = await s.deliver(f"http://127.0.0.1:{receivers.port}/ok")
        assert by_address.last_error == REFUSED  # the name is allowed, not its address
    async with sending(tmp_path / "networks", allow=["127.0.0.1/8"]) as s:
        delivered = await s.deliver(f"http://127.0.0.1:{receivers.port}/ok")
        assert (delivered.status, delivered.last_status) == ("delivered", 204)
    assert receivers.arrived == ["/ok", "/ok"]


async def test_the_nodes_overlay_is_refused_at_delivery(
    tmp_path: Path, receivers: Receivers, dns: Dns
) -> None:
    """An allow-list that takes in loopback still stops at the node's own overlay."""
    dns.answers["peer.example"] = "127.0.0.2"
    async with sending(tmp_path, allow=["127.0.0.1/32"], overlay=lambda: "127.0.0.0/24") as s:
        delivery = await s.deliver(f"http://peer.example:{receivers.port}/ok")
        assert delivery.last_error == REFUSED
    assert receivers.arrived == []


async def test_a_failed_delivery_records_a_class_of_failure_never_what_answered(
    tmp_path: Path, receivers: Receivers
) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
    async with sending(tmp_path, allow=["127.0.0.1/8"]) as s:
        failing = await s.deliver(f"http://127.0.0.1:{receivers.port}/fail")
        assert failing.last_status == 500
        assert failing.last_error == "non-2xx: the receiver answered HTTP 500"
        refused = await s.deliver(f"http://127.0.0.1:{closed_port}/hook")
        assert (refused.last_status, refused.last_error) == (None, REFUSED)
        silent = await s.deliver(f"http://127.0.0.1:{receivers.port}/hang")
        assert (silent.last_status, silent.last_error) == (None, TIMEOUT)
        for delivery in (failing, refused, silent):
            text = f"{delivery.last_error}"
            for leak in (SECRET_BODY, SERVER_HEADER, "10.9.8.7", "Connect", "Errno"):
                assert leak not in text, (leak, text)
    assert receivers.arrived == ["/fail", "/hang"]


async def test_a_failed_deliverys_log_shows_the_host_never_the_urls_credentials(
    tmp_path: Path, receivers: Receivers, caplog: pytest.LogCaptureFixture
) -> None:
    """The operator's log (which the hub's operators read too) names where a delivery
    failed, without the userinfo, query or fragment the client may keep a credential in."""
    caplog.set_level(logging.INFO, logger="appliance.jobs.delivery")
    secrets = ("hook-user", "pass-word-1", "token-2", "frag-3")
    credentials = f"{secrets[0]}:{secrets[1]}@127.0.0.1:{receivers.port}"
    async with sending(tmp_path, allow=["127.0.0.1/8"]) as s:
        failing = await s.deliver(f"http://{credentials}/fail?token={secrets[2]}#{secrets[3]}")
        assert failing.last_status == 500
        # No host at all: the client's own error names the URL, and the log its repr.
        invalid = await s.deliver(f"http://{secrets[0]}:{secrets[1]}@/hook?token={secrets[2]}")
        assert invalid.last_error == REFUSED
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.jobs.delivery"]
    (failed,) = [line for line in lines if failing.id in line]
    assert f"to http://***@127.0.0.1:{receivers.port}/fail?***#*** failed" in failed
    (refused,) = [line for line in lines if invalid.id in line]
    assert "http://***@/hook?***" in refused
    for line in (failed, refused):
        for secret in secrets:
            assert secret not in line, (secret, line)
    assert receivers.arrived == ["/fail"]
