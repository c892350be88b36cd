"""The hub's WireGuard interface, and the reconciler that keeps its peers equal to the
enrolled, unrevoked nodes."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from typing import TYPE_CHECKING

from hub.identity import hub_keys, overlay_address
from hub.loops import running
from shared.wireguard import InterfaceConfig, Peer, Tunnel, WireGuardError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from hub.loops import Running
    from hub.settings import HubSettings
    from hub.state.store import AsyncHubStore
    from shared.supervise import Failures

log = logging.getLogger(__name__)

PEERS_EVERY_S = 2.0


@contextlib.asynccontextmanager
async def tunnel_up(
    settings: HubSettings, store: AsyncHubStore, failures: Failures, tasks: Running
) -> AsyncIterator[None]:
    """The hub's interface, and a reconciler that keeps its peers equal to the enrolled,
    unrevoked nodes (enrollment adds one; `kvl hub nodes revoke`, in another process,
    removes one within PEERS_EVERY_S)."""
    keys = hub_keys(settings)
    assert settings.overlay.interface is not None  # noqa: S101 - the context is added only then
    tunnel = Tunnel(
        InterfaceConfig(
            settings.overlay.interface,
            keys.private_key,
            (overlay_address(settings),),
            listen_port=settings.overlay.listen_port,
        )
    )
    await asyncio.to_thread(tunnel.up)
    log.info("WireGuard %s up on UDP %d", tunnel.name, settings.overlay.listen_port)
    async with running(tasks, "peers", reconcile_peers(store, tunnel, failures)):
        yield
    await asyncio.to_thread(tunnel.down)


async def reconcile_peers(store: AsyncHubStore, tunnel: Tunnel, failures: Failures) -> None:
    """Every PEERS_EVERY_S, the tunnel's peers made the enrolled, unrevoked nodes."""

    async def once() -> None:
        try:
            await sync_peers(store, tunnel)
        except WireGuardError as err:
            # The interface refused (wireguard-go restarting, say): said without a
            # traceback, as it is not the hub's bug, but counted all the same.
            log.warning("peer reconciliation: %s", err)
            failures.record("peers", err)

    await failures.forever("peers", once, lambda: PEERS_EVERY_S, wait_first=False)


async def sync_peers(store: AsyncHubStore, tunnel: Tunnel) -> None:
    """One round: peers of revoked or deleted nodes removed, those of new nodes added."""
    wanted = await store.read(store.reader.nodes.wireguard_peers)
    state = await asyncio.to_thread(tunnel.state)
    present = {p.public_key for p in state.peers}
    for key in present - wanted.keys():
        await asyncio.to_thread(tunnel.remove_peer, key)
        log.info("removed the peer of a revoked node")
    for key in wanted.keys() - present:
        address, name = wanted[key]
        allowed = (ipaddress.ip_network(f"{address}/32"),)
        await asyncio.to_thread(tunnel.add_peer, Peer(key, allowed))
        log.info("added the peer of %s (%s)", name, address)
