"""Docs are tests: the README and the example configs cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import yaml
from pydantic_settings import BaseSettings

from appliance.gateway.routes import ROUTES
from appliance.settings import EXAMPLE_HEADER as APPLIANCE_HEADER
from appliance.settings import ApplianceSettings
from hub.settings import EXAMPLE_HEADER as HUB_HEADER
from hub.settings import HubSettings
from shared.cli import main
from shared.config import example_yaml, iter_fields
from shared.errors import ErrorCode

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_lists_every_route() -> None:
    for route in ROUTES:
        assert f"`{route.method} {route.path}`" in README, route.path


def test_readme_lists_every_error_code_with_its_status() -> None:
    for code in ErrorCode:
        assert f"| {code.status} | `{code.value}` |" in README, code


@pytest.mark.parametrize(
    ("cls", "header", "path"),
    [
        (ApplianceSettings, APPLIANCE_HEADER, "appliance/config.example.yaml"),
        (HubSettings, HUB_HEADER, "hub/config.example.yaml"),
    ],
)
def test_example_config_is_complete_and_current(
    cls: type[BaseSettings], header: str, path: str
) -> None:
    text = (REPO / path).read_text()
    assert text == example_yaml(cls, header), f"regenerate {path} with `kvl … config --example`"
    data = yaml.safe_load(text)
    for key, field in iter_fields(cls):
        node = data
        for part in key.split("."):
            assert part in node, f"{key} missing from {path}"
            node = node[part]
        assert field.description, f"{key} has no description"
    cls.model_validate(data)  # the example itself is a valid configuration


def _leaf_commands(
    group: click.Group, ctx: click.Context, prefix: str
) -> list[tuple[str, click.Command]]:
    out: list[tuple[str, click.Command]] = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        path = f"{prefix} {name}"
        if isinstance(command, click.Group):
            out += _leaf_commands(command, ctx, path)
        else:
            out.append((path, command))
    return out


def test_every_command_takes_config_and_data_dir_and_is_documented() -> None:
    ctx = click.Context(main)
    commands = _leaf_commands(main, ctx, "kvl")
    assert len(commands) >= 9
    for path, command in commands:
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        # The demo runs on the embedded defaults by design: no config file. `kvl image …`
        # works on an image file, with neither settings nor a data directory.
        wanted = {"--data-dir"} if path == "kvl demo" else {"--config", "--data-dir"}
        if path.startswith("kvl image "):
            wanted = set()
        assert wanted <= options, path
        assert f"`{path}" in README, f"{path} is not in the README's command table"


def test_ci_runs_the_readmes_test_command() -> None:
    commands = re.findall(r"^(python3 -m venv .*just test)$", README, flags=re.MULTILINE)
    assert len(commands) == 1
    assert commands[0] in (REPO / ".ci" / "run").read_text()
    assert re.search(r"^python3 -m venv .*just demo$", README, flags=re.MULTILINE)
