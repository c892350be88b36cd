"""LAN discovery: the announcement's wire format, and a real appliance found across a real link.

The netns tests build two network namespaces joined by a veth pair (198.18.0.0/15, the
benchmarking range, so nothing real is ever addressed): the appliance serves in A, `kvl
appliance discover` browses from B, and only multicast over that link can connect them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from zeroconf import NotRunningException

from appliance.app import create_app
from appliance.discovery import mdns
from appliance.discovery.mdns import SERVICE_TYPE, Announcement, Found, prefer_reachable
from tests.conftest import make_settings
from tests.netns import A_ADDR, B_ADDR, Link, ip, linked_namespaces
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pytest_aiohttp import AiohttpClient

REPO = Path(__file__).resolve().parents[2]
PORT = 8080  # each test has fresh namespaces, so a fixed port cannot collide
DEADLINE_S = 60.0

# Prints every change a zeroconf browser sees, one line each, until stdin closes: the test
# can then tell an appliance's goodbye (Removed at once) from its records merely expiring.
WATCH = """
import sys
from zeroconf import ServiceBrowser, Zeroconf
from appliance.discovery.mdns import SERVICE_TYPE

def changed(zeroconf, service_type, name, state_change):
    print(state_change.name, name, flush=True)

zc = Zeroconf()
browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[changed])
sys.stdin.read()
browser.cancel()
zc.close()
"""

HEALTHZ = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=2) as response:
    print(response.read().decode())
"""


# --- the wire format, no network needed -------------------------------------------------


def test_announcement_properties_are_the_txt_record() -> None:
    plain = Announcement(node_id="n1", name="site-a", version="1.2.3", port=8080, tls=False)
    assert plain.properties() == {"node_id": "n1", "version": "1.2.3", "api": "/v1", "tls": "no"}
    secure = Announcement(
        node_id="n2", name="site-b", version="2.0", port=8443, tls=True, api_base="/api"
    )
    assert secure.properties() == {"node_id": "n2", "version": "2.0", "api": "/api", "tls": "yes"}


def _found(addresses: tuple[str, ...], *, tls: bool = False, port: int = 8080) -> Found:
    return Found(
        name="site-a",
        addresses=addresses,
        port=port,
        node_id="n1",
        version="1.0",
        api_base="/v1",
        tls=tls,
    )


def test_found_url() -> None:
    assert _found(("198.18.0.1", "198.19.0.1")).url == "http://198.18.0.1:8080/v1"
    assert _found(("198.18.0.1",), tls=True, port=8443).url == "https://198.18.0.1:8443/v1"
    # An IPv6 literal needs brackets, or its colons read as the port separator.
    assert _found(("2001:db8::1",)).url == "http://[2001:db8::1]:8080/v1"
    assert _found(()).url == "http://?:8080/v1"


def test_prefer_reachable_puts_on_link_addresses_first() -> None:
    link = [ipaddress.IPv4Network("198.18.0.0/24")]
    addresses = ["198.19.0.1", "2001:db8::1", "198.18.0.1", "not-an-ip", "198.19.0.2"]
    assert prefer_reachable(addresses, link) == (
        "198.18.0.1",
        "198.19.0.1",
        "2001:db8::1",
        "not-an-ip",
        "198.19.0.2",
    )
    assert prefer_reachable(addresses[:2], []) == ("198.19.0.1", "2001:db8::1")


def test_announced_only_where_the_server_listens() -> None:
    """Loopback only: nothing on the LAN could reach it, so nothing is announced; one
    address: that interface only; every address: every interface (or those configured)."""
    assert mdns.announced_on("127.0.0.1", None) == []
    assert mdns.announced_on("::1", ["198.18.0.1"]) == []
    assert mdns.announced_on("localhost", None) == []
    assert mdns.announced_on("198.18.0.1", None) == ["198.18.0.1"]
    assert mdns.announced_on("0.0.0.0", None) is None  # noqa: S104 - a value, not a bind
    assert mdns.announced_on("::", ["198.18.0.1"]) == ["198.18.0.1"]


async def test_an_appliance_on_loopback_starts_no_announcement(
    aiohttp_client: AiohttpClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []
    monkeypatch.setattr(mdns, "AsyncZeroconf", lambda **kw: started.append(kw))
    settings = make_settings(
        tmp_path / "data", discovery={"enabled": True}, embeddings={"enabled": False},
        server={"host": "127.0.0.1"},
    )  # fmt: skip
    client = await aiohttp_client(create_app(settings))
    assert (await client.get("/healthz")).status == 200
    assert started == []


async def test_an_announcement_zeroconf_cannot_start_yet_is_retried_and_serving_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a busy or emulated CPU zeroconf's engine may not start within its bound
    (NotRunningException): the appliance's start went down with it, and systemd restarted it
    over and over. Now the start goes on, says so, and the announcement is tried again."""
    attempts: list[str] = []
    closed: list[object] = []

    class Flaky:
        def __init__(self, interfaces: object) -> None:
            pass

        async def async_register_service(
            self, info: object, allow_name_change: bool
        ) -> asyncio.Future[None]:
            attempts.append("register")
            if len(attempts) < 3:
                raise NotRunningException
            return _done()

        async def async_unregister_service(self, info: object) -> asyncio.Future[None]:
            attempts.append("unregister")
            return _done()

        async def async_close(self) -> None:
            closed.append(self)

    def _done() -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    monkeypatch.setattr(mdns, "AsyncZeroconf", Flaky)
    monkeypatch.setattr(mdns, "RETRY_FIRST_S", 0.01)
    announcement = Announcement(node_id="n1", name="site-a", version="1", port=8080, tls=False)
    announcer = mdns.Announcer(announcement, ["127.0.0.1"], None)
    with caplog.at_level(logging.INFO, logger=mdns.__name__):
        await announcer.start_or_keep_trying()  # does not raise
        await until(lambda: attempts == ["register"] * 3, "the third try", 30)
        await announcer.stop()
    assert attempts[-1] == "unregister"
    assert len(closed) == 3  # each failed try closed what it opened, and the stop the last
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, caplog.text
    assert "announced on the LAN as site-a" in caplog.text

    # Stopped while still trying: the retries end with it.
    attempts.clear()
    announcer = mdns.Announcer(announcement, ["127.0.0.1"], None)
    monkeypatch.setattr(mdns, "RETRY_FIRST_S", 3600.0)
    await announcer.start_or_keep_trying()
    await announcer.stop()
    assert attempts == ["register"]


# --- two namespaces on one link --------------------------------------------------------


@dataclass(frozen=True)
class Lan(Link):
    """Namespace `a` runs the appliance (A_ADDR), `b` the browser (B_ADDR)."""

    tmp: Path

    def kvl(self, ns: str, *args: str) -> list[str]:
        return self.argv(ns, sys.executable, "-m", "shared.cli", *args)


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment minus any KVL_ settings of whoever runs the tests, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
    return {**env, **extra}


@pytest.fixture
def lan(tmp_path: Path) -> Iterator[Lan]:
    with linked_namespaces() as link:
        yield Lan(a=link.a, b=link.b, suffix=link.suffix, tmp=tmp_path)


@dataclass
class Appliance:
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it, so it shuts down (and says goodbye) cleanly."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


@contextmanager
def serve(lan: Lan, node_name: str, host: str) -> Iterator[Appliance]:
    """`kvl appliance serve` in namespace A, stopped (killed if need be) on the way out."""
    data_dir = lan.tmp / "appliance"
    log_path = lan.tmp / "serve.log"
    argv = lan.kvl(lan.a, "appliance", "serve", "--data-dir", str(data_dir))
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*argv, "--host", host, "--port", str(PORT)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=_clean_env(
                KVL_DISCOVERY__NODE_NAME=node_name,
                KVL_MODEL__N_CTX="2048",
                KVL_MODEL__N_THREADS="1",
            ),
        )
    appliance = Appliance(process, log_path)
    try:
        yield appliance
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def healthz(lan: Lan, appliance: Appliance, base_url: str) -> dict[str, Any]:
    """GET /healthz from namespace B (across the link), polling until it answers."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if appliance.process.poll() is not None:
            raise AssertionError(
                f"appliance exited with {appliance.process.returncode}:\n{appliance.tail()}"
            )
        result = subprocess.run(
            lan.argv(lan.b, sys.executable, "-c", HEALTHZ, f"{base_url}/healthz"),
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        if result.returncode == 0:
            body: dict[str, Any] = json.loads(result.stdout)
            return body
        time.sleep(0.2)
    raise AssertionError(f"{base_url}/healthz never answered:\n{appliance.tail()}")


def discover(lan: Lan, **env: str) -> list[dict[str, Any]]:
    """One `kvl appliance discover --json --timeout 4` run in namespace B."""
    argv = lan.kvl(lan.b, "appliance", "discover", "--json", "--timeout", "4")
    result = subprocess.run(
        [*argv, "--data-dir", str(lan.tmp / "browser")],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env=_clean_env(**env),
        timeout=DEADLINE_S,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def discover_until(lan: Lan, name: str, *, present: bool, **env: str) -> list[dict[str, Any]]:
    """Browse again until `name` is (or no longer is) listed; return the matching entries."""
    deadline = time.monotonic() + DEADLINE_S
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        seen = discover(lan, **env)
        matching = [found for found in seen if found["name"] == name]
        if bool(matching) == present:
            return matching
    raise AssertionError(f"{name!r} {'never' if present else 'still'} listed; last saw {seen}")


class Watcher:
    """A zeroconf browser in namespace B that reports every change as it happens."""

    def __init__(self, lan: Lan) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.process = subprocess.Popen(
            lan.argv(lan.b, sys.executable, "-c", WATCH),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=_clean_env(),
        )
        # A thread, because a pipe cannot be read with a timeout portably.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def wait_for(self, line: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        seen = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                got = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if got == line:
                return
            seen.append(got)
        raise AssertionError(f"browser never saw {line!r} in {timeout_s}s; saw {seen}")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()  # the script's cue to close zeroconf and exit
        try:
            self.process.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=DEADLINE_S)
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.mark.netns
def test_discover_finds_the_appliance_across_the_link_until_it_stops(lan: Lan) -> None:
    node_name = f"site-{lan.suffix}"
    instance = f"{node_name}.{SERVICE_TYPE}"
    with serve(lan, node_name, host=A_ADDR) as appliance:
        health = healthz(lan, appliance, f"http://{A_ADDR}:{PORT}")
        watcher = Watcher(lan)
        try:
            [found] = discover_until(lan, node_name, present=True)
            assert found == {
                "name": node_name,
                "addresses": [A_ADDR],
                "port": PORT,
                "node_id": health["node_id"],
                "version": health["version"],
                "api_base": "/v1",
                "tls": False,
                "url": f"http://{A_ADDR}:{PORT}/v1",
            }
            # Browsing only on B's address (settings.discovery.interfaces) finds it too.
            [pinned] = discover_until(
                lan, node_name, present=True, KVL_DISCOVERY__INTERFACES=json.dumps([B_ADDR])
            )
            assert pinned == found

            watcher.wait_for(f"Added {instance}", DEADLINE_S)
            assert appliance.stop() == 0, appliance.tail()
            # Without a goodbye the browser would keep the PTR record for its 75-minute TTL;
            # seeing it removed promptly means the appliance unregistered on shutdown.
            watcher.wait_for(f"Removed {instance}", 15.0)
        finally:
            watcher.close()
    assert discover_until(lan, node_name, present=False) == []


@pytest.mark.netns
def test_multi_homed_appliance_is_found_at_its_address_on_the_browsers_link(lan: Lan) -> None:
    # A second link in A (as a tunnel or container bridge would be) that B has no route to.
    other_a, other_b = f"kvx{lan.suffix}", f"kvy{lan.suffix}"
    ip("-n", lan.a, "link", "add", other_a, "type", "veth", "peer", "name", other_b)
    ip("-n", lan.a, "addr", "add", "198.19.0.1/24", "dev", other_a)
    ip("-n", lan.a, "link", "set", other_a, "up")
    ip("-n", lan.a, "link", "set", other_b, "up")
    node_name = f"site-{lan.suffix}"
    # The default listen address: every interface, so every address of A is announced.
    with serve(lan, node_name, host="0.0.0.0") as appliance:  # noqa: S104 - inside namespace A
        health = healthz(lan, appliance, f"http://{A_ADDR}:{PORT}")
        [found] = discover_until(lan, node_name, present=True)
        assert sorted(found["addresses"]) == [A_ADDR, "198.19.0.1"]
        assert found["addresses"][0] == A_ADDR
        assert found["url"] == f"http://{A_ADDR}:{PORT}/v1"
        # The advertised URL is the one B can actually use.
        origin = found["url"].removesuffix(found["api_base"])
        assert healthz(lan, appliance, origin)["node_id"] == health["node_id"]
        assert appliance.stop() == 0, appliance.tail()
