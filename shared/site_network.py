"""A site's network, as its provisioning file and the admin API state it, and the files by
which the appliance and the image's network agent (`image/network.py`, as root) speak.

A node takes DHCP on every wired port unless told otherwise. A site can give it static
addresses (IPv4 and IPv6), a gateway per family and its DNS servers, and an HTTPS proxy for
the node's own calls out. The appliance runs without root, so it never touches the network
itself: it leaves a *request* in its data folder; the agent tries it, and keeps it only
once the operator confirms it over the new setting, within a bound (`netplan try`'s
contract). Unconfirmed, or the node restarted meanwhile, the last working setting comes
back: a typo in an address cannot cut a site server off for good.
"""

from __future__ import annotations

import ipaddress
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

_HOST = re.compile(r"^(\*|\.?[A-Za-z0-9._:-]+(/[0-9]{1,3})?)$")
# systemd.network's Name= globs: interface names, with * and ?
_INTERFACES = r"^[A-Za-z0-9*?._-]{1,15}( [A-Za-z0-9*?._-]{1,15}){0,7}$"
WIRED = "en* eth*"

# The agent's bounds on a trial: long enough to reconnect and confirm, short enough that a
# node cut off comes back before anyone drives to it.
CONFIRM_MIN_S = 10
CONFIRM_MAX_S = 3600
CONFIRM_DEFAULT_S = 120
REQUEST_MAX_BYTES = 64 * 1024


def no_proxy_hosts(value: list[str]) -> list[str]:
    """`no_proxy`'s entries, each a host, a `.suffix`, an address, a network or `*`."""
    for host in value:
        if not host or len(host) > 253 or not _HOST.match(host):
            raise ValueError(f"{host[:60]!r} is not a host, a .suffix, an address or CIDR")
    return value


Interface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class SiteNetwork(BaseModel):
    """How the node sits on the site's network and reaches out of it. Without `addresses`
    its wired ports take DHCP (and IPv6 router advertisements); with them, those addresses
    and no DHCP of their family."""

    model_config = ConfigDict(extra="forbid")

    https_proxy: str | None = Field(
        None,
        pattern=r"^https?://[A-Za-z0-9._~%:@\[\]-]+/?$",
        max_length=300,
        description="The site's proxy for the node's calls out (HTTP CONNECT).",
    )
    no_proxy: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Hosts the proxy does not serve (names, .suffixes, addresses, CIDR, *).",
    )
    interfaces: str = Field(
        WIRED,
        pattern=_INTERFACES,
        description="The ports these settings are for, as systemd.network's Name= globs.",
    )
    addresses: list[Interface] = Field(
        default_factory=list,
        max_length=8,
        description="Static addresses with their prefix (198.18.7.20/24, 2001:db8::20/64).",
    )
    gateways: list[Address] = Field(
        default_factory=list, max_length=2, description="The default route, one per family."
    )
    dns: list[Address] = Field(
        default_factory=list,
        max_length=4,
        description="DNS servers, in place of the ones DHCP gives.",
    )

    @field_validator("no_proxy")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        return no_proxy_hosts(value)

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, value: list[Interface]) -> list[Interface]:
        for address in value:
            ip = address.ip
            if ip.is_loopback or ip.is_multicast or ip.is_unspecified:
                raise ValueError(f"{address} cannot be a port's address")
            network = address.network
            ends = (network.network_address, network.broadcast_address)
            if ip.version == 4 and network.prefixlen < 31 and ip in ends:
                raise ValueError(f"{address} is its network's own or broadcast address")
        if len({a.ip for a in value}) < len(value):
            raise ValueError("an address is given twice")
        return value

    @field_validator("gateways")
    @classmethod
    def _routes(cls, value: list[Address], info: ValidationInfo) -> list[Address]:
        families = [g.version for g in value]
        if len(set(families)) < len(families):
            raise ValueError("one gateway per family (IPv4, IPv6)")
        addresses: list[Interface] = info.data.get("addresses", [])
        for gateway in value:
            if gateway.version == 6 and gateway.is_link_local:
                continue  # a router's fe80:: address is on every IPv6 link
            same = [a.network for a in addresses if a.version == gateway.version]
            if not any(gateway in network for network in same):
                raise ValueError(
                    f"gateway {gateway} is on none of the static addresses' networks: the "
                    "node could not reach it"
                )
        return value

    @property
    def static(self) -> bool:
        return bool(self.addresses)

    def system(self) -> dict[str, object]:
        """What the image's agent applies (the proxy is the appliance's own)."""
        return self.model_dump(mode="json", include={"interfaces", "addresses", "gateways", "dns"})


# -- what the appliance and the agent leave each other -------------------------------------------


class Request(BaseModel):
    """A network the operator asked for, left by the appliance for the agent."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    network: SiteNetwork
    confirm_within_s: int = Field(CONFIRM_DEFAULT_S, ge=CONFIRM_MIN_S, le=CONFIRM_MAX_S)
    asked_by: str = Field("", max_length=200)


Outcome = Literal["trying", "applied", "rolled_back", "refused"]


class Attempt(BaseModel):
    """What became of a request."""

    model_config = ConfigDict(extra="forbid")

    id: str
    outcome: Outcome
    network: SiteNetwork | None = None  # None: a request that could not be read
    asked_by: str = ""
    started_at: datetime
    deadline: datetime | None = None
    ended_at: datetime | None = None
    reason: str | None = None


class State(BaseModel):
    """The agent's account of the node's network: what is in force, and the last attempt."""

    model_config = ConfigDict(extra="forbid")

    applied: SiteNetwork = Field(default_factory=SiteNetwork)
    source: str = "the image's default (DHCP)"
    provisioned: str | None = None  # sha256 of the provisioning file last taken
    last: Attempt | None = None

    @classmethod
    def read(cls, path: Path) -> State | None:
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None
        return cls.model_validate_json(text)

    def text(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"


class Paths(BaseModel):
    """Where the two sides leave their files: the appliance's folder (it writes requests
    and confirmations there) and the agent's (it alone writes the state)."""

    model_config = ConfigDict(frozen=True)

    appliance: Path  # DATA/network: requests and confirmations
    agent: Path  # the agent's own folder: state.json, trial.json

    @property
    def request(self) -> Path:
        return self.appliance / "request.json"

    def confirmation(self, attempt: str) -> Path:
        return self.appliance / f"confirm-{attempt}"

    @property
    def state(self) -> Path:
        return self.agent / "state.json"

    @property
    def trial(self) -> Path:
        return self.agent / "trial.json"
