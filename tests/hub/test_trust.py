"""The fleet's trust chain on the hub: certificates that verify strictly everywhere, names
a node cannot steal, short-lived certificates renewed and refused to revoked nodes,
mutual TLS on node calls, and the CA's rotation with an overlap. A real hub over HTTPS
on loopback, real certificates, `openssl verify -x509_strict`."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from wireguard_tools import WireguardKey

from hub.app import create_app
from hub.appkeys import STORE
from hub.certificates import Authority, HubTls
from hub.identity import certificates
from hub.settings import HubSettings
from hub.state.store import open_store
from shared import pki, protocol, tls
from shared.errors import ErrorCode
from tests.conftest import kvl
from tests.hubs import settings_for

if TYPE_CHECKING:
    from aiohttp.test_utils import TestServer
    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase

OPENSSL = shutil.which("openssl")


def hub_settings(tmp_path: Path, database: HubDatabase | None = None, **pki_: Any) -> HubSettings:
    return settings_for(
        tmp_path, database, names=["localhost", "127.0.0.1"], pki={"reload_s": 0.5, **pki_}
    )


def openssl_verify(ca_pems: list[bytes], cert_pem: bytes, purpose: str) -> None:
    """`openssl verify -x509_strict` of ``cert_pem`` under ``ca_pems``; fails the test
    with what openssl said."""
    assert OPENSSL is not None, "openssl is installed by `just setup` (Debian's openssl)"
    with tempfile.TemporaryDirectory() as folder:
        ca = Path(folder) / "ca.pem"
        ca.write_bytes(b"".join(ca_pems))
        leaf = Path(folder) / "leaf.pem"
        leaf.write_bytes(cert_pem)
        done = subprocess.run(
            [OPENSSL, "verify", "-x509_strict", "-purpose", purpose, "-CAfile", str(ca), str(leaf)],
            capture_output=True,
            text=True,
            check=False,
        )
    assert done.returncode == 0, done.stdout + done.stderr


@dataclass
class RawNode:
    """A node speaking the protocol by hand: its key, its certificate, its calls."""

    base: str
    trust: bytes
    folder: Path
    token: str = ""
    node_id: str = ""
    cert_pem: bytes = b""

    @property
    def files(self) -> tuple[Path, Path]:
        return self.folder / "node.crt", self.folder / "node.key"

    def client(self, *, certificate: bool = True) -> ssl.SSLContext:
        files = (self.folder / "node.crt", self.folder / "node.key")
        return tls.client_context(self.trust, files if certificate else None)

    def keep(self, key_pem: bytes, cert_pem: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "node.key").write_bytes(key_pem)
        (self.folder / "node.crt").write_text(cert_pem)
        self.cert_pem = cert_pem.encode()

    async def call(
        self,
        session: aiohttp.ClientSession,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        certificate: bool = True,
        context: ssl.SSLContext | None = None,
    ) -> tuple[int, dict[str, Any]]:
        async with session.request(
            method,
            self.base + path,
            json=body,
            headers={"Authorization": f"Bearer {self.token}", **protocol.HEADERS},
            ssl=context or self.client(certificate=certificate),
        ) as response:
            return response.status, await response.json(content_type=None)


def make_token(settings: HubSettings, uses: int = 1) -> str:
    store = open_store(settings)
    try:
        return store.tokens.create("school-a", uses=uses, expires_in_s=600).plaintext
    finally:
        store.close()


async def enroll(
    session: aiohttp.ClientSession,
    server: TestServer,
    settings: HubSettings,
    folder: Path,
    *,
    name: str,
    names: list[str] | None = None,
    token: str | None = None,
) -> tuple[int, dict[str, Any], RawNode]:
    ca, _ = certificates(settings)
    node = RawNode(f"https://127.0.0.1:{server.port}", ca.cert_pem, folder)
    key_pem, csr = pki.new_request(names if names is not None else [name, "127.0.0.1"])
    body = {
        "token": token or make_token(settings),
        "name": name,
        "wg_public_key": str(WireguardKey.generate().public_key()),
        "lan_csr": csr.decode(),
    }
    async with session.post(
        node.base + "/v1/enroll",
        json=body,
        headers=protocol.HEADERS,
        ssl=tls.client_context(ca.cert_pem),
    ) as response:
        answer = await response.json()
        if response.status == 201:
            node.token = answer["node_token"]
            node.node_id = answer["node_id"]
            node.keep(key_pem, answer["lan_certificate"])
        return response.status, answer, node


async def start(aiohttp_server: AiohttpServer, settings: HubSettings) -> TestServer:
    app = create_app(settings)
    # The server context that follows pki/ (as `kvl hub serve` serves it).
    return await aiohttp_server(app, ssl=HubTls(settings).server.outer)


# -- strict certificates --------------------------------------------------------------------


async def test_every_certificate_the_ca_issues_verifies_strictly(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    """The CA, the hub's certificate and a node's, under `openssl verify -x509_strict`
    and Python's VERIFY_X509_STRICT (the default from Python 3.13), each for its
    purposes; and the node's names are the hub's decision."""
    settings = hub_settings(tmp_path)
    server = await start(aiohttp_server, settings)
    ca, hub_cert = certificates(settings)
    async with aiohttp.ClientSession() as session:
        status, answer, node = await enroll(session, server, settings, tmp_path / "n", name="lab")
    assert status == 201, answer
    openssl_verify([ca.cert_pem], ca.cert_pem, "sslserver")
    for leaf in (hub_cert.cert_pem, node.cert_pem):
        openssl_verify([ca.cert_pem], leaf, "sslserver")
        openssl_verify([ca.cert_pem], leaf, "sslclient")
    cert = x509.load_pem_x509_certificate(node.cert_pem)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).critical
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).critical
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime <= datetime.timedelta(days=7, minutes=5)  # short-lived by default
    assert pki.names_of(node.cert_pem) == sorted(
        ["lab", "lab.local", "lab.kvl.internal", "100.64.0.2", "127.0.0.1", "::1", "localhost"]
    )
    assert pki.uris_of(cert) == [f"spiffe://kvl.internal/node/{node.node_id}"]
    # Python, strictly, both ways: the hub verifies the node, the node the hub.
    context = node.client()
    assert context.verify_flags & ssl.VERIFY_X509_STRICT
    async with (
        aiohttp.ClientSession() as session,
        session.get(node.base + "/v1/trust", ssl=context) as response,
    ):
        assert response.status == 200
        trust = protocol.TrustAnswer.model_validate(await response.json())
    assert trust.bundle.encode() == pki.bundle([ca.cert_pem])


def test_a_hub_certificate_without_the_strict_extensions_is_issued_again(tmp_path: Path) -> None:
    """A hub certificate as an older hub made it (no key identifiers: strict clients
    refuse it) is replaced; so is one for another fleet domain. A current one is kept."""
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415

    settings = hub_settings(tmp_path)
    authority = Authority(settings)
    signing = authority.phase().signing
    key = pki.new_key()
    ca_key = serialization.load_pem_private_key(signing.key_pem, password=None)
    start = pki.now()
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    old = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "hub")]))
        .issuer_name(signing.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=825))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    legacy = pki.Issued(old.public_bytes(serialization.Encoding.PEM), pki.key_pem(key))
    pki.write_issued(settings.pki_dir, "server", legacy)
    current = authority.hub_certificate()
    assert current != legacy
    openssl_verify([signing.cert_pem], current.cert_pem, "sslserver")
    assert authority.hub_certificate() == current  # kept while nothing is wrong with it
    other = Authority(hub_settings(tmp_path, fleet_domain="other.example")).hub_certificate()
    assert pki.uris_of(other.certificate) == ["spiffe://other.example/hub"]


# -- names ----------------------------------------------------------------------------------


async def test_a_node_cannot_have_another_nodes_names_or_the_hubs(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = hub_settings(tmp_path, hub_database)
    server = await start(aiohttp_server, settings)
    async with aiohttp.ClientSession() as session:
        status, _, first = await enroll(
            session, server, settings, tmp_path / "a", name="lab-a", names=["lab-a", "192.0.2.50"]
        )
        assert status == 201
        assert "192.0.2.50" in pki.names_of(first.cert_pem)
        cases = {
            # another node's LAN address, held by its live certificate
            "192.0.2.50": (409, ErrorCode.certificate_name_taken),
            # another node's name, and a name the hub did not give
            "lab-a.local": (403, ErrorCode.certificate_name_refused),
            "hub.example": (403, ErrorCode.certificate_name_refused),
            # the hub's names and addresses, and an overlay address not its own
            "localhost.kvl.internal": (403, ErrorCode.certificate_name_refused),
            "100.64.0.1": (403, ErrorCode.certificate_name_refused),
            "100.64.0.2": (403, ErrorCode.certificate_name_refused),
        }
        token = make_token(settings, uses=1)
        for name, (code, error) in cases.items():
            status, answer, _ = await enroll(
                session, server, settings, tmp_path / "b", name="lab-b",
                names=["lab-b", name], token=token,
            )  # fmt: skip
            assert status == code, (name, answer)
            assert answer["error"]["code"] == error, name
            assert name in answer["error"]["message"]
        # Refused before the token was spent: the same token enrolls with its own names.
        status, answer, second = await enroll(
            session, server, settings, tmp_path / "b", name="lab-b", token=token
        )
        assert status == 201, answer
        # And a renewal asking for another node's address is refused the same way.
        _key_pem, csr = pki.new_request(["lab-b", "192.0.2.50"])
        status, answer = await second.call(
            session, "POST", "/v1/node/certificate", {"csr": csr.decode()}
        )
        assert (status, answer["error"]["code"]) == (409, ErrorCode.certificate_name_taken)
    store = open_store(settings)
    try:
        assert len(store.certificates.of_node(first.node_id)) == 1
        assert len(store.certificates.of_node(second.node_id)) == 1  # nothing else was signed
    finally:
        store.close()


async def test_a_node_name_is_one_label_never_the_hubs_and_names_compare_canonically(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    """A hub named `hub.example.test` and `kvl-hub` (and 100.64.0.1 on the overlay): no
    node is issued a certificate for any of them, under any spelling (another case, an
    IPv4-mapped address, a dotted or numeric node name), nor for a case variant of a live
    node's name; the honest node's certificate and calls are as before."""
    settings = hub_settings(tmp_path, hub_database).model_copy(deep=True)
    settings.server.names = ["localhost", "127.0.0.1", "hub.example.test", "kvl-hub"]
    server = await start(aiohttp_server, settings)
    beat = {"versions": {"kvl": "0.1.0"}, "capacity": {}}
    async with aiohttp.ClientSession() as session:
        status, answer, honest = await enroll(
            session, server, settings, tmp_path / "a", name="honest-b",
            names=["honest-b", "192.0.2.50"],
        )  # fmt: skip
        assert status == 201, answer
        token = make_token(settings, uses=1)
        # Names that are not one DNS label: refused by the protocol, before any check.
        for name in ("hub.example.test", "100.64.0.1", "100", "0x64400001", "a_b", "-a"):
            status, answer, _ = await enroll(
                session, server, settings, tmp_path / "x", name=name, names=["x"], token=token
            )
            assert (status, answer["error"]["param"]) == (400, "name"), (name, answer)
        cases = {
            # the node name is one of the hub's
            ("kvl-hub", "kvl-hub"): (403, ErrorCode.certificate_name_refused),
            ("KVL-HUB", "KVL-HUB"): (403, ErrorCode.certificate_name_refused),
            # a case variant of a live node's name (its .local and fleet names with it)
            ("HONEST-B", "HONEST-B"): (409, ErrorCode.certificate_name_taken),
            # the hub's names and overlay address asked for, in any spelling
            ("lab-c", "HUB.EXAMPLE.TEST"): (403, ErrorCode.certificate_name_refused),
            ("lab-c", "hub.example.test."): (403, ErrorCode.certificate_name_refused),
            ("lab-c", "::ffff:100.64.0.1"): (403, ErrorCode.certificate_name_refused),
            ("lab-c", "0:0:0:0:0:ffff:6440:1"): (403, ErrorCode.certificate_name_refused),
            # another node's LAN address, IPv4-mapped
            ("lab-c", "::ffff:192.0.2.50"): (409, ErrorCode.certificate_name_taken),
        }
        for (name, asked), (code, error) in cases.items():
            status, answer, _ = await enroll(
                session, server, settings, tmp_path / "c", name=name,
                names=[name, asked], token=token,
            )  # fmt: skip
            assert (status, answer["error"]["code"]) == (code, error), (name, asked, answer)
        # Refused before the token was spent; the same token enrolls an honest name.
        status, answer, other = await enroll(
            session, server, settings, tmp_path / "c", name="Lab-C", token=token
        )
        assert status == 201, answer
        assert answer["name"] == "lab-c"  # names are given out lowercase
        assert "lab-c.kvl.internal" in pki.names_of(other.cert_pem)
        # The honest node: as before.
        assert pki.names_of(honest.cert_pem) == sorted(
            ["honest-b", "honest-b.local", "honest-b.kvl.internal", "100.64.0.2", "192.0.2.50",
             "127.0.0.1", "::1", "localhost"]
        )  # fmt: skip
        status, answer = await honest.call(session, "POST", "/v1/node/heartbeat", beat)
        assert status == 200, answer
    store = open_store(settings)
    try:
        claimed = [r[0] for r in store.db.execute("SELECT name FROM node_names").fetchall()]
    finally:
        store.close()
    assert not {"kvl-hub", "hub.example.test", "100.64.0.1"} & set(claimed)
    assert all(name == name.lower() for name in claimed)


async def test_a_node_left_with_a_name_of_the_hub_is_refused_renewal_and_listed_why(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    """A hub upgraded over a fleet where a node was enrolled as one of the hub's names
    (the store takes any name; the protocol no longer sends one): its renewal is refused
    with the reason, `kvl hub nodes list` shows it, and an honest node renews."""
    settings = hub_settings(tmp_path, hub_database).model_copy(deep=True)
    settings.server.names = ["localhost", "127.0.0.1", "kvl-hub"]
    server = await start(aiohttp_server, settings)
    store = open_store(settings)
    try:
        legacy = store.nodes.enroll(
            store.tokens.create("school-a", uses=1, expires_in_s=60).plaintext, name="kvl-hub",
            wg_public_key=str(WireguardKey.generate().public_key()),
            overlay_prefix=settings.overlay.prefix, labels={}, versions={},
        )  # fmt: skip
    finally:
        store.close()
    ca, _ = certificates(settings)
    node = RawNode(f"https://127.0.0.1:{server.port}", ca.cert_pem, tmp_path / "l",
                   token=legacy.node_token)  # fmt: skip
    _key, csr = pki.new_request(["kvl-hub"])
    async with aiohttp.ClientSession() as session:
        status, answer = await node.call(
            session, "POST", "/v1/node/certificate", {"csr": csr.decode()}, certificate=False
        )
        assert (status, answer["error"]["code"]) == (403, ErrorCode.certificate_name_refused)
        assert "a name of the hub" in answer["error"]["message"]
        status, _, honest = await enroll(session, server, settings, tmp_path / "h", name="lab")
        assert status == 201
        _key, csr = pki.new_request(["lab"])
        status, answer = await honest.call(
            session, "POST", "/v1/node/certificate", {"csr": csr.decode()}
        )
        assert status == 200, answer
    listed = kvl("hub", "nodes", "list", "--data-dir", str(settings.data_dir)).stdout
    assert "certificate refused: kvl-hub: a name of the hub" in listed, listed
    store = open_store(settings)
    try:
        assert store.nodes.get(legacy.node.id).certificate_refused is not None
        assert store.nodes.get(honest.node_id).certificate_refused is None
        assert store.certificates.of_node(legacy.node.id) == []
    finally:
        store.close()


async def test_a_node_client_refuses_a_fleet_certificate_that_is_not_the_hubs(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    """A node's certificate, signed by the fleet's CA and naming the address called,
    served as if it were the hub: the node's HubClient (and enrollment's bootstrap
    context) refuse the handshake, so the node token never reaches it; the real hub's
    certificate, on the same address, passes."""
    from appliance.fleet.certificates import NodeCertificate  # noqa: PLC0415
    from appliance.fleet.client import HubClient, HubRefusedError  # noqa: PLC0415

    settings = hub_settings(tmp_path)
    server = await start(aiohttp_server, settings)
    async with aiohttp.ClientSession() as session:
        status, _, node = await enroll(session, server, settings, tmp_path / "n", name="lab")
    assert status == 201
    # The appliance's own files: its certificate, key and the trust bundle.
    folder = tmp_path / "fleet"
    folder.mkdir()
    (folder / "node.crt").write_bytes(node.cert_pem)
    (folder / "node.key").write_bytes((node.folder / "node.key").read_bytes())
    (folder / "trust.pem").write_bytes(HubTls(settings).phase.bundle)
    mine = NodeCertificate(folder)
    assert mine.hub_uri() == "spiffe://kvl.internal/hub"

    # The impostor: another node of the fleet, its CA-signed certificate for 127.0.0.1.
    seen: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({})

    fake = web.Application()
    fake.router.add_route("*", "/{tail:.*}", anything)
    impostor = await aiohttp_server(fake, ssl=tls.server_context(node.files, None))
    for base, client in (
        (f"https://127.0.0.1:{impostor.port}", HubClient(
            f"https://127.0.0.1:{impostor.port}", mine.client_context, "kvl_nt_secret")),
        (f"https://127.0.0.1:{impostor.port}", HubClient(
            f"https://127.0.0.1:{impostor.port}",
            tls.client_context(node.trust, identity=tls.hub_identity(None)), "kvl_nt_secret")),
    ):  # fmt: skip
        async with client:
            with pytest.raises(HubRefusedError) as refused:
                await client.trust()
        assert refused.value.code == "certificate_untrusted", base
    assert seen == []  # no request, so no token, ever reached the impostor
    # The same client, the hub's own certificate: it answers.
    async with HubClient(f"https://127.0.0.1:{server.port}", mine.client_context) as client:
        trust = await client.trust()
    assert trust.digest == HubTls(settings).digest


async def test_nothing_is_signed_before_the_token_is_checked(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    settings = hub_settings(tmp_path)
    server = await start(aiohttp_server, settings)
    async with aiohttp.ClientSession() as session:
        status, answer, _ = await enroll(
            session, server, settings, tmp_path / "n", name="lab", token="kvl_et_nope"
        )
    assert (status, answer["error"]["code"]) == (401, ErrorCode.invalid_enrollment_token)
    store = open_store(settings)
    try:
        rows = store.db.execute("SELECT COUNT(*) FROM node_certificates").fetchone()
        claimed = store.db.execute("SELECT COUNT(*) FROM node_names").fetchone()
    finally:
        store.close()
    assert (rows[0], claimed[0]) == (0, 0)


# -- renewal, revocation, mutual TLS ----------------------------------------------------------


async def test_renewal_revocation_and_mutual_tls(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = hub_settings(tmp_path, hub_database)
    server = await start(aiohttp_server, settings)
    beat = {"versions": {"kvl": "0.1.0"}, "capacity": {}}
    async with aiohttp.ClientSession() as session:
        _, _, node = await enroll(session, server, settings, tmp_path / "a", name="lab-a")
        _, _, other = await enroll(session, server, settings, tmp_path / "b", name="lab-b")
        status, answer = await node.call(session, "POST", "/v1/node/heartbeat", beat)
        assert status == 200, answer
        heartbeat = protocol.HeartbeatAnswer.model_validate(answer)
        assert heartbeat.renew_certificate is False
        assert heartbeat.trust_digest == HubTls(settings).digest

        # Without its certificate, or with another node's: refused.
        status, answer = await node.call(
            session, "POST", "/v1/node/heartbeat", beat, certificate=False
        )
        assert (status, answer["error"]["code"]) == (401, ErrorCode.client_certificate_required)
        status, answer = await node.call(
            session, "POST", "/v1/node/heartbeat", beat, context=other.client()
        )
        assert (status, answer["error"]["code"]) == (403, ErrorCode.certificate_mismatch)
        # A certificate of another CA does not get through the handshake.
        impostor = pki.new_ca("impostor")
        foreign = pki.issue_with_key(
            impostor, common_name="lab-a", names=["lab-a"],
            uri=pki.node_uri("kvl.internal", node.node_id), lifetime=datetime.timedelta(days=1),
        )  # fmt: skip
        pki.write_issued(tmp_path / "f", "node", foreign)
        context = tls.client_context(node.trust, (tmp_path / "f/node.crt", tmp_path / "f/node.key"))
        with pytest.raises(aiohttp.ClientError):
            await node.call(session, "POST", "/v1/node/heartbeat", beat, context=context)

        # Renewal: a new key, a new certificate, names decided again.
        key_pem, csr = pki.new_request(["lab-a", "192.0.2.60"])
        status, answer = await node.call(
            session, "POST", "/v1/node/certificate", {"csr": csr.decode()}
        )
        assert status == 200, answer
        renewed = protocol.CertificateAnswer.model_validate(answer)
        assert "192.0.2.60" in pki.names_of(renewed.certificate.encode())
        old_serial = x509.load_pem_x509_certificate(node.cert_pem).serial_number
        node.keep(key_pem, renewed.certificate)
        assert x509.load_pem_x509_certificate(node.cert_pem).serial_number != old_serial
        assert renewed.renew_at < renewed.not_after
        status, _ = await node.call(session, "POST", "/v1/node/heartbeat", beat)
        assert status == 200

        # Revoked: no renewal, so its certificate dies within its lifetime.
        await server.app[STORE].revoke_node(node.node_id)
        _, csr = pki.new_request(["lab-a"])
        status, answer = await node.call(
            session, "POST", "/v1/node/certificate", {"csr": csr.decode()}
        )
        assert (status, answer["error"]["code"]) == (403, ErrorCode.node_revoked)
    lifetime = datetime.timedelta(days=settings.pki.node_certificate_days, minutes=5)
    cert = x509.load_pem_x509_certificate(node.cert_pem)
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= lifetime
