"""Peer tickets: the hub's word that a node may fetch one artifact (by its sha256) from the
other nodes of its site, so that a site's WAN link carries each model file once.

The hub signs a ticket with the key of the CA that signs now (every node trusts its CA
bundle); a node that holds the file serves it on its LAN API to whoever shows a ticket for
that file, for its own site, not expired. A ticket is the node's to use alone (it comes in
its desired state, through its tunnel), names the node it was given to (for the serving
node's log), and carries nothing secret: the file's digest, which the fetching node checks
whatever a peer sends.

The form is `base64url(claims JSON) "." base64url(ECDSA P-256 SHA-256 signature)`, the
signature over a fixed prefix and the claims' bytes, so no other signed thing of the
fleet's (a certificate) can pass for a ticket.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

MAX_TICKET = 1024  # characters; a ticket is about 300
PEER_TICKET_HEADER = "X-Kvl-Peer-Ticket"
PEER_ARTIFACTS = "/v1/peer/artifacts"  # on a node's LAN API: /v1/peer/artifacts/SHA256
TTL_S = 7 * 86_400
_DOMAIN = b"kovenlab-peer-ticket-v1\n"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TEXT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class TicketError(ValueError):
    """A ticket that is not one of the hub's, or not for this file, site or time."""


@dataclass(frozen=True)
class Claims:
    sha256: str
    site: str
    node: str  # the node it was given to
    expires: int  # unix seconds

    def text(self) -> bytes:
        return json.dumps(
            {"sha256": self.sha256, "site": self.site, "node": self.node, "exp": self.expires},
            separators=(",", ":"),
            sort_keys=True,
        ).encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue(key_pem: bytes, claims: Claims) -> str:
    """A ticket for `claims`, signed with the CA key `key_pem` (PEM, PKCS#8)."""
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415

    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError("the hub's CA key is not an EC key")
    body = claims.text()
    signature = key.sign(_DOMAIN + body, ec.ECDSA(hashes.SHA256()))
    return f"{_b64(body)}.{_b64(signature)}"


def verify(ticket: str, trusted: Iterable[bytes], *, sha256: str, site: str, now: float) -> Claims:
    """The claims of `ticket` if a CA in `trusted` (PEM certificates) signed it for the file
    `sha256` and the site `site`, and it has not expired; TicketError otherwise."""
    if len(ticket) > MAX_TICKET or ticket.count(".") != 1:
        raise TicketError("not a peer ticket")
    encoded_body, encoded_signature = ticket.split(".")
    try:
        body, signature = _unb64(encoded_body), _unb64(encoded_signature)
        raw = json.loads(body)
    except (binascii.Error, ValueError) as err:
        raise TicketError("not a peer ticket") from err
    claims = _claims(raw)
    if not _signed(body, signature, trusted):
        raise TicketError("the ticket is not signed by this fleet's hub")
    if claims.sha256 != sha256:
        raise TicketError("the ticket is for another file")
    if claims.site != site:
        raise TicketError("the ticket is for another site")
    if claims.expires < now:
        raise TicketError("the ticket has expired")
    return claims


def _claims(raw: object) -> Claims:
    if not isinstance(raw, dict) or set(raw) != {"sha256", "site", "node", "exp"}:
        raise TicketError("not a peer ticket")
    sha256, site, node, expires = raw["sha256"], raw["site"], raw["node"], raw["exp"]
    if not (
        isinstance(sha256, str)
        and _SHA256.match(sha256)
        and isinstance(site, str)
        and _TEXT.match(site)
        and isinstance(node, str)
        and _TEXT.match(node)
        and type(expires) is int
    ):
        raise TicketError("not a peer ticket")
    return Claims(sha256, site, node, expires)


def _signed(body: bytes, signature: bytes, trusted: Iterable[bytes]) -> bool:
    from cryptography import x509  # noqa: PLC0415
    from cryptography.exceptions import InvalidSignature  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415

    for pem in trusted:
        key = x509.load_pem_x509_certificate(pem).public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            continue
        try:
            key.verify(signature, _DOMAIN + body, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            continue
        return True
    return False
