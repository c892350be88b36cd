"""The README's first command: `kvl demo` starts a hub in a network namespace and an
appliance enrolled with it over a real WireGuard tunnel, and prints how to reach the LAN
API. The demo runs here inside a namespace of the test's own (the "machine"), so its veth
link and tunnel never touch the real one; it is stopped and started again to show that
the appliance keeps its identity."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from appliance.state.records import ModelRecord
from appliance.state.store import Store
from hub.settings import HubSettings
from hub.state.store import open_store
from image import netns
from tests.conftest import REAL_MODEL_ENV
from tests.netns import require_netns

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.netns, pytest.mark.model]

REPO = Path(__file__).resolve().parent.parent
PORT = 8080


@pytest.fixture
def machine() -> Iterator[tuple[str, str]]:
    """A namespace standing in for the machine, and the suffix for the demo's names."""
    require_netns()
    suffix = f"{os.getpid() % 1000}{os.urandom(2).hex()}"[:8]
    name = f"kvl-machine-{suffix}"
    netns.ip("netns", "add", name)
    netns.ip("-n", name, "link", "set", "lo", "up")
    try:
        yield name, suffix
    finally:
        netns.delete(name)


class Running:
    """`kvl demo` in the machine namespace, its output collected line by line."""

    def __init__(self, machine: str, suffix: str, data: Path) -> None:
        env = {
            **os.environ,
            "KVL_DISCOVERY__ENABLED": "false",
            "KVL_EMBEDDINGS__ENABLED": "false",
            "KVL_MODEL__N_CTX": "512",
            # The demo's subject is the fleet, not admission: on a loaded host the default S1
            # shed the chat with 429 (its first token would come after 10 s).
            **REAL_MODEL_ENV,
        }
        self.process = subprocess.Popen(
            netns.argv(machine, sys.executable, "-m", "shared.cli", "demo",
                       "--port", str(PORT), "--data-dir", str(data), "--suffix", suffix),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while "Ctrl-C stops both." not in self.lines:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the demo did not become ready:\n{self.output}")
            time.sleep(0.3)

    def stop(self, signum: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode


def _in_machine(machine: str, code: str) -> tuple[int, str]:
    """Run Python `code` on the machine; (the status it prints first, the rest of its
    line, or its error's end)."""
    out = subprocess.run(
        netns.argv(machine, sys.executable, "-c", code),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    status, _, rest = out.stdout.strip().partition(" ")
    return int(status or 0), rest or out.stderr[-500:]


def chat(machine: str, ca: Path, key: str) -> tuple[int, str]:
    """What the printed curl line does, from the machine: HTTPS verified by the hub's CA."""
    code = (
        "import json, ssl, urllib.request\n"
        f"ctx = ssl.create_default_context(cafile={str(ca)!r})\n"
        f"r = urllib.request.Request('https://127.0.0.1:{PORT}/v1/chat/completions', "
        "data=json.dumps({'model': 'gemma-3-270m', 'max_tokens': 4, "
        "'messages': [{'role': 'user', 'content': 'Hi'}]}).encode(), "
        f"headers={{'Authorization': 'Bearer {key}', 'Content-Type': 'application/json'}})\n"
        "a = urllib.request.urlopen(r, timeout=60, context=ctx)\n"
        "print(a.status, json.load(a)['object'])\n"
    )
    return _in_machine(machine, code)


def console_login(machine: str, ca: Path, password: str) -> tuple[int, str]:
    """What a person does with the printed console lines, from the machine: the login
    page, then its form with the demo user's password; (status, where it sends them)."""
    code = (
        "import http.client, re, ssl, urllib.parse\n"
        f"ctx = ssl.create_default_context(cafile={str(ca)!r})\n"
        "c = http.client.HTTPSConnection('198.18.0.2', 8443, context=ctx, timeout=60)\n"
        "c.request('GET', '/console/login')\n"
        "r = c.getresponse(); r.read()\n"
        "cookie = r.getheader('Set-Cookie').split(';')[0]\n"
        "csrf = cookie.split('=', 1)[1]\n"
        "form = urllib.parse.urlencode({'csrf': csrf, 'name': 'demo', "
        f"'password': {password!r}}})\n"
        "c.request('POST', '/console/login', body=form, headers={'Cookie': cookie, "
        "'Content-Type': 'application/x-www-form-urlencoded', "
        "'Origin': 'https://198.18.0.2:8443'})\n"
        "r = c.getresponse(); r.read()\n"
        "print(r.status, r.getheader('Location'))\n"
    )
    return _in_machine(machine, code)


def links(machine: str) -> str:
    out = subprocess.run(
        ["ip", "-n", machine, "-o", "link"], capture_output=True, text=True, check=True
    )
    return out.stdout


def test_demo_runs_a_hub_and_an_appliance_enrolled_over_wireguard(
    machine: tuple[str, str], tmp_path: Path, default_model: ModelRecord
) -> None:
    name, suffix = machine
    data = tmp_path / "demo"
    # The model the session already assembled (the demo would assemble it otherwise).
    store = Store(data / "appliance" / "appliance.db")
    store.add_model(default_model)
    store.close()

    first = Running(name, suffix, data)
    try:
        first.wait_ready()
        key = (data / "demo.key").read_text().strip()
        assert key in first.output
        ca = data / "hub" / "pki" / "ca.crt"
        assert f"curl -s --cacert {ca} https://127.0.0.1:{PORT}/v1/chat/completions" in first.output
        assert "overlay address 198.18.64.2" in first.output
        assert f"tunnel up (kvd{suffix}-wg)" in first.output
        # llama.cpp's own log (its loader's key by key report) is the log's, at debug
        # level: the terminal shows the project's progress lines.
        assert not [line for line in first.lines if "llama_model_loader" in line], first.output
        # The key was made on the hub; the appliance accepts it, over TLS the hub's CA signed.
        assert chat(name, ca, key) == (200, "chat.completion")
        assert f"kvd{suffix}-wg" in links(name)
        # The console, as printed: its address and the demo user's password, which logs in.
        password = (data / "console.password").read_text().strip()
        assert "https://198.18.0.2:8443/console/" in first.output
        assert f'user "demo", password {password}' in first.output
        assert console_login(name, ca, password) == (303, "/console/nodes")  # logged in
    finally:
        assert first.stop() == 0, first.output
        assert "Traceback" not in first.output

    # Stopped: the tunnel, the veth end and the hub are gone from the machine.
    assert f"kvd{suffix}" not in links(name)
    assert not any(str(data / "hub") in " ".join(p.info["cmdline"] or ()) for p in
                   psutil.process_iter(["cmdline"]))  # fmt: skip

    hub = open_store(HubSettings.model_validate({"data_dir": data / "hub"}))
    try:
        nodes = hub.nodes.all()
        assert [(n.name, n.site, n.overlay_address) for n in nodes] == [
            ("demo-appliance", "demo", "198.18.64.2")
        ]
        enrolled_id = nodes[0].id
    finally:
        hub.close()

    # Started again: the same identity (no second enrollment), served again.
    second = Running(name, suffix, data)
    try:
        second.wait_ready()
        assert "kvl demo: enrolling" not in second.output
        status, detail = chat(name, data / "hub" / "pki" / "ca.crt", key)
        assert status == 200, detail
    finally:
        assert second.stop(signal.SIGINT) == 0, second.output  # Ctrl-C
        assert "Traceback" not in second.output
    hub = open_store(HubSettings.model_validate({"data_dir": data / "hub"}))
    try:
        assert [n.id for n in hub.nodes.all()] == [enrolled_id]
    finally:
        hub.close()
