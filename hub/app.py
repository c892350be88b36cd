"""The hub application: wiring only (store, certificates, WireGuard, routes)."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import ssl
import time
from typing import TYPE_CHECKING

from aiohttp import web

from hub.admin import admin_routes, operator_auth
from hub.api import (
    BEATS,
    FORWARDER,
    IDENTITY,
    LEARNING,
    SETTINGS,
    STORE,
    Heartbeats,
    Learning,
    errors,
    node_auth,
    routes,
)
from hub.console.app import setup_console
from hub.loops import LOOPS, RUNNING, Running, running
from hub.offload import Forwarder
from hub.openapi import openapi_route
from hub.reconciler import reconcile_forever
from hub.state.store import AsyncHubStore
from shared import pki
from shared.supervise import Failures
from shared.wireguard import (
    InterfaceConfig,
    KeyPair,
    Peer,
    Tunnel,
    WireGuardError,
    ensure_keypair,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from hub.settings import HubSettings
    from hub.state.store import Heartbeat

log = logging.getLogger(__name__)

PEERS_EVERY_S = 2.0
HEARTBEATS_EVERY_S = 1.0


def create_app(settings: HubSettings) -> web.Application:
    app = web.Application(
        middlewares=[errors, node_auth, operator_auth], client_max_size=16 * 2**20
    )
    app[SETTINGS] = settings
    # Every background loop of this hub counts its failed rounds here (hub/loops.py).
    app[LOOPS] = Failures()
    app[RUNNING] = Running()
    app.add_routes(routes())
    app.add_routes(admin_routes())
    app.add_routes([openapi_route()])
    app[IDENTITY] = identity(settings)
    app[LEARNING] = Learning(time.time(), settings.quota.lease_s)
    app.cleanup_ctx.append(_store)
    app.cleanup_ctx.append(_heartbeats)
    app.cleanup_ctx.append(_forwarder)
    app.cleanup_ctx.append(_placement)
    if settings.overlay.interface is not None:
        app.cleanup_ctx.append(_tunnel)
    setup_console(app)  # the web console (/console/), after the store it reads
    return app


async def freeze_heap(_: web.Application) -> None:
    """Once the hub has started: what the process holds by then (modules, settings, the
    application) is moved out of the garbage collector's reach, so that its full
    collections scan only what the fleet's calls add. Over the whole startup heap, each
    held the event loop for 50 to 90 ms under a fleet of 10,000 nodes."""
    gc.collect()
    gc.freeze()


async def _store(app: web.Application) -> AsyncIterator[None]:
    settings: HubSettings = app[SETTINGS]  # type: ignore[assignment]
    store = AsyncHubStore(settings)  # SQLite, or PostgreSQL at settings.database_url
    await store.open()
    app[STORE] = store
    yield
    await store.close()


async def _heartbeats(app: web.Application) -> AsyncIterator[None]:
    """The write-behind of heartbeats (see hub.api.Heartbeats); a last flush on the way out."""
    store = app[STORE]
    failures = app[LOOPS]
    beats = Heartbeats()
    app[BEATS] = beats

    async def serials() -> None:
        read = await store.run(store.sync.serials)
        beats.desired_serial = read[0]
        store.note_serials(read)

    async def flush() -> None:
        # A round that fails (the write, the serials) loses only that second's
        # heartbeats, which the nodes' next ones replace; the loop goes on.
        waiting = beats.take()
        if waiting:
            await store.run(store.sync.heartbeats, waiting)
            for listener in beats.listeners:
                # Each listener on its own: one that raises takes neither the flush
                # nor the listeners after it down with it.
                with failures.guard(listener_loop(listener)):
                    await listener(waiting)
        await serials()

    await serials()
    # The module constant is read each round, so that tests can shorten it.
    every = failures.forever("heartbeats", flush, lambda: HEARTBEATS_EVERY_S)
    async with running(app, "heartbeats", every):
        yield
    with failures.guard("heartbeats"):  # the last flush, on the way out
        await flush()


def listener_loop(listener: Callable[[list[Heartbeat]], Awaitable[None]]) -> str:
    """The name a heartbeat listener's failures are counted under."""
    return f"heartbeats.{getattr(listener, '__name__', 'listener')}"


async def _forwarder(app: web.Application) -> AsyncIterator[None]:
    """The client session burst offload forwards requests with."""
    forwarder = Forwarder(app[IDENTITY]["ca_pem"])
    app[FORWARDER] = forwarder
    yield
    await forwarder.close()


async def _placement(app: web.Application) -> AsyncIterator[None]:
    """The placement reconciler (hub/reconciler.py)."""
    settings: HubSettings = app[SETTINGS]  # type: ignore[assignment]
    async with running(app, "placement", reconcile_forever(app[STORE], settings, app[LOOPS])):
        yield


def overlay_address(settings: HubSettings) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    """The hub's address on the overlay: the prefix's first host, with the prefix length."""
    network = ipaddress.ip_network(settings.overlay.prefix)
    return ipaddress.ip_interface(f"{next(network.hosts())}/{network.prefixlen}")


def hub_keys(settings: HubSettings) -> KeyPair:
    """The hub's WireGuard key pair (the private key stays in the data dir, mode 0600)."""
    folder = settings.data_dir / "wireguard"
    folder.mkdir(parents=True, exist_ok=True)
    return ensure_keypair(folder / "private.key")


def identity(settings: HubSettings) -> dict[str, str]:
    """The hub's WireGuard public key, its overlay address and its CA certificate."""
    ca, _ = certificates(settings)
    keys = hub_keys(settings)
    return {
        "wg_public_key": keys.public_key,
        "overlay_address": str(overlay_address(settings).ip),
        "ca_pem": ca.cert_pem.decode(),
    }


def certificates(settings: HubSettings) -> tuple[pki.Issued, pki.Issued]:
    """The hub's CA and its TLS server certificate, for its names and its overlay address
    (made on first start, again when the names change)."""
    names = [*settings.server.names, str(overlay_address(settings).ip)]
    return pki.load_or_create(settings.pki_dir, "kovenlab-hub", sorted(set(names)))


def ssl_context(settings: HubSettings) -> ssl.SSLContext:
    certificates(settings)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.pki_dir / "server.crt", settings.pki_dir / "server.key")
    return context


async def _tunnel(app: web.Application) -> AsyncIterator[None]:
    """The hub's interface, and a reconciler that keeps its peers equal to the enrolled,
    unrevoked nodes (enrollment adds one; `kvl hub nodes revoke`, in another process,
    removes one within PEERS_EVERY_S)."""
    settings: HubSettings = app[SETTINGS]  # type: ignore[assignment]
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
    async with running(app, "peers", reconcile_peers(app[STORE], tunnel, app[LOOPS])):
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
    nodes = await store.nodes()
    wanted = {n.wg_public_key: n for n in nodes if not n.revoked}
    state = await asyncio.to_thread(tunnel.state)
    present = {p.public_key for p in state.peers}
    for key in present - wanted.keys():
        await asyncio.to_thread(tunnel.remove_peer, key)
        log.info("removed the peer of a revoked node")
    for key in wanted.keys() - present:
        node = wanted[key]
        allowed = (ipaddress.ip_network(f"{node.overlay_address}/32"),)
        await asyncio.to_thread(tunnel.add_peer, Peer(key, allowed))
        log.info("added the peer of %s (%s)", node.name, node.overlay_address)
