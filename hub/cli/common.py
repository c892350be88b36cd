"""What every `kvl hub …` command shares: its settings, the one way it opens and closes
the hub's store, and durations as people write them."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any

import click

from hub.settings import HubSettings
from shared.cli import settings_from

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from hub.state.store import HubStore

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_duration(text: str) -> float:
    """`90s`, `30m`, `24h`, `7d`, `2w` (or a bare number of seconds) in seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is not a duration like 30m, 24h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def hub_settings(config_file: Path | None, data_dir: Path | None, **server: Any) -> HubSettings:
    return settings_from(HubSettings, config_file, data_dir, **server)


@contextlib.contextmanager
def opened_store(settings: HubSettings) -> Iterator[HubStore]:
    """The hub's store for one command, closed when the block ends. A database that cannot
    be reached, and what the store finds missing or already there, are the command's
    error message (and exit status 1), never a traceback."""
    # Imported here, not above: `kvl hub config` and `--help` stay light.
    from hub.state.errors import ConflictError, InvalidError, NotFoundError  # noqa: PLC0415
    from hub.state.sql import DatabaseError  # noqa: PLC0415
    from hub.state.store import open_store  # noqa: PLC0415

    try:
        store = open_store(settings)
    except DatabaseError as err:  # PostgreSQL unreachable, or refusing us
        raise click.ClickException(f"{err} (database_url in the settings)") from err
    try:
        yield store
    except (NotFoundError, ConflictError, InvalidError) as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
