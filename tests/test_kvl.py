"""The `kvl` command's groups load their commands lazily (shared/cli.py `LazyGroup`): what
`--help` lists without importing a command is the command's own short help, and a command
imports neither its siblings nor the HTTP stack it does not use. Each `kvl` a site runs, a
cron job or a test, pays for its own imports only: `kvl hub rollouts list` took 0.7 s of CPU
with every hub command and aiohttp imported, 0.5 s without."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
import pytest

from shared.cli import LazyGroup, main

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[1]


def _lazy_groups(group: LazyGroup, path: str) -> Iterator[tuple[str, LazyGroup]]:
    yield path, group
    for name, (module, attr, _) in group.lazy.items():
        command = getattr(importlib.import_module(module), attr)
        if isinstance(command, LazyGroup):
            yield from _lazy_groups(command, f"{path} {name}")


def test_each_lazy_command_is_listed_with_its_own_name_and_help() -> None:
    groups = dict(_lazy_groups(main, "kvl"))
    assert {"kvl", "kvl hub"} <= set(groups)
    for path, group in groups.items():
        for name, (module, attr, summary) in group.lazy.items():
            command = getattr(importlib.import_module(module), attr)
            assert isinstance(command, click.Command), f"{path} {name}"
            assert command.name == name, f"{path} {name}: the module names it {command.name}"
            assert summary == command.get_short_help_str(limit=84), f"{path} {name}"


def _hub() -> LazyGroup:
    hub = main.get_command(click.Context(main, info_name="kvl"), "hub")
    assert isinstance(hub, LazyGroup)
    return hub


def test_help_lists_every_command() -> None:
    hub = _hub()
    listed = hub.get_help(click.Context(hub, info_name="hub"))
    for name in hub.lazy:
        assert f"\n  {name} " in listed, name


# Runs the command in a fresh interpreter (this one has imported everything) and prints
# what it imported.
_RUN = """
import json, sys
from shared.cli import main
try:
    main({argv!r})
except SystemExit as done:
    assert not done.code, done.code
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ("hub", "releases", "list"),
        ("hub", "rollouts", "list"),
        ("hub", "tokens", "list"),
        ("appliance", "keys", "list"),
    ],
)
def test_a_command_on_the_data_directory_imports_only_its_own(
    argv: tuple[str, ...], tmp_path: Path
) -> None:
    code = _RUN.format(argv=[*argv, "--data-dir", str(tmp_path)])
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    loaded = set(json.loads(out.strip().splitlines()[-1]))
    own = _hub().lazy[argv[1]][0] if argv[0] == "hub" else None
    siblings = {m for m in loaded if m.startswith("hub.cli.") and m not in {own, "hub.cli.common"}}
    assert not siblings, f"{' '.join(argv)} imported other commands: {sorted(siblings)}"
    assert "aiohttp" not in loaded, f"{' '.join(argv)} imported aiohttp"
    assert "hub.api" not in loaded
