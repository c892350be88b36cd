"""The boot's health check (image/health.py): a slot is marked good only once the appliance
serves; a slot on trial that does not is marked bad and the node reboots; every outcome is
reported on the data partition."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from image.health import LOADER_GUID, Appliance, Checks, check, rauc


class Fake(Appliance):
    """An appliance that becomes ready after `ready_after` probes (never: None), restarting
    `restarts_per_probe` times between probes."""

    def __init__(self, ready_after: int | None, restarts_per_probe: int = 0) -> None:
        super().__init__(port=1)
        self.ready_after = ready_after
        self.restarts_per_probe = restarts_per_probe
        self.probes = 0

    def answers(self, path: str) -> bool:
        self.probes += 1
        return self.ready_after is not None and self.probes > self.ready_after

    def restarts(self) -> int:
        return self.probes * self.restarts_per_probe


@pytest.fixture
def checks(tmp_path: Path) -> Checks:
    (tmp_path / "cmdline").write_text("root=PARTUUID=x rauc.slot=B\n")
    (tmp_path / "efivars").mkdir()
    (tmp_path / "image.json").write_text(json.dumps({"version": "0.2.0"}))
    return Checks(
        ready_s=3600,
        max_restarts=5,
        interval_s=0,
        report=tmp_path / "update/health.jsonl",
        cmdline=tmp_path / "cmdline",
        efivars=tmp_path / "efivars",
        image_json=tmp_path / "image.json",
    )


def on_trial(checks: Checks, entry: str = "\\loader\\entries\\kovenlab-b+0-1.conf") -> None:
    """What systemd-boot leaves when it counted the boot: attributes, then UTF-16."""
    variable = checks.efivars / f"LoaderBootCountPath-{LOADER_GUID}"
    variable.write_bytes(b"\x06\x00\x00\x00" + (entry + "\0").encode("utf-16-le"))


def reports(checks: Checks) -> list[dict[str, object]]:
    return [json.loads(line) for line in checks.report.read_text().splitlines()]


def test_a_trial_that_becomes_ready_is_marked_good(checks: Checks) -> None:
    on_trial(checks)
    marks: list[str] = []
    reboots: list[bool] = []

    code = check(checks, Fake(ready_after=3), marks.append, lambda: reboots.append(True))

    assert (code, marks, reboots) == (0, ["mark-good"], [])
    (report,) = reports(checks)
    assert report["slot"] == "B"
    assert report["version"] == "0.2.0"
    assert (report["trial"], report["result"], report["reason"]) == (True, "good", None)


def test_a_trial_in_a_crash_loop_is_marked_bad_and_the_node_reboots(checks: Checks) -> None:
    on_trial(checks)
    marks: list[str] = []
    reboots: list[bool] = []

    code = check(checks, Fake(ready_after=None, restarts_per_probe=1), marks.append,
                 lambda: reboots.append(True))  # fmt: skip

    assert (code, marks, reboots) == (1, ["mark-bad"], [True])
    (report,) = reports(checks)
    assert report["result"] == "bad"
    assert "restarted 5 times without becoming ready" in str(report["reason"])


def test_a_trial_never_ready_is_marked_bad_after_its_bound(checks: Checks) -> None:
    on_trial(checks)
    marks: list[str] = []
    slow = Checks(**{**checks.__dict__, "ready_s": 0.0})

    assert check(slow, Fake(ready_after=None), marks.append, lambda: None) == 1
    assert marks == ["mark-bad"]
    assert "not ready after 0 s" in str(reports(slow)[0]["reason"])


def test_a_good_slot_that_fails_stays_and_says_so(checks: Checks) -> None:
    marks: list[str] = []
    reboots: list[bool] = []

    code = check(checks, Fake(ready_after=None, restarts_per_probe=2), marks.append,
                 lambda: reboots.append(True))  # fmt: skip

    assert (code, marks, reboots) == (1, [], [])
    assert reports(checks)[0]["result"] == "unhealthy"
    assert reports(checks)[0]["trial"] is False


def test_rauc_is_asked_again_when_its_service_does_not_answer() -> None:
    """RAUC's command line asks its D-Bus service, which a busy boot can leave unanswered
    past the client's timeout: tried again, with longer waits, and given up after five."""
    calls: list[list[str]] = []
    waits: list[float] = []

    def flaky(argv: list[str], check: bool) -> None:
        calls.append(argv)
        if len(calls) < 3:
            raise subprocess.CalledProcessError(1, argv)

    rauc("mark-good", run=flaky, sleep=waits.append)
    assert calls == [["/usr/bin/rauc", "status", "mark-good"]] * 3
    assert waits == [5.0, 10.0]

    def broken(argv: list[str], check: bool) -> None:
        raise subprocess.CalledProcessError(1, argv)

    waits.clear()
    with pytest.raises(subprocess.CalledProcessError):
        rauc("mark-bad", run=broken, sleep=waits.append)
    assert waits == [5.0, 10.0, 20.0, 40.0]
