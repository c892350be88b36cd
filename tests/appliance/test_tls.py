"""HTTPS on the LAN with an operator-supplied certificate: a real process, a verifying client."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.appliance.tls import make_certificate
from tests.conftest import free_port, kvl, spawn_appliance


def test_serves_https_with_the_operators_certificate(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    port = free_port()
    env = {
        "KVL_SERVER__TLS_CERT_FILE": str(cert),
        "KVL_SERVER__TLS_KEY_FILE": str(key),
        "KVL_DISCOVERY__ENABLED": "false",
        # No such model: nothing is assembled, and readiness must say why it is not ready.
        "KVL_MODEL__DEFAULT": "absent-model",
    }
    process = spawn_appliance(tmp_path / "d", port, env)
    verifying = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 60
        body = None
        while body is None and time.monotonic() < deadline:
            assert process.poll() is None, "the appliance exited"
            try:
                with urllib.request.urlopen(
                    f"https://127.0.0.1:{port}/healthz", context=verifying, timeout=2
                ) as r:
                    body = json.loads(r.read())
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        assert body is not None
        assert body["status"] == "alive"
        error: dict[str, str] = {}
        while "failed to load" not in error.get("message", "") and time.monotonic() < deadline:
            with pytest.raises(urllib.error.HTTPError) as not_ready:
                urllib.request.urlopen(
                    f"https://127.0.0.1:{port}/readyz", context=verifying, timeout=5
                )
            assert not_ready.value.code == 503
            error = json.loads(not_ready.value.read())["error"]
            assert error["code"] == "model_not_ready"
        assert "absent-model" in error["message"]
        # A client that does not trust the certificate is refused by TLS itself.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(
                f"https://127.0.0.1:{port}/healthz", context=ssl.create_default_context(), timeout=5
            )
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_tls_settings_must_come_in_pairs(tmp_path: Path) -> None:
    result = kvl(
        "appliance",
        "config",
        "--data-dir",
        str(tmp_path),
        env={"KVL_SERVER__TLS_KEY_FILE": "/k.pem"},
        check=False,
    )
    assert result.returncode == 2
    assert "tls_cert_file and tls_key_file" in result.stderr
