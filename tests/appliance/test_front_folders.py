"""The TLS front's folders (appliance/gateway/front.py): a private one and, on /dev/shm, the
decisions' cache, made at each start and removed at its end. A start that did not end
(killed, crashed) leaves them: the next start removes those, and only those, of a process
that is gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from appliance.gateway.front import _started, nginx_binary, remove_stale
from tests.appliance.front_processes import start, stop

SHM = Path("/dev/shm")  # noqa: S108 - where the front keeps its decisions


def _folder(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir()
    (folder / "kept").write_bytes(b"a decision")
    return folder


def test_only_our_folders_of_gone_processes_are_removed(tmp_path: Path) -> None:
    me = os.getpid()
    now = _started(me)
    assert now is not None
    child = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)
    child_started = _started(child.pid)
    child.communicate(b"\n")  # it ends: its folders are stale
    assert child_started is not None
    gone = [
        _folder(tmp_path, f"kvl-front-decisions-{child.pid}-{child_started}-a1"),
        _folder(tmp_path, f"kvl-front-{child.pid}-{child_started}-b2"),
        # This pid, another start: a process before this one that had the same pid.
        _folder(tmp_path, f"kvl-front-decisions-{me}-{now - 1}-c3"),
    ]
    kept = [
        _folder(tmp_path, f"kvl-front-decisions-{me}-{now}-d4"),  # this process's own
        _folder(tmp_path, f"kvl-front-{me}-{now}-e5"),
        _folder(tmp_path, "kvl-front-files-123-456-f6"),  # not the front's
        _folder(tmp_path, "kvl-front-decisions-g7"),  # no process named: cannot be told
        _folder(tmp_path, "other-1-2-h8"),
    ]
    link = tmp_path / f"kvl-front-{child.pid}-{child_started}-i9"
    link.symlink_to(kept[0])  # a link, not a folder: left, and nothing through it
    if os.geteuid() == 0:  # another user's, though named as ours
        foreign = _folder(tmp_path, f"kvl-front-{child.pid}-{child_started}-j0")
        os.chown(foreign, 12345, 12345)
        kept.append(foreign)
    removed = remove_stale((tmp_path,))
    assert sorted(removed) == sorted(gone)
    assert not any(folder.exists() for folder in gone)
    assert all((folder / "kept").exists() for folder in kept)
    assert link.is_symlink()


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed: `just setup-system`")
def test_a_killed_starts_folders_are_removed_at_the_next_start(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = start(tmp_path / "one")
    try:
        (master,) = [p for p in psutil.Process(first.process.pid).children() if p.name() == "nginx"]
        args = master.cmdline()
        private = Path(args[args.index("-p") + 1])
        stamp = private.name.removeprefix("kvl-front-").rsplit("-", 1)[0]
        decisions = list(SHM.glob(f"kvl-front-decisions-{stamp}-*")) if SHM.is_dir() else []
    finally:
        first.process.kill()  # no end of its own: its folders stay
        first.process.wait()
    left = [private, *decisions]
    assert all(folder.is_dir() for folder in left), left
    second = start(tmp_path / "two")
    try:
        assert not any(folder.exists() for folder in left), left
        (master,) = [
            p for p in psutil.Process(second.process.pid).children() if p.name() == "nginx"
        ]
        args = master.cmdline()
        assert Path(args[args.index("-p") + 1]).is_dir()  # its own are made
    finally:
        stop(second)
