"""What the tests of a hub share: its settings on loopback, on either store, and the
WireGuard keys and overlay prefix of the nodes they enroll by hand."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wireguard_tools import WireguardKey

from hub.settings import HubSettings

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from tests.hub.conftest import HubDatabase

PREFIX = "100.64.0.0/10"


def settings_for(
    tmp_path: Path,
    database: HubDatabase | None = None,
    *,
    overlay: Mapping[str, Any] | None = None,
    fleet: Mapping[str, Any] | None = None,
    pki: Mapping[str, Any] | None = None,
    quota: Mapping[str, Any] | None = None,
    console: Mapping[str, Any] | None = None,
    tracing: Mapping[str, Any] | None = None,
    objectives: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    alerts: Mapping[str, Any] | None = None,
    models: Mapping[str, Any] | None = None,
    backups: Mapping[str, Any] | None = None,
    **server: Any,
) -> HubSettings:
    """A hub in ``tmp_path / "hub"`` on ``database`` (None: SQLite there), serving on
    loopback without a WireGuard interface (the netns tests make them), every heartbeat's
    objectives counted at its flush (the tests wait on the counts; test_objectives.py tests
    counting once a period on its own). Each keyword section is laid over these defaults
    and the hub's own; the remaining keywords are settings of ``server``."""
    return HubSettings.model_validate(
        {
            "data_dir": tmp_path / "hub",
            **(database or {}),
            "server": {"require_overlay_source": False, **server},
            "overlay": {"interface": None, **(overlay or {})},
            "objectives": {"count_every_s": 0, **(objectives or {})},
            **{
                name: dict(section)
                for name, section in {
                    "fleet": fleet,
                    "pki": pki,
                    "quota": quota,
                    "console": console,
                    "tracing": tracing,
                    "metrics": metrics,
                    "alerts": alerts,
                    "models": models,
                    "backups": backups,
                }.items()
                if section
            },
        }
    )


def new_key() -> str:
    return str(WireguardKey.generate().public_key())
