"""Releases of the appliance as a hub serves them to its nodes."""

from __future__ import annotations

from hub.rollouts import RELEASE_PROTOCOL
from hub.settings import HubSettings
from hub.state.store import open_store


def speak_releases(settings: HubSettings) -> bool:
    """Whether every node's last heartbeat, as stored, spoke protocol 6 or later (releases
    reach only such nodes)."""
    store = open_store(settings)
    try:
        spoken = [n.versions.get("protocol", "") for n in store.nodes.all()]
        return all(p.isdigit() and int(p) >= RELEASE_PROTOCOL for p in spoken)
    finally:
        store.close()
