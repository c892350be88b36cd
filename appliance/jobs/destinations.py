"""Where webhooks may go: public addresses, and what the operator's `jobs.webhook_allow` names.

A webhook URL is the caller's choice, and the appliance POSTs to it from inside the site's
network: without a check, a job could make the appliance reach its own loopback services,
the LAN's private hosts, cloud metadata at link-local addresses, or the fleet's WireGuard
overlay (server-side request forgery). So a URL whose host is, or resolves to, a loopback,
private (RFC 1918, ULA fc00::/7), link-local, unspecified, multicast, shared (CGNAT
100.64.0.0/10, the fleet's default overlay) or otherwise non-global address, or one in the
node's own overlay prefix, is refused when the job is created. It is checked again at every
delivery, against the addresses the connection is then made to (the delivery's resolver hands
the connector only addresses that pass), so a name that resolved to a public address at creation
and to a private one later (DNS rebinding) is still refused. IPv4 addresses inside IPv6
(mapped, 6to4, NAT64) are judged as the IPv4 address they carry.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import TYPE_CHECKING

import yarl

from appliance.settings import parse_allow

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

SHARED = ipaddress.IPv4Network("100.64.0.0/10")  # RFC 6598; the fleet's overlay by default
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the last 32 bits are IPv4
ALLOW_SETTING = "jobs.webhook_allow"


class WebhookDestinationError(OSError):
    """The webhook URL's host is, or resolves to, an address webhooks may not go to.

    An OSError, so that aiohttp's connector reports it as the connection error it is."""


def url_host(url: str) -> str:
    """The host a delivery connects to, parsed as the HTTP client parses it (yarl): one
    parser for the check and the connection, so no URL means one host to each."""
    try:
        return yarl.URL(url).host or ""
    except ValueError:
        return ""


def ip_literal(host: str) -> Address | None:
    """The address, when the host is one (no resolver sees those)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _normal_host(host: str) -> str:
    return host.lower().removesuffix(".")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


class WebhookDestinations:
    """The check of a webhook's destination: at job creation (`check_url`), and at every
    delivery (`refusal` of each address the name resolves to then)."""

    def __init__(
        self,
        allow: Iterable[str],
        *,
        overlay_prefix: Callable[[], str | None] = lambda: None,
        resolve_timeout_s: float = 10.0,
    ) -> None:
        parsed = [parse_allow(entry) for entry in allow]
        self._networks = [p for p in parsed if not isinstance(p, str)]
        self._hosts = {p for p in parsed if isinstance(p, str)}
        # Read at each check: a node enrolls (and learns its overlay) while it runs.
        self._overlay_prefix = overlay_prefix
        self._resolve_timeout_s = resolve_timeout_s

    def allows_host(self, host: str) -> bool:
        """The operator named this host: webhooks go to it, whatever it resolves to."""
        return _normal_host(host) in self._hosts

    def refusal(self, address: Address) -> str | None:
        """Why webhooks may not go to `address` (what the address is: `loopback`, `in the
        node's overlay network`); None if they may."""
        if any(address in network for network in self._networks):
            return None
        if isinstance(address, ipaddress.IPv6Address):
            inner = _embedded_ipv4(address)
            if inner is not None:
                why = self.refusal(inner)
                return None if why is None else f"{why} (as the IPv4 inside this IPv6 address)"
        overlay = self._overlay()
        checks: list[tuple[bool, str]] = [
            (address.is_unspecified, "unspecified"),
            (address.is_loopback, "loopback"),
            (address.is_link_local, "link-local"),
            (getattr(address, "is_site_local", False), "site-local"),
            (address.is_multicast, "multicast"),
            (address in SHARED, "in the shared address space 100.64.0.0/10"),
            (overlay is not None and address in overlay, "in the node's overlay network"),
            (address.is_private, "private"),
            (not address.is_global, "not globally routable"),
        ]
        return next((why for refused, why in checks if refused), None)

    async def check_url(self, url: str) -> str | None:
        """At job creation: why the URL's destination is refused (None: it is not).

        A name that does not resolve now is not refused here: the check at each delivery
        holds, and a receiver's DNS being down for a moment should not fail the job."""
        host = url_host(url)
        if self.allows_host(host):
            return None
        if (literal := ip_literal(host)) is not None:
            return self.refusal(literal)
        try:
            async with asyncio.timeout(self._resolve_timeout_s):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, None, type=socket.SOCK_STREAM
                )
        except (OSError, TimeoutError, UnicodeError) as err:
            log.info("webhook host %s does not resolve now (%s); checked at delivery", host, err)
            return None
        for *_, sockaddr in infos:
            why = self.refusal(ipaddress.ip_address(str(sockaddr[0]).partition("%")[0]))
            if why is not None:
                return why
        return None

    def _overlay(self) -> Network | None:
        try:
            prefix = self._overlay_prefix()
            return None if prefix is None else ipaddress.ip_network(prefix, strict=False)
        except (OSError, ValueError):
            # No identity file, or one being written: the shared range still covers the
            # fleet's default overlay.
            log.warning("the node's overlay prefix could not be read", exc_info=True)
            return None
