"""Isolation levels of the model workers (shared.classes.IsolationLevel), as they really are.

Every replica runs in its own worker process: I1. Where the machine allows, each worker
also gets a cgroup v2 of its own with `memory.max` and `cpu.max` set: I2. It allows when
the unified hierarchy is mounted at /sys/fs/cgroup with the memory and cpu controllers,
and the appliance may make cgroups beside its own: under its own cgroup's parent (a
delegated subtree, such as a systemd service with `Delegate=yes` whose main process sits
in a leaf), or under the root when that is its own (a container with its own cgroup
namespace). Nothing is moved but the workers; where any step fails the worker runs
unconfined and is reported I1.

What a heartbeat reports is read back, never assumed: a worker counts as I2 only while
/proc/PID/cgroup names its cgroup and that cgroup's `memory.max` and `cpu.max` are limits
(not "max"). I3 is the hub's to grant (I2 on a node dedicated to a tenant): a node reports
at most I2.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from shared.classes import IsolationLevel

log = logging.getLogger(__name__)

CGROUP_FS = Path("/sys/fs/cgroup")
PROC = Path("/proc")
_CONTROLLERS = {"memory", "cpu"}
_PERIOD_US = 100_000


@dataclass(frozen=True)
class Limits:
    """What a confined worker may use."""

    memory_mib: int
    cpus: float  # cores' worth of CPU time


@dataclass(frozen=True)
class Cgroups:
    """Where worker cgroups are made, or why none can be (`base` None)."""

    base: Path | None
    why_not: str = ""

    @property
    def level(self) -> IsolationLevel:
        """The highest level this node can run a worker at."""
        return IsolationLevel.I2 if self.base is not None else IsolationLevel.I1


def _own_path(pid: int | str = "self", proc: Path = PROC) -> str | None:
    """The process's cgroup v2 path ("0::/a/b" in /proc/PID/cgroup), or None."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def _controllers(path: Path, name: str) -> set[str]:
    try:
        return set((path / name).read_text().split())
    except OSError:
        return set()


def find_cgroups(root: Path = CGROUP_FS, proc: Path = PROC) -> Cgroups:
    """Where this appliance can make worker cgroups with memory and cpu limits."""
    base, why = _base(root, proc)
    if base is not None:
        why = _usable(base)
    return Cgroups(None if why else base, why)


def _base(root: Path, proc: Path) -> tuple[Path | None, str]:
    if not (root / "cgroup.controllers").is_file():
        return None, f"no cgroup v2 hierarchy at {root} (cgroup v1 or hybrid)"
    own = _own_path(proc=proc)
    if own is None:
        return None, "this process is in no cgroup v2"
    mine = root / own.lstrip("/")
    # A cgroup with processes in it cannot hand controllers to children (but the root):
    # the workers go beside this process, not below it.
    base = mine if own == "/" else mine.parent
    if not base.is_relative_to(root):
        return None, f"{mine} is outside {root}"
    return base, ""


def _usable(base: Path) -> str:
    """Why workers cannot get cgroups under `base` ("" when they can)."""
    if not _controllers(base, "cgroup.controllers") >= _CONTROLLERS:
        return f"{base} has no memory and cpu controllers"
    if not _controllers(base, "cgroup.subtree_control") >= _CONTROLLERS:
        with contextlib.suppress(OSError):
            (base / "cgroup.subtree_control").write_text("+memory +cpu")
        if not _controllers(base, "cgroup.subtree_control") >= _CONTROLLERS:
            return f"{base} does not give memory and cpu to its children"
    if not os.access(base, os.W_OK):
        return f"{base} is not writable by this appliance"
    return ""


def confine(cgroups: Cgroups, pid: int, limits: Limits) -> Path | None:
    """Put worker `pid` in a cgroup of its own under `cgroups.base` with `limits`; the
    cgroup, or None when that failed (the worker runs on, unconfined: I1)."""
    if cgroups.base is None:
        return None
    group = cgroups.base / f"kvl-worker-{pid}"
    try:
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(str(max(1, limits.memory_mib) << 20))
        quota = max(1000, int(limits.cpus * _PERIOD_US))
        (group / "cpu.max").write_text(f"{quota} {_PERIOD_US}")
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as err:
        log.warning("worker %d runs without cgroup limits (I1): %s", pid, err)
        release(group)
        return None
    return group


def level_of(pid: int | None, group: Path | None, proc: Path = PROC) -> IsolationLevel:
    """The level worker `pid` runs at now, read back: I2 while it is in `group` and the
    group's memory and cpu limits are set; I1 otherwise (and for a worker not running)."""
    if pid is None or group is None:
        return IsolationLevel.I1
    own = _own_path(pid, proc)
    if own is None or not str(group).endswith(own):
        return IsolationLevel.I1
    try:
        memory = (group / "memory.max").read_text().strip()
        cpu = (group / "cpu.max").read_text().split()[0]
    except (OSError, IndexError):
        return IsolationLevel.I1
    return IsolationLevel.I2 if "max" not in {memory, cpu} else IsolationLevel.I1


def release(group: Path | None) -> None:
    """Remove a worker's cgroup once the worker is gone (an empty cgroup's directory)."""
    if group is not None:
        with contextlib.suppress(OSError):
            group.rmdir()
