"""Network namespaces and veth pairs through iproute2: the demo runs its hub in one, and
the `netns` tests run hubs, appliances and tunnels in them.

Every function needs root (CAP_NET_ADMIN). Addresses on the links the project makes come
from 198.18.0.0/15, the range reserved for benchmarking, so nothing real is addressed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from contextlib import suppress
from pathlib import Path


class NetnsError(Exception):
    """An `ip` command failed; the message carries its error."""


def _ip() -> str | None:
    # Non-root users often lack the sbin folders on PATH, where Debian puts `ip`.
    return shutil.which("ip", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def available() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if _ip() is None:
        return "`ip` (iproute2) is not installed; run `just setup`"
    return None


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # Arguments are names and addresses the project makes, never a shell line.
    return subprocess.run(  # noqa: S603
        [_ip() or "ip", *args], capture_output=True, text=True, check=False, timeout=30
    )


def ip(*args: str) -> None:
    result = _run(*args)
    if result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def argv(ns: str, *command: str) -> list[str]:
    """`command` run inside namespace `ns`."""
    return [_ip() or "ip", "netns", "exec", ns, *command]


def exists(ns: str) -> bool:
    return Path("/run/netns", ns).exists()


def pids_in(ns: str) -> list[int]:
    """The processes running in namespace `ns`."""
    return [int(pid) for pid in _run("netns", "pids", ns).stdout.split()]


def delete(ns: str) -> None:
    """Kill what runs in `ns`, then delete it (and so the veth ends inside it). A process
    left in a namespace would keep it, and its links, alive after the delete."""
    if not exists(ns):
        return
    for pid in pids_in(ns):
        with suppress(ProcessLookupError):  # it may have exited since
            os.kill(pid, signal.SIGKILL)
    _run("netns", "del", ns)


def delete_link(name: str) -> None:
    """Delete interface `name` of this namespace, if it (still) exists."""
    _run("link", "del", name)


def veth_into(ns: str, outside: str, inside: str, outside_cidr: str, inside_cidr: str) -> None:
    """A veth pair: `outside` (with `outside_cidr`) stays in the caller's namespace,
    `inside` (with `inside_cidr`) goes into `ns`; both up, `lo` of `ns` too."""
    ip("link", "add", outside, "type", "veth", "peer", "name", inside)
    ip("link", "set", inside, "netns", ns)
    ip("addr", "add", outside_cidr, "dev", outside)
    ip("-n", ns, "addr", "add", inside_cidr, "dev", inside)
    ip("link", "set", outside, "up")
    ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", ns, "link", "set", inside, "up")
