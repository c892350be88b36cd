"""Announce and find appliances as `_kovenlab._tcp.local.` (no aiohttp here)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
from zeroconf import (
    EventLoopBlocked,
    InterfaceChoice,
    NotRunningException,
    ServiceBrowser,
    ServiceListener,
    Zeroconf,
)
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

SERVICE_TYPE = "_kovenlab._tcp.local."
# What keeps zeroconf from announcing now but may pass: its engine not started within its
# bound (a node whose CPU is busy, or emulated), no multicast route yet, a socket error.
NOT_YET = (NotRunningException, EventLoopBlocked, OSError)
RETRY_FIRST_S = 5.0
RETRY_MAX_S = 300.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Announcement:
    node_id: str
    name: str
    version: str
    port: int
    tls: bool
    api_base: str = "/v1"

    def properties(self) -> dict[str, str]:
        return {
            "node_id": self.node_id,
            "version": self.version,
            "api": self.api_base,
            "tls": "yes" if self.tls else "no",
        }


@dataclass(frozen=True)
class Found:
    name: str
    addresses: tuple[str, ...]
    port: int
    node_id: str
    version: str
    api_base: str
    tls: bool

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        host = self.addresses[0] if self.addresses else "?"
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{self.port}{self.api_base}"


def lan_addresses(listen_host: str) -> list[str]:
    """The addresses to announce: the one listened on, or every non-loopback IPv4 address."""
    if listen_host not in ("0.0.0.0", "::", ""):  # noqa: S104 - comparing, not binding
        return [listen_host]
    found = [
        addr.address
        for addrs in psutil.net_if_addrs().values()
        for addr in addrs
        if addr.family == socket.AF_INET and not ipaddress.ip_address(addr.address).is_loopback
    ]
    return found or ["127.0.0.1"]


def announced_on(listen_host: str, configured: list[str] | None) -> list[str] | None:
    """The interfaces (by address) to announce on: none for a server that listens on
    loopback only (nothing on the LAN could reach it), else those `discovery.interfaces`
    names, else the one address it listens on; None: every interface (it listens on all)."""
    if listen_host == "localhost":
        return []
    try:
        if ipaddress.ip_address(listen_host).is_loopback:
            return []
    except ValueError:  # a host name: where it resolves is not ours to guess
        return configured
    if configured:
        return configured
    if listen_host in ("0.0.0.0", "::"):  # noqa: S104 - comparing, not binding
        return None
    return [listen_host]


def local_networks(interfaces: list[str] | None = None) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this host is directly attached to (only those of `interfaces`, if set)."""
    return [
        ipaddress.IPv4Network(f"{addr.address}/{addr.netmask}", strict=False)
        for addrs in psutil.net_if_addrs().values()
        for addr in addrs
        if addr.family == socket.AF_INET
        and addr.netmask
        and (not interfaces or addr.address in interfaces)
    ]


def prefer_reachable(
    addresses: Iterable[str], networks: Sequence[ipaddress.IPv4Network]
) -> tuple[str, ...]:
    """`addresses`, those on one of `networks` first, the announced order kept otherwise.

    An appliance listening on 0.0.0.0 announces every address it has, and zeroconf answers on
    each interface with all of them (not only those valid there, as RFC 6762 asks), so the
    first may be a tunnel or bridge address this browser cannot reach; `Found.url` uses the first.
    """

    def off_link(address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return True
        return not any(ip in network for network in networks)

    return tuple(sorted(addresses, key=off_link))


class Announcer:
    def __init__(
        self, announcement: Announcement, addresses: list[str], interfaces: list[str] | None
    ) -> None:
        self.announcement = announcement
        self._addresses = addresses
        self._interfaces = interfaces
        self._zc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None
        self._retrying: asyncio.Task[None] | None = None

    async def start(self) -> None:
        a = self.announcement
        self._zc = AsyncZeroconf(interfaces=self._interfaces or InterfaceChoice.All)
        info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{a.name}.{SERVICE_TYPE}",
            port=a.port,
            properties=a.properties(),
            parsed_addresses=self._addresses,
            server=f"{a.name}.local.",
        )
        # Registering returns once probing is done, with the announcements still to be sent in
        # a task; waiting for them means the appliance is discoverable once start() returns,
        # and no un-referenced task is left for the garbage collector to drop mid-way.
        try:
            announced = await self._zc.async_register_service(info, allow_name_change=True)
            await announced
        except BaseException:
            await self._close()  # nothing registered: close what was opened
            raise
        self._info = info

    async def start_or_keep_trying(self) -> None:
        """Announce now, or, when zeroconf cannot yet (NOT_YET), say so and keep trying in the
        background: being found on the LAN is a convenience, and a slow first start (a busy
        or emulated CPU) must not stop the appliance from serving."""
        try:
            await self.start()
        except NOT_YET as err:
            log.warning("not announced on the LAN yet (%r); trying again", err)
            self._retrying = asyncio.create_task(self._keep_trying(), name="mdns-announce")

    async def _keep_trying(self) -> None:
        wait_s = RETRY_FIRST_S
        while True:
            await asyncio.sleep(wait_s)
            try:
                await self.start()
            except NOT_YET as err:
                wait_s = min(wait_s * 2, RETRY_MAX_S)
                log.warning("not announced on the LAN yet (%r); next try in %.0f s", err, wait_s)
                continue
            log.info("announced on the LAN as %s", self.announcement.name)
            return

    async def stop(self) -> None:
        retrying, self._retrying = self._retrying, None
        if retrying is not None:
            retrying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retrying
        if self._zc is not None and self._info is not None:
            # Unregistering only schedules the goodbyes; closing right away would drop them (a
            # closed Zeroconf sends nothing), and browsers would list this appliance until its
            # records expire (75 minutes for the PTR), so wait until they are sent.
            goodbyes = await self._zc.async_unregister_service(self._info)
            await goodbyes
            self._info = None
        await self._close()

    async def _close(self) -> None:
        if self._zc is not None:
            await self._zc.async_close()
            self._zc = None


class _Collector(ServiceListener):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.names.add(name)

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.names.add(name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.names.discard(name)


def discover(timeout_s: float = 3.0, interfaces: list[str] | None = None) -> list[Found]:
    """Browse the LAN for `timeout_s` seconds and return every appliance that answered."""
    zc = Zeroconf(interfaces=interfaces or InterfaceChoice.All)
    networks = local_networks(interfaces)
    try:
        collector = _Collector()
        browser = ServiceBrowser(zc, SERVICE_TYPE, collector)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # Browsing is asynchronous in zeroconf's own thread; poll the names it found.
            time.sleep(0.1)
        browser.cancel()
        found = []
        for name in sorted(collector.names):
            info = zc.get_service_info(SERVICE_TYPE, name, timeout=2000)
            if info is None:
                continue
            props = {
                k.decode(): (v.decode() if v is not None else "")
                for k, v in info.properties.items()
            }
            found.append(
                Found(
                    name=name.removesuffix("." + SERVICE_TYPE),
                    addresses=prefer_reachable(info.parsed_addresses(), networks),
                    port=info.port or 0,
                    node_id=props.get("node_id", ""),
                    version=props.get("version", ""),
                    api_base=props.get("api", "/v1"),
                    tls=props.get("tls") == "yes",
                )
            )
        return found
    finally:
        zc.close()
