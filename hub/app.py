"""The hub application: wiring only (store, certificates, WireGuard identity, routes)."""

from __future__ import annotations

import ipaddress
import ssl
from typing import TYPE_CHECKING

from aiohttp import web
from wireguard_tools import WireguardKey

from hub.api import IDENTITY, SETTINGS, STORE, errors, node_auth, routes
from hub.state.store import AsyncHubStore
from shared import pki

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from hub.settings import HubSettings


def create_app(settings: HubSettings) -> web.Application:
    app = web.Application(middlewares=[errors, node_auth], client_max_size=16 * 2**20)
    app[SETTINGS] = settings
    app.add_routes(routes())
    app[IDENTITY] = identity(settings)
    app.cleanup_ctx.append(_store)
    return app


async def _store(app: web.Application) -> AsyncIterator[None]:
    settings: HubSettings = app[SETTINGS]  # type: ignore[assignment]
    store = AsyncHubStore(settings.db_path)
    await store.open()
    app[STORE] = store
    yield
    await store.close()


def identity(settings: HubSettings) -> dict[str, str]:
    """The hub's WireGuard public key (its private key stays in the data dir, mode 0600),
    its overlay address (the prefix's first host) and its CA certificate."""
    ca, _ = certificates(settings)
    key = _wireguard_key(settings.data_dir / "wireguard" / "private.key")
    first = next(ipaddress.ip_network(settings.overlay.prefix).hosts())
    return {
        "wg_public_key": str(key.public_key()),
        "overlay_address": str(first),
        "ca_pem": ca.cert_pem.decode(),
    }


def certificates(settings: HubSettings) -> tuple[pki.Issued, pki.Issued]:
    """The hub's CA and its TLS server certificate (made on first start)."""
    return pki.load_or_create(settings.pki_dir, "kovenlab-hub", settings.server.names)


def ssl_context(settings: HubSettings) -> ssl.SSLContext:
    _, server = certificates(settings)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert, key = settings.pki_dir / "server.crt", settings.pki_dir / "server.key"
    if server.cert_pem != cert.read_bytes():  # pragma: no cover - written just above
        raise RuntimeError("the server certificate changed while loading")
    context.load_cert_chain(cert, key)
    return context


def _wireguard_key(path: Path) -> WireguardKey:
    if path.is_file():
        return WireguardKey(path.read_text().strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    key = WireguardKey.generate()
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(str(key) + "\n")
    return key
