"""TLS contexts of the fleet's mutual TLS, for both ends: strict X.509 verification
(Python's default from 3.13, set here on every Python), a client context that also
checks who the peer's certificate speaks for, and a server context whose certificate
and trust can be replaced while the server runs."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from pathlib import Path


class _IdentityCheckedObject(ssl.SSLObject):
    """An SSLObject whose handshake also checks the peer certificate's URI names (who it
    speaks for, as SPIFFE puts it) against its context's `identity`. Every certificate of
    the fleet chains to the same CA, so a chain and a host name that verify say only
    "one of the fleet": a node's certificate names its own addresses, and with a
    foothold on a LAN it could answer there for the hub. The check runs inside the
    handshake, as OpenSSL's own verification does, so a peer that fails it never sees
    a byte of the request (a node token, a client's key)."""

    def do_handshake(self) -> None:
        super().do_handshake()
        identity: Callable[[list[str]], bool] | None = getattr(self.context, "kvl_identity", None)
        if identity is None:
            return
        uris = peer_uris(self.getpeercert())
        if not identity(uris):
            raise ssl.SSLCertVerificationError(
                1,
                "the peer's certificate does not speak for who was called "
                f"(its URI names: {', '.join(uris) or 'none'})",
            )


def client_context(
    trust_pem: bytes,
    certificate: tuple[Path, Path] | None = None,
    *,
    identity: Callable[[list[str]], bool] | None = None,
) -> ssl.SSLContext:
    """A client context that trusts ``trust_pem`` (a PEM bundle of CA certificates)
    only, checks the peer's name, presents ``certificate`` (cert, key) when given, and,
    with ``identity``, refuses a peer whose certificate's URI names it does not accept
    (`hub_identity`, `node_identity`)."""
    context = ssl.create_default_context(cadata=trust_pem.decode())
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    if certificate is not None:
        context.load_cert_chain(*certificate)
    if identity is not None:
        # asyncio's TLS (and so aiohttp's) makes its SSLObject through wrap_bio, which
        # builds `sslobject_class`; the context is where the object finds what to check.
        context.sslobject_class = _IdentityCheckedObject
        context_attrs: Any = context
        context_attrs.kvl_identity = identity
    return context


def hub_identity(uri: str | None) -> Callable[[list[str]], bool]:
    """The hub, by its URI (`spiffe://DOMAIN/hub`); before the fleet's domain is known
    (enrollment, where the pinned CA is the fleet's), the hub of any domain: never a
    node, whose URI is `spiffe://DOMAIN/node/ID`."""

    def check(uris: list[str]) -> bool:
        if uri is not None:
            return uri in uris
        return any(
            u.startswith("spiffe://") and u.count("/") == 3 and u.endswith("/hub") for u in uris
        )

    return check


def node_identity(prefix: str) -> Callable[[list[str]], bool]:
    """A node of the fleet (`spiffe://DOMAIN/node/…`, ``prefix`` up to the id): never
    the hub's certificate where a node is called."""

    def check(uris: list[str]) -> bool:
        return any(u.startswith(prefix) and len(u) > len(prefix) for u in uris)

    return check


def server_context(
    certificate: tuple[Path, Path], trust_pem: bytes | None, *, require: bool = False
) -> ssl.SSLContext:
    """A server context for ``certificate``; with ``trust_pem``, a client certificate
    is asked for and verified against it (``require``: a handshake without one fails)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    if trust_pem is not None:
        context.verify_flags |= ssl.VERIFY_X509_STRICT
        context.verify_mode = ssl.CERT_REQUIRED if require else ssl.CERT_OPTIONAL
        context.load_verify_locations(cadata=trust_pem.decode())
    return context


class LiveContext:
    """A TLS server context that can be replaced while the server runs: the context the
    server holds (`outer`) switches each handshake to the newest one in its server-name
    callback, which OpenSSL calls for every handshake, with or without SNI. New
    connections get the new certificate and trust; open ones keep theirs."""

    def __init__(self, make: Callable[[], ssl.SSLContext]) -> None:
        self._make = make
        self.current = make()
        self.outer = make()
        self.outer.sni_callback = self._switch

    def _switch(self, connection: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> None:
        del name
        connection.context = self.current

    def replace(self) -> None:
        """Build the context again (a renewed certificate, a changed trust bundle)."""
        self.current = self._make()


def peer_uris(peercert: Mapping[str, object] | None) -> list[str]:
    """The URI names of a verified peer certificate (`getpeercert()`): who it speaks for."""
    if not peercert:
        return []
    names = peercert.get("subjectAltName", ())
    if not isinstance(names, (tuple, list)):
        return []
    return [str(value) for kind, value in names if kind == "URI"]
