"""TLS contexts of the fleet's mutual TLS, for both ends: strict X.509 verification
(Python's default from 3.13, set here on every Python), and a server context whose
certificate and trust can be replaced while the server runs."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from pathlib import Path


def client_context(
    trust_pem: bytes, certificate: tuple[Path, Path] | None = None
) -> ssl.SSLContext:
    """A client context that trusts ``trust_pem`` (a PEM bundle of CA certificates)
    only, checks the peer's name, and presents ``certificate`` (cert, key) when given."""
    context = ssl.create_default_context(cadata=trust_pem.decode())
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    if certificate is not None:
        context.load_cert_chain(*certificate)
    return context


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
