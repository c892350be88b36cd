"""The desired state of a node: what it should hold, from several aggregates (accounts,
keys, placed models, seeded packages, its image release), under the serial it is at."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from hub.state.nodes import capacity_of
from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hub.state import sql
    from hub.state.accounts import Accounts
    from hub.state.configuration import Configuration
    from hub.state.deployments import Deployments
    from hub.state.nodes import Node
    from hub.state.packages import Packages
    from hub.state.rollouts import Rollouts
    from hub.state.serials import Serials

log = logging.getLogger(__name__)


class DesiredStates:
    """What a node pulls (`GET /v1/node/state`), read across the aggregates it is drawn
    from (each given here)."""

    def __init__(
        self,
        database: sql.Database,
        serials: Serials,
        *,
        accounts: Accounts,
        deployments: Deployments,
        packages: Packages,
        rollouts: Rollouts,
        configuration: Configuration,
    ) -> None:
        self._configuration = configuration
        self._db = database
        self._serials = serials
        self._accounts = accounts
        self._deployments = deployments
        self._packages = packages
        self._rollouts = rollouts

    def of(self, node: Node) -> protocol.DesiredState:
        """What ``node`` should hold, with the serial it is at. Only the node's own.

        One transaction, and the serial read first: a change committed while this reads
        (on PostgreSQL each statement sees the latest commit) can then only give the node
        newer accounts and keys under an older serial, which it pulls again at its next
        heartbeat; never an older state under the newer serial, which it would keep."""
        with self._db.transaction():
            serial = self._serials.desired()
            names = self._accounts.served(node)
            accounts = [
                protocol.AccountState(
                    name=r["name"],
                    service_class=r["service_class"],
                    requests_per_minute=r["requests_per_minute"],
                    tokens_per_day=r["tokens_per_day"],
                    # Spent through leases (POST /v1/node/leases) when set.
                    budget_tokens=r["budget_tokens"],
                )
                for r in self._db.query("SELECT * FROM accounts ORDER BY name")
                if r["name"] in names
            ]
            keys = [
                protocol.KeyState(
                    prefix=r["prefix"],
                    hash=r["hash"],
                    account=r["account"],
                    admin=bool(r["admin"]),
                    revoked=r["revoked_at"] is not None,
                )
                for r in self._db.query("SELECT * FROM api_keys ORDER BY prefix")
                if r["account"] in names
            ]
            peers = self._peers(node)
            return protocol.DesiredState(
                node_id=node.id,
                serial=serial,
                accounts=accounts,
                keys=keys,
                # The models placed on this node: it fetches each artifact through the
                # tunnel (GET /v1/node/artifacts/SHA256), checks its sha256, loads it.
                models=[
                    protocol.PlacedModel(
                        name=p.model.name,
                        version=p.model.version,
                        sha256=p.model.sha256,
                        size_bytes=p.model.size_bytes,
                        format=p.model.format,
                        # Checked when the deployment was made; a stored preset this
                        # protocol no longer reads is left out rather than failing the node.
                        preset=_preset(p.preset),
                        # The other nodes of its site placed the same file (protocol 10):
                        # fetched from one of them, the site's link carries it once.
                        peers=peers.get(p.model.sha256, []),
                    )
                    for p in self._deployments.placed_models(node.id)
                ],
                # The content packages seeded to this node: fetched the same way, pinned.
                packages=self._packages.seeded_to(node),
                # The image release a rollout gave this node (protocol 6; left out for
                # older nodes), fetched the same way and installed within its window.
                release=self._rollouts.release_target(node),
                # What the hub sets of the node's settings (protocol 7), with the changes
                # the settings rollouts that reached it have given it so far.
                settings=self._configuration.desired(node),
                # The site's update window (protocol 9): model files wait for it too.
                window=self._rollouts.window_of(node.site),
            )

    def _peers(self, node: Node) -> dict[str, list[protocol.ModelPeer]]:
        """sha256 → the other nodes of the node's site placed that model file, each where
        it is reached; the one with the lower id fetches it from the hub first."""
        found: dict[str, list[protocol.ModelPeer]] = {}
        for sha256, peer_id, stored in self._deployments.site_peers(node.id, node.site):
            urls = _urls(capacity_of(stored).api)
            if urls:
                peer = protocol.ModelPeer(node_id=peer_id, urls=urls, first=peer_id < node.id)
                found.setdefault(sha256, []).append(peer)
        return {sha256: peers[:16] for sha256, peers in found.items()}


def _urls(api: protocol.LanApi | None) -> list[str]:
    """A node's LAN API at each address it reports for its site (none: an older node)."""
    if api is None:
        return []
    scheme = "https" if api.tls else "http"
    hosts = [f"[{a}]" if ":" in a else a for a in api.addresses]
    return [f"{scheme}://{host}:{api.port}" for host in hosts]


def _preset(stored: Mapping[str, Any] | None) -> protocol.ModelPreset | None:
    if stored is None:
        return None
    try:
        return protocol.ModelPreset.model_validate(stored)
    except ValidationError:
        log.warning("a deployment's stored preset is not one this hub reads: left out")
        return None
