"""Real `kvl appliance serve` processes with TLS on and nginx in front
(appliance/gateway/front.py), on loopback: started with the operator's certificate files,
ready once the LAN API answers, and stopped."""

from __future__ import annotations

import datetime
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared import pki
from tests.conftest import free_port, kvl, spawn_appliance

HOST = "127.0.0.1"
MAX_BODY = 4096


@dataclass
class Appliance:
    url: str
    port: int
    key: str
    ca: Path
    cert: Path
    key_file: Path
    log: Path
    process: subprocess.Popen[bytes]

    def context(self, alpn: list[str] | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if alpn is not None:
            context.set_alpn_protocols(alpn)
        return context

    def client(self, *, http2: bool = True) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            http2=http2,  # offered with HTTP/1.1: ALPN chooses
            verify=self.context(),
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=30,
        )


def start(
    folder: Path,
    extra: dict[str, str] | None = None,
    seed: Callable[[Path], None] | None = None,
) -> Appliance:
    """A TLS appliance without a model (the routes tested here need none); ``seed`` is
    given its data directory before it starts."""
    ca = pki.new_ca("test CA")
    (folder / "ca.crt").write_bytes(ca.cert_pem)
    (folder / "ca.key").write_bytes(ca.key_pem)
    issue(ca, folder, "appliance.test")
    data = folder / "data"
    key = kvl("appliance", "keys", "create", "--account", "h2", "--data-dir", str(data))
    if seed is not None:
        seed(data)
    port = free_port()
    env = {
        "KVL_SERVER__TLS_CERT_FILE": str(folder / "server.crt"),
        "KVL_SERVER__TLS_KEY_FILE": str(folder / "server.key"),
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_MODEL__DEFAULT": "absent-model",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_CLASSES__AUTH_FAILURES_PER_MINUTE": "3",
        # Small enough that a body over it fits in HTTP/2's first window: httpx sends a
        # whole body before it reads the answer.
        "KVL_SERVER__MAX_BODY_BYTES": str(MAX_BODY),
        **(extra or {}),
    }
    log = folder / "serve.log"
    with log.open("wb") as out:
        process = spawn_appliance(data, port, env, out)
    appliance = Appliance(
        f"https://{HOST}:{port}",
        port,
        key.stdout.strip(),
        folder / "ca.crt",
        folder / "server.crt",
        folder / "server.key",
        log,
        process,
    )
    try:
        wait_https(appliance)
    except BaseException:
        stop(appliance)
        raise
    return appliance


def stop(appliance: Appliance) -> None:
    appliance.process.terminate()
    try:
        appliance.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        appliance.process.kill()
        appliance.process.wait()


def issue(ca: pki.Issued, folder: Path, name: str) -> None:
    """A certificate for the appliance (loopback), signed by ``ca``, as server.crt/.key."""
    leaf = pki.issue_with_key(
        ca,
        common_name=name,
        names=[HOST],
        uri=f"spiffe://test/{name}",
        lifetime=datetime.timedelta(days=1),
    )
    pki.write_issued(folder, "server", leaf)


def wait_https(appliance: Appliance, timeout_s: float = 120.0) -> None:
    """Wait on the condition (/healthz over HTTPS answers), failing early if it died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if appliance.process.poll() is not None:
            raise AssertionError(f"the appliance exited: {appliance.log.read_text()[-3000:]}")
        try:
            with httpx.Client(verify=appliance.context(), timeout=2) as client:
                if client.get(f"{appliance.url}/healthz").status_code == 200:
                    return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the appliance did not answer over HTTPS")
