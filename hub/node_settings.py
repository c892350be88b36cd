"""Rollouts of a node setting (`kvl hub rollouts start --setting KEY=VALUE`): the nodes one
reaches, and what each should report once it applied the change, or went back from it
(hub/rollouts.py runs them as it runs the others; hub/state/configuration.py holds the
values and the changes in flight)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from hub.planning.rollout import Seen
from hub.state.configuration import (
    FLEET,
    Setting,
    check,
    digest_for,
    key_protocol,
    node_protocol,
    settings_of,
)
from hub.state.errors import InvalidError, NotFoundError
from hub.state.rollouts import RolloutConflictError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hub.state.nodes import Node
    from hub.state.rollouts import Rollout, RolloutMember
    from hub.state.store import HubStore


def settings_reach(
    store: HubStore, nodes: list[Node], target: Mapping[str, str]
) -> tuple[list[Node], dict[str, str | None], dict[str, str]]:
    """The nodes a settings rollout reaches (those of its scope that take settings), what
    each had of its key before, and the target to store. RolloutConflictError where it
    would change nothing."""
    scope, key, value = target["scope"], target["key"], target["value"]
    try:
        check(key, value)
    except InvalidError as err:
        raise NotFoundError(str(err), param=err.param) from err
    kind, _, name = scope.partition(":")
    if kind == "node":
        node = store.nodes.get(name)  # NotFoundError for no such node
        scope = f"node:{node.id}"
    of_scope = [n for n in nodes if scope in {FLEET, f"site:{n.site}", f"node:{n.id}"}]
    reach = [n for n in of_scope if node_protocol(n) >= key_protocol(key)]
    previous: dict[str, str | None] = {}
    for n in reach:
        values, _ = store.configuration.effective(n)
        previous[n.id] = values.get(key)
    if reach and all(
        store.configuration.effective(n, [Setting(scope, key, value)])[0].get(key) == previous[n.id]
        for n in reach
    ):
        raise RolloutConflictError(f"{key}={value} at {scope} changes no node's settings")
    return reach, previous, {"scope": scope, "key": key, "value": value}


def observe_settings(node: Node | None, expected: str | None) -> Seen:
    """What a node's last heartbeat says of the settings it should apply (`expected`: their
    digest): healthy once it reports it applied them."""
    if node is None or node.revoked or expected is None:
        return Seen("gone")
    if node.capacity.settings_digest == expected:
        return Seen("healthy", last_seen=node.last_seen)
    return Seen("pending", last_seen=node.last_seen)


def settings_digest(
    store: HubStore,
    rollout: Rollout,
    nodes: Mapping[str, Node],
    member: RolloutMember,
    *,
    back: bool,
) -> str | None:
    """The digest of what a member of a settings rollout should apply: with the rollout's
    change, or (`back`) without it."""
    node = nodes.get(member.member.node_id)
    if node is None:
        return None
    t = rollout.target
    change = [] if back else [Setting(t["scope"], t["key"], t["value"])]
    values, _ = store.configuration.effective(node, change)
    try:
        return digest_for(settings_of(values), node)
    except ValidationError:
        return None
