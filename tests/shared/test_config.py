from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from appliance.settings import ApplianceSettings
from shared.config import ConfigError, env_name, load_settings

if TYPE_CHECKING:
    from pathlib import Path


def test_defaults_load_without_a_file() -> None:
    settings = load_settings(ApplianceSettings, config_file=None, environ={})
    assert settings.server.port == 8080
    assert settings.model.default == "gemma-3-270m"


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    config = tmp_path / "kvl.yaml"
    config.write_text("server:\n  port: 9000\n  host: 10.0.0.1\nmodel:\n  n_ctx: 1024\n")
    settings = load_settings(
        ApplianceSettings,
        config_file=config,
        environ={"KVL_SERVER__PORT": "9100", "KVL_MODEL__MAX_QUEUE": "3"},
        overrides={"server": {"port": 9200}},
    )
    assert settings.server.port == 9200  # flag beats env and file
    assert settings.server.host == "10.0.0.1"  # file value kept where nothing overrides it
    assert settings.model.n_ctx == 1024
    assert settings.model.max_queue == 3  # env beats default


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    config = tmp_path / "kvl.yaml"
    config.write_text("server:\n  port: 0\n  prot: 1\nmodel:\n  n_ctx: lots\nbogus: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(ApplianceSettings, config_file=config, environ={"KVL_MODEL__MAX_QUEUE": "-1"})
    problems = {p.key: p for p in caught.value.problems}
    assert set(problems) == {
        "server.port",
        "server.prot",
        "model.n_ctx",
        "bogus",
        "model.max_queue",
    }
    assert "did you mean `server.port`" in problems["server.prot"].fix
    assert problems["bogus"].fix == "remove it"
    assert ">= 1" in problems["server.port"].fix
    assert "<= 65535" in problems["server.port"].fix
    assert problems["model.max_queue"].source == "environment KVL_MODEL__MAX_QUEUE"
    assert problems["server.port"].source == f"config file {config}"
    text = caught.value.render()
    assert "5 problem(s)" in text


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    config = tmp_path / "kvl.yaml"
    config.write_text("server:\n  port: [1,\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(ApplianceSettings, config_file=config, environ={})
    assert "line" in caught.value.problems[0].what


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="1 configuration problem"):
        load_settings(ApplianceSettings, config_file=tmp_path / "missing.yaml", environ={})
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(ApplianceSettings, config_file=listing, environ={})
    assert "mapping" in caught.value.problems[0].what


def test_tls_needs_both_files() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(
            ApplianceSettings,
            config_file=None,
            environ={"KVL_SERVER__TLS_CERT_FILE": "/x/cert.pem"},
        )
    assert caught.value.problems[0].key == "server"


def test_env_name() -> None:
    assert env_name("model.n_ctx") == "KVL_MODEL__N_CTX"
