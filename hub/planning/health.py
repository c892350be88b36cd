"""A node's health from its last heartbeat: the one definition of online, stale and
offline that the registry (`node_status`: the API, the console, the CLI), the placement
planner and the offload planner all use.

A node is *seen within* a window while less than the window has passed since its last
heartbeat; at the window's end exactly it is not (never seen: never within). So with
`stale_after_s` 45, a node last seen 45 s ago is stale, not online: a planner never sends
work to a node the registry shows as stale. Pure: `now` is an argument.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol


class NodeStatus(StrEnum):
    online = "online"
    stale = "stale"
    offline = "offline"
    revoked = "revoked"


def seen_within(last_seen: float | None, now: float, window_s: float) -> bool:
    """Whether the node's last heartbeat is less than `window_s` old (never seen: no)."""
    return last_seen is not None and now - last_seen < window_s


def node_status(
    last_seen: float | None,
    now: float,
    *,
    revoked: bool,
    stale_after_s: float,
    offline_after_s: float,
) -> NodeStatus:
    """A node's state from its last heartbeat: a state, never an eviction."""
    if revoked:
        return NodeStatus.revoked
    if not seen_within(last_seen, now, offline_after_s):
        return NodeStatus.offline
    if not seen_within(last_seen, now, stale_after_s):
        return NodeStatus.stale
    return NodeStatus.online


class Seen(Protocol):
    """A node as the registry holds it (hub.state's `Node`)."""

    @property
    def last_seen(self) -> float | None: ...

    @property
    def revoked(self) -> bool: ...


class Windows(Protocol):
    """The fleet's health windows (hub.settings' `FleetSettings`)."""

    @property
    def stale_after_s(self) -> float: ...

    @property
    def offline_after_s(self) -> float: ...


def status_of(node: Seen, fleet: Windows, now: float) -> NodeStatus:
    """`node_status` of a registry node under the fleet's settings."""
    return node_status(
        node.last_seen,
        now,
        revoked=node.revoked,
        stale_after_s=fleet.stale_after_s,
        offline_after_s=fleet.offline_after_s,
    )
