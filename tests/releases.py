"""Releases of the appliance as a hub serves them to its nodes."""

from __future__ import annotations

from hub.settings import HubSettings
from hub.state.store import open_store


def speak_releases(settings: HubSettings) -> bool:
    """Whether every node's last heartbeat, as stored, spoke protocol 6 (releases reach
    only such nodes)."""
    store = open_store(settings)
    try:
        return all(n.versions.get("protocol") == "6" for n in store.nodes.all())
    finally:
        store.close()
