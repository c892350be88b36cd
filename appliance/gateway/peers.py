"""A model file this node holds, for another node of its site (shared/peer_tickets.py): on
the LAN API, to whoever shows the hub's ticket for that file and this node's site, so that
the site's WAN link carries each model file once. No API key: the ticket is the grant, and
it grants that one file; the fetching node checks the bytes against the digest.

- `GET /v1/peer/artifacts/{sha256}` with `X-Kvl-Peer-Ticket`: the file (Range,
  If-Range on the digest, as the hub's artifacts); 409 `artifact_fetching` while this node
  fetches it itself (ask again later), 404 when it holds no such file (or the name is not
  a sha256), 403
  `peer_ticket_refused` for a ticket that is missing, not the hub's, for another file or
  site, or expired.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from appliance.gateway.appkeys import METRICS, STORE
from shared import peer_tickets
from shared.blobs import IMMUTABLE, send_blob
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PeerFiles:
    """What serving a peer needs of the fleet link: this node's site (None: in no fleet),
    the CA bundle it trusts, and whether it is fetching a file now."""

    site: Callable[[], str | None]
    trust: Callable[[], bytes | None]
    fetching: Callable[[str], bool]


PEERS = web.AppKey("peers", PeerFiles)


def _trusted(bundle: bytes) -> list[bytes]:
    from shared import pki  # noqa: PLC0415 - cryptography: only when a peer asks

    return pki.split_bundle(bundle)


async def peer_artifact(request: web.Request) -> web.StreamResponse:
    sha256 = request.match_info["sha256"]
    if not _SHA256.match(sha256):  # no file is named so: none held (as the hub answers)
        raise ApiError(ErrorCode.not_found, f"no file {sha256[:80]!r}: a file is its sha256")
    peers = request.app.get(PEERS)
    site = peers.site() if peers is not None else None
    bundle = peers.trust() if peers is not None else None
    if peers is None or site is None or bundle is None:
        raise ApiError(ErrorCode.peer_ticket_refused, "this node is in no fleet: it has no peers")
    ticket = request.headers.get(peer_tickets.PEER_TICKET_HEADER)
    if not ticket:
        raise ApiError(
            ErrorCode.peer_ticket_refused,
            f"a peer asks with the hub's ticket for the file (`{peer_tickets.PEER_TICKET_HEADER}`)",
        )
    try:
        claims = await asyncio.to_thread(
            lambda: peer_tickets.verify(
                ticket, _trusted(bundle), sha256=sha256, site=site, now=time.time()
            )
        )
    except peer_tickets.TicketError as err:
        raise ApiError(ErrorCode.peer_ticket_refused, str(err)) from err
    store = request.app[STORE]
    record = await store.run(store.sync.model_by_sha256, sha256)
    if record is None:
        if peers.fetching(sha256):
            raise ApiError(
                ErrorCode.artifact_fetching,
                "this node is fetching the file itself: ask again once it has it",
                retry_after=10,
            )
        raise ApiError(ErrorCode.not_found, f"this node holds no file {sha256}")
    try:
        blob = await asyncio.to_thread(open, record.path, "rb")
    except OSError as err:
        raise ApiError(ErrorCode.not_found, f"this node holds no file {sha256}") from err
    metrics = request.app[METRICS]
    with blob:
        response = await send_blob(
            request,
            blob,
            sha256=sha256,
            media_type="application/octet-stream",
            cache_control=IMMUTABLE,
        )
    if response.content_length:
        metrics.peer_bytes_served.inc(response.content_length)
    log.info("sent %s to node %s of this site", sha256[:12], claims.node)
    return response
