"""The real `kvl` command, as an operator runs it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import psutil

from appliance.fleet.identity import FleetFiles, HubPeer, Identity
from appliance.serving.catalog import CHAT_MODEL_NAME, DEFAULT_MODEL_NAME, EMBEDDED
from appliance.state.store import Store
from tests.conftest import kvl, write_script


def test_keys_create_prints_the_key_alone_then_list_and_revoke(tmp_path: Path) -> None:
    data = str(tmp_path)
    created = kvl(
        "appliance", "keys", "create", "--account", "acme", "--class", "S2", "--data-dir", data
    )
    key = created.stdout
    assert key.endswith("\n")
    assert key.count("\n") == 1
    key = key.strip()
    assert key.startswith("kvl_")
    listed = [
        json.loads(line)
        for line in kvl(
            "appliance", "keys", "list", "--json", "--data-dir", data
        ).stdout.splitlines()
    ]
    assert len(listed) == 1
    assert listed[0]["account"] == "acme"
    assert listed[0]["class"] == "S2"
    assert listed[0]["revoked_at"] is None
    assert key not in kvl("appliance", "keys", "list", "--data-dir", data).stdout
    kvl(
        "appliance", "keys", "revoke", key, "--data-dir", data
    )  # the full key works as well as the prefix
    store = Store(tmp_path / "appliance.db")
    found = store.authenticate(key)
    store.close()
    assert found is not None
    assert found.revoked
    again = kvl("appliance", "keys", "revoke", listed[0]["prefix"], "--data-dir", data, check=False)
    assert again.returncode == 1
    assert "already revoked" in again.stderr


def test_invalid_configuration_exits_2_listing_every_problem(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("server:\n  port: 70000\nmodel:\n  n_ctxx: 5\n")
    result = kvl(
        "appliance",
        "serve",
        "--config",
        str(config),
        "--data-dir",
        str(tmp_path),
        env={"KVL_MODEL__MAX_QUEUE": "many"},
        check=False,
    )
    assert result.returncode == 2
    assert "3 problem(s)" in result.stderr
    for expected in [
        "server.port",
        "model.n_ctxx",
        "did you mean `model.n_ctx`",
        "model.max_queue",
        "KVL_MODEL__MAX_QUEUE",
    ]:
        assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_models_add_and_list(tmp_path: Path) -> None:
    # A model script registers as a GGUF file does (test_catalog registers a GGUF by path);
    # the list copies in the embedded models itself.
    script = write_script(tmp_path / "mine.json")
    data = str(tmp_path / "data")
    added = kvl(
        "appliance",
        "models",
        "add",
        str(script),
        "--name",
        "mine",
        "--version",
        "7",
        "--data-dir",
        data,
    )
    assert "registered mine@7 (a scripted model" in added.stdout
    listed = [
        json.loads(line)
        for line in kvl(
            "appliance", "models", "list", "--json", "--data-dir", data
        ).stdout.splitlines()
    ]
    by_ref = {m["ref"]: m for m in listed}
    gemma = EMBEDDED[DEFAULT_MODEL_NAME]
    chat = f"{CHAT_MODEL_NAME}@{EMBEDDED[CHAT_MODEL_NAME].version()}"
    assert set(by_ref) == {"mine@7", f"{DEFAULT_MODEL_NAME}@{gemma.version()}", chat}
    assert by_ref["mine@7"]["sha256"] == hashlib.sha256(script.read_bytes()).hexdigest()
    assert by_ref["mine@7"]["format"] == "script"
    assert by_ref[f"{DEFAULT_MODEL_NAME}@{gemma.version()}"]["sha256"] == gemma.sha256()
    dup = kvl(
        "appliance",
        "models",
        "add",
        str(script),
        "--name",
        "mine",
        "--version",
        "7",
        "--data-dir",
        data,
        check=False,
    )
    assert dup.returncode == 1
    assert "already registered" in dup.stderr
    missing = kvl(
        "appliance",
        "models",
        "add",
        str(tmp_path / "none.gguf"),
        "--name",
        "x",
        "--version",
        "1",
        "--data-dir",
        data,
        check=False,
    )
    assert missing.returncode == 2


def test_config_prints_effective_settings(tmp_path: Path) -> None:
    out = kvl(
        "appliance", "config", "--data-dir", str(tmp_path), env={"KVL_SERVER__PORT": "9999"}
    ).stdout
    assert "port: 9999" in out
    assert f"data_dir: {tmp_path}" in out
    hub = kvl(
        "hub", "config", "--data-dir", str(tmp_path), env={"KVL_HUB_SERVER__PORT": "9443"}
    ).stdout
    assert "port: 9443" in hub


def _loopback() -> str:
    """The name of the interface holding 127.0.0.1 (`lo` on Linux)."""
    return next(
        name
        for name, addresses in psutil.net_if_addrs().items()
        if any(a.address == "127.0.0.1" for a in addresses)
    )


def test_status_reports_the_tunnel_by_the_interface_holding_the_overlay_address(
    tmp_path: Path,
) -> None:
    """`kvl appliance status` without the serving process's settings (as the demo prints
    it, whose appliance ran with `fleet.interface` kvd0-wg): the tunnel is the interface
    that holds the node's overlay address, whatever `fleet.interface` the command reads."""
    data = str(tmp_path)
    status = ["appliance", "status", "--json", "--data-dir", data]
    absent = {"KVL_FLEET__INTERFACE": "kvl-absent9"}
    alone = json.loads(kvl(*status, env=absent).stdout)
    assert alone["enrolled"] is False
    assert alone["tunnel"] == "down (kvl-absent9 does not exist)"
    # Not enrolled: the configured interface is the one looked at.
    configured = json.loads(kvl(*status, env={"KVL_FLEET__INTERFACE": _loopback()}).stdout)
    assert configured["tunnel"] == f"up ({_loopback()})"
    hub = HubPeer(
        wg_public_key="A" * 43 + "=",
        overlay_address="10.99.0.1",
        endpoint="192.0.2.1:51820",
        api_url="https://10.99.0.1:8443",
        ca_pem="",
    )
    FleetFiles(tmp_path / "fleet").save(
        Identity(
            node_id="node-1",
            name="edge-1",
            site="lab",
            node_token="kvln_test",
            overlay_address="127.0.0.1",  # held by loopback, as a tunnel's would be by it
            overlay_prefix="127.0.0.0/8",
            hub=hub,
            hub_url="https://192.0.2.1:8443",
            hub_fingerprint="sha256:" + "ab" * 32,
        )
    )
    enrolled = json.loads(kvl(*status).stdout)
    assert enrolled["enrolled"] is True
    assert enrolled["overlay_address"] == "127.0.0.1"
    assert enrolled["tunnel"] == f"up ({_loopback()})"
    elsewhere = json.loads(kvl(*status, env=absent).stdout)
    assert elsewhere["tunnel"] == f"up ({_loopback()})"
    off = json.loads(kvl(*status, env={"KVL_FLEET__TUNNEL": "false"}).stdout)
    assert off["tunnel"] == "off (fleet.tunnel: false)"
