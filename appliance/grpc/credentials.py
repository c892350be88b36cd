"""TLS of the gRPC API: the LAN API's certificate (the operator's files, or the one the
fleet's hub issued), read again whenever the files change, so a renewed certificate is
served from the next connection on without a restart (as shared/tls.py `LiveContext`
does for the LAN API). Optionally, client certificates (mutual TLS).

grpc asks the fetcher for a new configuration at each new connection's handshake; it
answers None ("unchanged") unless the files moved, so a handshake costs a few `stat`s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import grpc

from shared import pki

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

log = logging.getLogger(__name__)

Stamp = tuple[tuple[int, int, int], ...]


class CertificateFiles:
    """Server credentials from PEM files (certificate chain, key, and the CA bundle of
    client certificates when they are asked for) that follow the files."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None) -> None:
        self._paths = (cert, key) if client_ca is None else (cert, key, client_ca)
        self._cert, self._key, self._client_ca = cert, key, client_ca
        self._served: Stamp | None = None  # the files' stamp when last loaded
        self._refused: Stamp | None = None  # a stamp whose files could not be served

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that follow the files; OSError or ValueError when they cannot be
        served now (the appliance does not start on a certificate it cannot serve)."""
        initial = self._load(self._stamp())
        fetcher = cast("Callable[[], grpc.ServerCertificateConfiguration]", self._fetch)
        return grpc.dynamic_ssl_server_credentials(
            initial, fetcher, require_client_authentication=self._client_ca is not None
        )

    def _stamp(self) -> Stamp:
        # A renewal writes a new file and renames it over the old one: a new inode.
        stats = [path.stat() for path in self._paths]
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed (and hold a usable pair), else None:
        the current one stays, so a renewal caught halfway (the new key beside the old
        certificate) is served at the next handshake after it completes."""
        try:
            stamp = self._stamp()
            if stamp in {self._served, self._refused}:
                return None
            config = self._load(stamp)
        except (OSError, ValueError) as err:
            log.warning("gRPC TLS: keeping the current certificate: %s", err)
            return None
        log.info("gRPC TLS: serving the renewed certificate %s", self._cert)
        return config

    def _load(self, stamp: Stamp) -> grpc.ServerCertificateConfiguration:
        cert, key = self._cert.read_bytes(), self._key.read_bytes()
        try:
            matches = pki.key_matches(pki.Issued(cert, key))
        except ValueError as err:
            self._refused = stamp
            raise ValueError(f"{self._cert} is not a PEM certificate: {err}") from err
        if not matches:
            self._refused = stamp
            raise ValueError(f"{self._key} is not the key of {self._cert}")
        roots = self._client_ca.read_bytes() if self._client_ca is not None else None
        config = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=roots)
        self._served = stamp
        return config
