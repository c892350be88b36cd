"""`kvl demo`: the main job on one machine. A hub in its own network namespace and an
appliance in this one, enrolled over HTTPS with a pinned certificate and then joined to
the hub by a real WireGuard tunnel over a veth link; a key made on the hub reaches the
appliance as desired state, and the appliance serves the LAN API over TLS with the
certificate the hub's CA issued it.

The demo drives the two through their own commands (`kvl hub …`, `kvl appliance …`) in
child processes, so it imports neither. Without root (no namespaces) it serves the
appliance alone and says why. Ctrl-C stops both and removes the namespace; the data
directory keeps every identity, so the next run starts where this one stopped.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from image import netns
from shared.files import write_private

if TYPE_CHECKING:
    from collections.abc import Callable

# The veth link and the overlay both come from 198.18.0.0/15, the benchmarking range: the
# demo's tunnel and routes can never shadow a real network of the machine it runs on.
HOST_ADDR = "198.18.0.1"
HUB_ADDR = "198.18.0.2"
LINK_PREFIX = 30
OVERLAY = "198.18.64.0/24"
HUB_PORT = 8443
WG_PORT = 51820
ACCOUNT = "demo"
NODE_NAME = "demo-appliance"
CONSOLE_USER = "demo"  # the console user the demo makes (a password of its own)


class DemoError(Exception):
    """The demo could not start; the message says what failed and where its log is."""


@dataclass(frozen=True)
class Names:
    """The demo's namespace and interfaces; a suffix keeps concurrent demos (the tests)
    apart, interface names within Linux's 15 characters."""

    suffix: str = "0"

    @property
    def namespace(self) -> str:
        return f"kvl-demo{self.suffix}"

    @property
    def veth_host(self) -> str:
        return f"kvd{self.suffix}-h"

    @property
    def veth_hub(self) -> str:
        return f"kvd{self.suffix}-n"

    @property
    def hub_wireguard(self) -> str:
        return f"kvd{self.suffix}-hub"

    @property
    def node_wireguard(self) -> str:
        # wireguard-go's UAPI socket folder is shared by every namespace: unique names.
        return f"kvd{self.suffix}-wg"


@dataclass(frozen=True)
class Layout:
    """Where the demo keeps things, under one data directory."""

    data: Path

    @property
    def hub(self) -> Path:
        return self.data / "hub"

    @property
    def appliance(self) -> Path:
        return self.data / "appliance"

    @property
    def key(self) -> Path:
        return self.data / "demo.key"

    @property
    def provisioning(self) -> Path:
        return self.data / "kovenlab.json"

    @property
    def console_password(self) -> Path:
        return self.data / "console.password"

    @property
    def hub_log(self) -> Path:
        return self.data / "hub.log"

    @property
    def ca(self) -> Path:
        return self.hub / "pki" / "ca.crt"

    @property
    def lan_certificate(self) -> Path:
        return self.appliance / "fleet" / "node.crt"


class _Stop(Exception):  # noqa: N818 - a signal, not an error
    """SIGTERM or SIGINT: stop both and clean up."""


def _raise_stop(signum: int, frame: object) -> NoReturn:
    raise _Stop


KVL = [sys.executable, "-m", "shared.cli"]


def _die_with_parent() -> None:
    """In the child before exec: its own process group (Ctrl-C reaches the demo alone,
    which stops the children in order), and SIGTERM should the demo die without cleaning up."""
    import ctypes  # noqa: PLC0415

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(
    argv: list[str], env: dict[str, str], log: Path | None = None
) -> subprocess.Popen[bytes]:
    """A child server: its output to `log`, or to this terminal."""
    out = log.open("ab") if log is not None else None
    try:
        return subprocess.Popen(  # noqa: S603 - our own command line
            argv,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env=env,
            process_group=0,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads run yet
        )
    finally:
        if out is not None:
            out.close()


def _env(extra: dict[str, str]) -> dict[str, str]:
    # The demo runs on the embedded defaults: a config file of the caller's is not read.
    env = {k: v for k, v in os.environ.items() if k != "KVL_CONFIG"}
    return {**env, **extra}


def _kvl(*args: str, env: dict[str, str], stdin: str | None = None) -> str:
    result = subprocess.run(  # noqa: S603 - our own command line
        [*KVL, *args], capture_output=True, text=True, check=False, env=env, timeout=300,
        input=stdin,
    )  # fmt: skip
    if result.returncode != 0:
        raise DemoError(f"`kvl {' '.join(args[:2])}` failed:\n{result.stderr.strip()}")
    return result.stdout


def _wait(ready: Callable[[], bool], processes: dict[str, subprocess.Popen[bytes]]) -> None:
    """Until `ready()`; a child that exits first is an error."""
    while not ready():
        for what, process in processes.items():
            if process.poll() is not None:
                raise DemoError(f"the {what} exited with status {process.returncode}")
        time.sleep(0.3)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _answers(url: str, key: str | None, context: ssl.SSLContext | None) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 - our own URL
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as answer:  # noqa: S310
            return int(answer.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)  # both servers drain on SIGINT
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Demo:
    def __init__(self, data: Path, port: int, names: Names) -> None:
        self.layout = Layout(data)
        self.port = port
        self.names = names
        self.hub_env = _env(
            {
                "KVL_HUB_SERVER__NAMES": json.dumps([HUB_ADDR]),
                "KVL_HUB_SERVER__PORT": str(HUB_PORT),
                "KVL_HUB_OVERLAY__PREFIX": OVERLAY,
                "KVL_HUB_OVERLAY__ENDPOINT": f"{HUB_ADDR}:{WG_PORT}",
                "KVL_HUB_OVERLAY__LISTEN_PORT": str(WG_PORT),
                "KVL_HUB_OVERLAY__INTERFACE": names.hub_wireguard,
            }
        )
        self.node_env = _env(
            {
                "KVL_FLEET__PROVISIONING_FILE": str(self.layout.provisioning),
                "KVL_FLEET__INTERFACE": names.node_wireguard,
            }
        )
        self.hub: subprocess.Popen[bytes] | None = None
        self.appliance: subprocess.Popen[bytes] | None = None

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, _raise_stop)
        try:
            self._start()
            _wait(lambda: False, self._processes())
        except _Stop:
            return 0
        except KeyboardInterrupt:
            return 0
        except (DemoError, netns.NetnsError) as err:
            click.echo(f"kvl demo: {err}", err=True)
            if self.layout.hub_log.is_file():
                tail = self.layout.hub_log.read_text(errors="replace").splitlines()[-15:]
                click.echo(f"the end of {self.layout.hub_log}:\n" + "\n".join(tail), err=True)
            return 1
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.close()
        return 0  # pragma: no cover - _wait returns only by raising

    def _start(self) -> None:
        layout, names = self.layout, self.names
        layout.hub.mkdir(parents=True, exist_ok=True)
        layout.appliance.mkdir(parents=True, exist_ok=True)
        click.echo("kvl demo: preparing the hub (account, key, provisioning file)", err=True)
        if not layout.key.is_file():
            _kvl("hub", "accounts", "set", ACCOUNT, "--data-dir", str(layout.hub), env=self.hub_env)
            key = _kvl(
                "hub", "keys", "create", "--account", ACCOUNT, "--data-dir", str(layout.hub),
                env=self.hub_env,
            ).strip()  # fmt: skip
            write_private(layout.key, key + "\n")
        if not layout.console_password.is_file():
            # A console user for the demo, with a password made here and kept beside the
            # key: the console is part of what the demo shows.
            password = secrets.token_urlsafe(12)
            _kvl(
                "hub", "admin", "create", "--name", CONSOLE_USER, "--password-stdin",
                "--data-dir", str(layout.hub), env=self.hub_env, stdin=password + "\n",
            )  # fmt: skip
            write_private(layout.console_password, password + "\n")
        enrolled = (layout.appliance / "fleet" / "identity.json").is_file()
        if not enrolled:
            _kvl(
                "hub", "provision", "--site", "demo", "--name", NODE_NAME,
                "--url", f"https://{HUB_ADDR}:{HUB_PORT}", "--expires", "1h",
                "--output", str(layout.provisioning), "--data-dir", str(layout.hub),
                env=self.hub_env,
            )  # fmt: skip

        # Leftovers of a demo that was killed: its namespace, its veth end, its tunnel.
        netns.delete(names.namespace)
        for link in (names.veth_host, names.node_wireguard):
            netns.delete_link(link)
        netns.ip("netns", "add", names.namespace)
        netns.veth_into(
            names.namespace,
            names.veth_host,
            names.veth_hub,
            f"{HOST_ADDR}/{LINK_PREFIX}",
            f"{HUB_ADDR}/{LINK_PREFIX}",
        )

        click.echo(
            f"kvl demo: starting the hub in network namespace {names.namespace} "
            f"(log: {layout.hub_log})",
            err=True,
        )
        self.hub = _spawn(
            netns.argv(names.namespace, *KVL, "hub", "serve", "--data-dir", str(layout.hub),
                       "--host", HUB_ADDR),
            self.hub_env,
            layout.hub_log,
        )  # fmt: skip
        _wait(lambda: _listening(HUB_ADDR, HUB_PORT), {"hub": self.hub})

        if not enrolled:
            click.echo("kvl demo: enrolling the appliance with the hub", err=True)
            _kvl("appliance", "enroll", "--data-dir", str(layout.appliance), env=self.node_env)
        click.echo(
            "kvl demo: starting the appliance (the first start assembles the model)", err=True
        )
        serve = [
            "appliance",
            "serve",
            "--data-dir",
            str(layout.appliance),
            "--port",
            str(self.port),
        ]
        self.appliance = _spawn([*KVL, *serve], self.node_env)
        tls = layout.lan_certificate.is_file()
        scheme = "https" if tls else "http"
        context = ssl.create_default_context(cafile=str(layout.ca)) if tls else None
        base = f"{scheme}://127.0.0.1:{self.port}"
        key = layout.key.read_text().strip()
        processes = self._processes()
        _wait(lambda: _answers(f"{base}/readyz", None, context), processes)
        # The key was made on the hub: it works once the desired state came through the tunnel.
        _wait(lambda: _answers(f"{base}/v1/models", key, context), processes)
        report = ["appliance", "status", "--json", "--data-dir", str(layout.appliance)]
        status = json.loads(_kvl(*report, env=self.node_env))
        click.echo(self._message(base, key, status, tls=tls))

    def _processes(self) -> dict[str, subprocess.Popen[bytes]]:
        running = {"hub": self.hub, "appliance": self.appliance}
        return {what: process for what, process in running.items() if process is not None}

    def _message(self, base: str, key: str, status: dict[str, object], *, tls: bool) -> str:
        layout, names = self.layout, self.names
        kvl = os.path.relpath(Path(sys.executable).parent / "kvl")
        cacert = f"--cacert {layout.ca} " if tls else ""
        body = (
            '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", '
            '"content": "Write a haiku about the sea."}], "max_tokens": 48}'
        )
        return f"""
Kovenlab Edge demo: a hub and an appliance, joined over WireGuard.

  hub        https://{HUB_ADDR}:{HUB_PORT} in network namespace {names.namespace}
             (log: {layout.hub_log})
  appliance  {base}/v1 on every interface of this machine; enrolled as
             {status.get("name")}, overlay address {status.get("overlay_address")},
             tunnel {status.get("tunnel")}
  API key    {key}
             (account "{ACCOUNT}", made on the hub and pushed to the appliance through
             the tunnel; kept in {layout.key})

Try it{" (the appliance's certificate is signed by the hub's CA)" if tls else ""}:
  curl -s {cacert}{base}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{body}'
Any OpenAI client works with base URL {base}/v1 and the key above.

The hub's console (its certificate is signed by the hub's CA, {layout.ca}: import it
into the browser, or accept the warning once):
  https://{HUB_ADDR}:{HUB_PORT}/console/
  user "{CONSOLE_USER}", password {layout.console_password.read_text().strip()}
  (kept in {layout.console_password}; more users: {kvl} hub admin create --name NAME
  --data-dir {layout.hub})

The fleet as the hub sees it, and the link as the appliance sees it:
  {kvl} hub nodes list --data-dir {layout.hub}
  {kvl} appliance status --data-dir {layout.appliance}

Ctrl-C stops both.
"""

    def close(self) -> None:
        _stop(self.appliance)  # first: it takes its tunnel down
        _stop(self.hub)
        netns.delete(self.names.namespace)  # the veth pair goes with it
        netns.delete_link(self.names.veth_host)


def serve_alone(data: Path, port: int) -> int:
    """Without root: the appliance alone, with a key of its own."""
    layout = Layout(data)
    layout.appliance.mkdir(parents=True, exist_ok=True)
    env = _env({})
    key_file = layout.data / "local.key"
    if not key_file.is_file():
        key = _kvl(
            "appliance", "keys", "create", "--account", ACCOUNT,
            "--data-dir", str(layout.appliance), env=env,
        ).strip()  # fmt: skip
        write_private(key_file, key + "\n")
    key = key_file.read_text().strip()
    serve = ["appliance", "serve", "--data-dir", str(layout.appliance), "--port", str(port)]
    process = _spawn([*KVL, *serve], env)
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _answers(f"{base}/readyz", None, None), {"appliance": process})
        click.echo(
            f"\nThe appliance is ready at {base}/v1 (alone: no hub).\n  API key {key}\n"
            f"  curl -s {base}/v1/models -H 'Authorization: Bearer {key}'\n\nCtrl-C stops it.\n"
        )
        _wait(lambda: False, {"appliance": process})
    except (_Stop, KeyboardInterrupt):
        return 0
    except DemoError as err:
        click.echo(f"kvl demo: {err}", err=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(process)
    return 0  # pragma: no cover - _wait returns only by raising


@click.command("demo")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, help="LAN API port (8080).")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path(".kvl/demo"),
    help="Where the hub and the appliance keep their data (.kvl/demo).",
)
@click.option(
    "--suffix",
    default="0",
    hidden=True,
    help="Namespace and interface suffix (1-8 letters or digits), for concurrent demos.",
)
def demo(port: int, data_dir: Path, suffix: str) -> None:
    """A hub and an appliance on this machine, joined over WireGuard (needs root)."""
    if not (suffix.isalnum() and 1 <= len(suffix) <= 8):
        raise click.BadParameter("1 to 8 letters or digits", param_hint="--suffix")
    data_dir = data_dir.resolve()
    why = netns.available()
    if why is not None:
        click.echo(
            f"kvl demo: the hub half needs network namespaces, and {why}: "
            "serving the appliance alone (run `sudo .venv/bin/just demo` for the fleet)",
            err=True,
        )
        raise SystemExit(serve_alone(data_dir, port))
    raise SystemExit(Demo(data_dir, port, Names(suffix)).run())
