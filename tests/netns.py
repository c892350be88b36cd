"""Two network namespaces joined by a veth pair, for the `netns` tier.

The link uses 198.18.0.0/15 (the benchmarking range), so nothing real is ever addressed.
Names carry a random suffix, so parallel runs and leftovers of a killed run cannot collide.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from image import netns
from image.netns import ip, pids_in

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "A_ADDR", "B_ADDR", "REPO", "Link", "ip", "linked_namespaces", "pids_in", "require_netns",
    "spawn", "stop",
]  # fmt: skip

A_ADDR = "198.18.0.1"
B_ADDR = "198.18.0.2"


@dataclass(frozen=True)
class Link:
    """Namespace `a` (A_ADDR on `veth_a`) and `b` (B_ADDR on `veth_b`) on one veth link."""

    a: str
    b: str
    suffix: str  # unique per test; interface names built on it stay within 15 characters

    @property
    def veth_a(self) -> str:
        return f"kva{self.suffix}"

    @property
    def veth_b(self) -> str:
        return f"kvb{self.suffix}"

    def argv(self, ns: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]


def require_netns() -> None:
    why = netns.available()
    if why is not None:
        pytest.skip(f"netns test: {why}")


@contextmanager
def linked_namespaces() -> Iterator[Link]:
    """Make the two namespaces and the link; on the way out kill what runs in them, delete them."""
    require_netns()
    suffix = f"{os.getpid() % 100_000}{secrets.token_hex(2)}"
    link = Link(a=f"kvl-a-{suffix}", b=f"kvl-b-{suffix}", suffix=suffix)
    try:
        ip("netns", "add", link.a)
        ip("netns", "add", link.b)
        ip("link", "add", link.veth_a, "type", "veth", "peer", "name", link.veth_b)
        ip("link", "set", link.veth_a, "netns", link.a)
        ip("link", "set", link.veth_b, "netns", link.b)
        ip("-n", link.a, "addr", "add", f"{A_ADDR}/24", "dev", link.veth_a)
        ip("-n", link.b, "addr", "add", f"{B_ADDR}/24", "dev", link.veth_b)
        for ns, veth in ((link.a, link.veth_a), (link.b, link.veth_b)):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", veth, "multicast", "on", "up")
        yield link
    finally:
        for ns in (link.a, link.b):
            netns.delete(ns)
        # Deleting a namespace destroys the veth ends in it; this catches a setup that failed
        # before the pair was moved out of the root namespace.
        subprocess.run(["ip", "link", "del", link.veth_a], capture_output=True, check=False)


REPO = Path(__file__).resolve().parent.parent


def spawn(
    link: Link, ns: str, args: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            link.argv(ns, sys.executable, "-m", "shared.cli", *args),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **env},
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
