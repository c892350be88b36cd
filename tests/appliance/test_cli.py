"""The real `kvl` command, as an operator runs it."""

from __future__ import annotations

import json
from pathlib import Path

from appliance.state.store import ModelRecord, Store
from tests.conftest import kvl


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


def test_models_add_and_list(tmp_path: Path, default_model: ModelRecord) -> None:
    data = str(tmp_path)
    added = kvl(
        "appliance",
        "models",
        "add",
        default_model.path,
        "--name",
        "mine",
        "--version",
        "7",
        "--data-dir",
        data,
    )
    assert "registered mine@7" in added.stdout
    listed = [
        json.loads(line)
        for line in kvl(
            "appliance", "models", "list", "--json", "--data-dir", data
        ).stdout.splitlines()
    ]
    refs = {m["ref"] for m in listed}
    assert refs == {"mine@7", f"gemma-3-270m@{default_model.version}"}
    assert all(m["sha256"] == default_model.sha256 for m in listed)
    dup = kvl(
        "appliance",
        "models",
        "add",
        default_model.path,
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
