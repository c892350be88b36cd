"""Enrollment and the node's certificate: `GET /v1/trust`, `POST /v1/enroll`,
`POST /v1/node/certificate`.

Enrollment is the one call a node makes with an enrollment token, over HTTPS to the hub
(the node trusts the CA bundle of `GET /v1/trust` when it holds the CA its provisioning
file pins). With it the node sends a signing request, and gets its certificate: the
names in it are the hub's decision (hub/certificates.py). Every later call carries the
node token and the node's certificate (mutual TLS), and, with
`server.require_overlay_source`, must come from the node's overlay address, that is
through its WireGuard tunnel (hub/api/node.py's middleware).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hub.api.node import with_protocol
from hub.api.route_kinds import Auth, Route
from hub.appkeys import IDENTITY, NODE, NODE_PROTOCOL, SETTINGS, STORE, TLS
from hub.certificates import NameRefusedError, certify
from hub.http import answer, parse, protocol_version
from hub.state.certificates import IssuedCertificate, NameTakenError
from hub.state.nodes import AlreadyEnrolledError, Node
from hub.state.tokens import TokenRefusedError
from shared import pki, protocol
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from aiohttp import web


async def enroll(request: web.Request) -> web.Response:
    version = protocol_version(request)
    req = await parse(request, protocol.EnrollRequest)
    settings = request.app[SETTINGS]
    store = request.app[STORE]
    hub_tls = request.app[TLS]
    # The request is read and checked here; it is signed only once the token and the
    # node are, inside the enrollment's transaction (hub/certificates.py `certify`).
    csr = _request_of(req.lan_csr, "lan_csr")
    if csr is None and settings.server.require_node_certificates:
        raise ApiError(
            ErrorCode.missing_required_parameter,
            "this hub enrolls only nodes with a certificate: send `lan_csr`",
            param="lan_csr",
        )

    def certified(node: Node) -> IssuedCertificate:
        assert csr is not None  # noqa: S101 - only passed with a request
        return certify(store.sync.certificates, hub_tls.authority, csr, node)

    try:
        enrolled = await store.run(
            store.sync.nodes.enroll,
            req.token,
            name=req.name,
            wg_public_key=req.wg_public_key,
            overlay_prefix=settings.overlay.prefix,
            labels=req.labels,
            versions=with_protocol(req.versions, version),
            certify=None if csr is None else certified,
        )
    except TokenRefusedError as err:
        raise ApiError(ErrorCode.invalid_enrollment_token, str(err), param="token") from err
    except AlreadyEnrolledError as err:
        raise ApiError(ErrorCode.already_enrolled, str(err), param="wg_public_key") from err
    except (NameRefusedError, NameTakenError) as err:
        raise _name_error(err, "lan_csr") from err
    node = enrolled.node
    identity = request.app[IDENTITY]
    endpoint = (
        settings.overlay.endpoint or f"{settings.server.names[0]}:{settings.overlay.listen_port}"
    )
    issued = enrolled.certificate
    reply = protocol.EnrollAnswer(
        node_id=node.id,
        node_token=enrolled.node_token,
        name=node.name,
        site=node.site,
        overlay_address=node.overlay_address,
        overlay_prefix=settings.overlay.prefix,
        lan_certificate=issued.pem if issued else None,
        hub=protocol.HubPeer(
            wg_public_key=identity["wg_public_key"],
            overlay_address=identity["overlay_address"],
            endpoint=endpoint,
            api_url=f"https://{identity['overlay_address']}:{settings.server.port}",
            ca_pem=hub_tls.phase.signing.cert_pem.decode(),
        ),
        trust=hub_tls.phase.bundle.decode(),
        renew_at=_renew_at(issued) if issued else None,
    )
    return answer(reply, status=201, version=version)


def _request_of(pem: str | None, param: str) -> pki.Request | None:
    if pem is None:
        return None
    try:
        return pki.read_request(pem.encode())
    except pki.RequestError as err:
        raise ApiError(ErrorCode.invalid_value, str(err), param=param) from err


def _name_error(err: NameRefusedError | NameTakenError, param: str) -> ApiError:
    if isinstance(err, NameTakenError):
        return ApiError(ErrorCode.certificate_name_taken, str(err), param=param)
    return ApiError(ErrorCode.certificate_name_refused, str(err), param=param)


def _renew_at(issued: IssuedCertificate) -> float:
    return pki.renew_at(issued.pem.encode()).timestamp()


async def trust(request: web.Request) -> web.Response:
    """The fleet's CA bundle: public (certificates only). A node enrolling fetches it
    first and keeps it when it holds the CA its provisioning file pins."""
    hub_tls = request.app[TLS]
    return answer(protocol.TrustAnswer(bundle=hub_tls.phase.bundle.decode(), digest=hub_tls.digest))


async def certificate(request: web.Request) -> web.Response:
    """A node's certificate issued again, for a new key: before a third of its lifetime
    is left, or when its LAN addresses changed. A revoked node never gets here (the
    middleware refuses it), so its last certificate dies within its lifetime."""
    req = await parse(request, protocol.CertificateRequest)
    csr = _request_of(req.csr, "csr")
    assert csr is not None  # noqa: S101 - csr is required
    node = request[NODE]
    store = request.app[STORE]
    hub_tls = request.app[TLS]
    try:
        issued = await store.run(certify, store.sync.certificates, hub_tls.authority, csr, node)
    except (NameRefusedError, NameTakenError) as err:
        # For the operator (`kvl hub nodes list`): a node a hub upgraded over a fleet
        # finds with a name it may no longer hold is told why, and so is the operator.
        await store.run(store.sync.nodes.note_certificate_refused, node.id, str(err))
        raise _name_error(err, "csr") from err
    # (The node this call carries may be one this replica remembers from before.)
    await store.run(store.sync.nodes.note_certificate_refused, node.id, None)
    store.note_certificate(node.id)
    return answer(
        protocol.CertificateAnswer(
            certificate=issued.pem,
            trust=hub_tls.phase.bundle.decode(),
            renew_at=_renew_at(issued),
            not_after=issued.not_after,
        ),
        version=request[NODE_PROTOCOL],
    )


ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/trust",
        trust,
        "The fleet's CA bundle (certificates only) and its digest: what a node trusts the hub by.",
        Auth.none,
        answer=protocol.TrustAnswer,
    ),
    Route(
        "POST",
        "/v1/enroll",
        enroll,
        "Enroll a node with an enrollment token: one use of the token spent, the node "
        "registered with the next free overlay address and its certificate signed for the "
        "names the hub decides; its node token is in this answer only.",
        Auth.enrollment,
        protocol.EnrollRequest,
        protocol.EnrollAnswer,
        status=201,
        errors=(
            ErrorCode.invalid_enrollment_token,
            ErrorCode.already_enrolled,
            ErrorCode.missing_required_parameter,
            ErrorCode.certificate_name_refused,
            ErrorCode.certificate_name_taken,
        ),
    ),
    Route(
        "POST",
        "/v1/node/certificate",
        certificate,
        "The node's certificate issued again for a new key (before a third of its lifetime "
        "is left, when its addresses changed, or when the hub says it is due).",
        Auth.node,
        protocol.CertificateRequest,
        protocol.CertificateAnswer,
        errors=(ErrorCode.certificate_name_refused, ErrorCode.certificate_name_taken),
    ),
)
