"""HTTP calls to the hub over mutual TLS: the hub's certificate must chain to the fleet's
CA bundle and name the hub's address, and this node's certificate goes with each call.
Every message is one of shared/protocol.py's, both ways: what the hub answers is
validated too, and an answer this node cannot read is a HubError (try again later),
never a crash.

Before enrollment the node has no bundle, only its provisioning file's pin: `bootstrap`
fetches the hub's bundle (`GET /v1/trust`) and keeps, of it, the CA the pin names, and
enrollment goes over a connection that CA verifies, to a certificate that carries a hub's
URI (`spiffe://…/hub`: never a node's certificate of the same CA). A pin of the hub's own
certificate (a provisioning file of protocol 2) is still honoured, by fingerprint."""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import aiohttp
from pydantic import ValidationError

from shared import jsonlimits, protocol, tls

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from appliance.fleet.certificates import NodeCertificate
    from appliance.fleet.identity import Identity
    from shared.provisioning import Provisioning


class HubError(Exception):
    """The hub could not be reached, or answered with a server error: try again later."""


class HubRefusedError(Exception):
    """The hub refused the call (4xx): trying again will not help without a change."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"the hub refused ({status} {code}): {message}")
        self.status = status
        self.code = code


M = TypeVar("M", bound=protocol.Message)


@dataclass(frozen=True)
class Proxy:
    """The site's HTTPS proxy for the node's calls to its hub (`fleet.https_proxy`), and
    the hosts it does not serve (`fleet.no_proxy`: names, which also cover their
    subdomains, `.suffix`es, addresses, networks in CIDR, or `*`)."""

    url: str
    no_proxy: tuple[str, ...] = ()

    def for_url(self, url: str) -> str | None:
        """The proxy a call to `url` goes through, or None (it goes direct)."""
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
        for entry in self.no_proxy:
            rule = entry.strip().lower().rstrip(".")
            if rule == "*" or _bypassed(host, rule):
                return None
        return self.url


def _bypassed(host: str, rule: str) -> bool:
    if not rule:
        return False
    try:
        return ipaddress.ip_address(host) in ipaddress.ip_network(rule, strict=False)
    except ValueError:
        pass  # a name, not an address within a network
    bare = rule.lstrip(".")
    return host == bare or host.endswith(f".{bare}")


def _error_of(status: int, raw: bytes) -> HubRefusedError:
    try:
        error = jsonlimits.loads(raw)["error"]
        code, message = str(error["code"]), str(error["message"])[:1000]
    except (ValueError, KeyError, TypeError):
        code, message = "unknown", raw[:200].decode("utf-8", "replace")
    return HubRefusedError(status, code, message)


Verification = ssl.SSLContext | aiohttp.Fingerprint


async def bootstrap(hub_url: str, pin: bytes, proxy: Proxy | None = None) -> Verification:
    """How to verify the hub before this node trusts anything else: the CA of the hub's
    bundle whose fingerprint is ``pin`` (the hub's certificate must chain to it and name
    the hub), or, where no CA of the bundle matches, the hub's own certificate by its
    fingerprint. The bundle is fetched without verification, and only a CA it holds
    that the pin names is used: the pin is what is trusted."""
    from shared import pki  # noqa: PLC0415 - cryptography (14 MiB): only when enrolling

    try:
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=30),
                proxy=proxy.for_url(hub_url) if proxy is not None else None,
            ) as session,
            session.get(f"{hub_url.rstrip('/')}/v1/trust", ssl=False) as response,
        ):
            raw = await response.read() if response.status == 200 else b""
    except (aiohttp.ClientError, TimeoutError) as err:
        raise HubError(f"the hub is unreachable ({type(err).__name__}: {err})") from err
    try:
        bundle = protocol.TrustAnswer.model_validate_json(raw).bundle.encode() if raw else b""
        cas = pki.split_bundle(bundle) if bundle else []
    except ValueError:
        cas = []
    for ca in cas:
        if pki.fingerprint_bytes(pki.fingerprint(ca)) == pin:
            # The fleet's domain is not known yet: any hub's URI, never a node's.
            return tls.client_context(ca, identity=tls.hub_identity(None))
    return aiohttp.Fingerprint(pin)


class HubClient:
    def __init__(
        self,
        base_url: str,
        verification: Verification | Callable[[], Verification],
        token: str | None = None,
        proxy: Proxy | None = None,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._verification = verification
        self._headers = {protocol.PROTOCOL_HEADER: str(protocol.PROTOCOL_VERSION)}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        # Every call of this client through the site's proxy, unless its host bypasses it.
        self.proxy = proxy.for_url(self._base) if proxy is not None else None
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=30), proxy=self.proxy
        )

    @classmethod
    def for_node(
        cls,
        identity: Identity,
        base_url: str,
        certificate: NodeCertificate,
        proxy: Proxy | None = None,
    ) -> HubClient:
        """The node's client: the trust bundle, its certificate (both as they are at
        each call: a renewal or a rotation takes effect on the next connection)."""
        return cls(base_url, certificate.client_context, identity.node_token, proxy)

    @property
    def _ssl(self) -> Verification:
        verification = self._verification
        if isinstance(verification, (ssl.SSLContext, aiohttp.Fingerprint)):
            return verification
        return verification()

    async def __aenter__(self) -> HubClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def _call(
        self,
        method: str,
        path: str,
        answer: type[M],
        *,
        body: protocol.Message | None = None,
        params: dict[str, str] | None = None,
    ) -> M | None:
        """One call; its answer as `answer` (None for 204). HubError when the hub cannot
        be reached, answers 5xx or something unreadable; HubRefusedError for a 4xx."""
        data = None if body is None else body.model_dump_json().encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            try:
                status, raw = await self._send(method, path, data, params, headers)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                # A kept connection the hub closed (it restarted, say): once more, on a
                # new one. Every node call is safe to repeat (the ledger is unique on
                # event ids; the rest replace what they set).
                status, raw = await self._send(method, path, data, params, headers)
            if status >= 500:
                raise HubError(f"the hub answered {status} to {path}")
            if status >= 400:
                raise _error_of(status, raw)
            if status == 204:
                return None
        except aiohttp.ServerFingerprintMismatch as err:
            raise HubRefusedError(
                0,
                "fingerprint_mismatch",
                "the hub's certificate does not match the pinned fingerprint",
            ) from err
        except aiohttp.ClientConnectorCertificateError as err:
            # Not the fleet's hub, or not by the name called: trying again will not help.
            raise HubRefusedError(
                0, "certificate_untrusted", f"the hub's certificate does not verify: {err}"
            ) from err
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HubError(f"the hub is unreachable ({type(err).__name__}: {err})") from err
        try:
            return answer.model_validate_json(raw)
        except ValidationError as err:
            raise HubError(f"the hub's answer to {path} is not a {answer.__name__}: {err}") from err

    async def _send(
        self,
        method: str,
        path: str,
        data: bytes | None,
        params: dict[str, str] | None,
        headers: dict[str, str],
    ) -> tuple[int, bytes]:
        async with self._session.request(
            method, self._base + path, data=data, params=params, headers=headers, ssl=self._ssl
        ) as response:
            return response.status, await response.read()

    async def _post(self, path: str, body: protocol.Message, answer: type[M]) -> M:
        result = await self._call("POST", path, answer, body=body)
        if result is None:
            raise HubError(f"the hub answered {path} with no body")
        return result

    async def enroll(
        self,
        provisioning: Provisioning,
        wg_public_key: str,
        versions: dict[str, str],
        lan_csr: str | None = None,
    ) -> protocol.EnrollAnswer:
        request = protocol.EnrollRequest(
            token=provisioning.require_hub().token,
            name=provisioning.name,
            wg_public_key=wg_public_key,
            labels=provisioning.labels,
            versions=versions,
            lan_csr=lan_csr,
        )
        return await self._post("/v1/enroll", request, protocol.EnrollAnswer)

    async def heartbeat(
        self,
        versions: dict[str, str],
        capacity: protocol.Capacity,
        objectives: protocol.Objectives | None = None,
    ) -> protocol.HeartbeatAnswer:
        """The hub's answer: `received_at`, and the `desired_serial` it has now.
        `objectives`: the live objectives, cumulative (stored here before this call)."""
        request = protocol.HeartbeatRequest(
            versions=versions, capacity=capacity, objectives=objectives
        )
        return await self._post("/v1/node/heartbeat", request, protocol.HeartbeatAnswer)

    async def state(self, after: int) -> protocol.DesiredState | None:
        """This node's desired state, or None when it has not changed since ``after``."""
        return await self._call(
            "GET", "/v1/node/state", protocol.DesiredState, params={"after": str(after)}
        )

    async def leases(self, accounts: list[str], finals: dict[str, int]) -> protocol.LeaseAnswer:
        """Report retired leases' final spend and ask for new ones (hub/api/node.py `leases`)."""
        request = protocol.LeaseRequest(accounts=accounts, finals=finals)
        return await self._post("/v1/node/leases", request, protocol.LeaseAnswer)

    async def offload(
        self, route: str, body: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """Hand a request this node shed to the fleet (hub/offload.py); the caller streams
        the response and releases it. Raises HubError when the hub cannot be reached."""
        try:
            return await self._session.post(
                f"{self._base}/v1/node/offload/{route}",
                data=body,
                headers={**self._headers, **headers},
                ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300),
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HubError(f"the hub is unreachable ({type(err).__name__}: {err})") from err

    async def artifact(
        self, sha256: str, offset: int = 0, end: int | None = None
    ) -> aiohttp.ClientResponse:
        """A file given to this node, from byte `offset` (to byte `end`, inclusive) with
        206, or whole (200); the caller reads and releases it. Raises HubError when the hub
        cannot be reached."""
        headers = dict(self._headers)
        if offset or end is not None:
            # The hub's ETag is the digest: a resume never splices two different files.
            stop = "" if end is None else str(end)
            headers |= {"Range": f"bytes={offset}-{stop}", "If-Range": f'"{sha256}"'}
        try:
            return await self._session.get(
                f"{self._base}/v1/node/artifacts/{sha256}",
                headers=headers,
                ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60),
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HubError(f"the hub is unreachable ({type(err).__name__}: {err})") from err

    async def certificate(self, csr: str) -> protocol.CertificateAnswer:
        """This node's certificate issued again for a new key (hub/api/node.py)."""
        request = protocol.CertificateRequest(csr=csr)
        return await self._post("/v1/node/certificate", request, protocol.CertificateAnswer)

    async def trust(self) -> protocol.TrustAnswer:
        """The fleet's CA bundle, over a connection the bundle held so far verified."""
        answer = await self._call("GET", "/v1/trust", protocol.TrustAnswer)
        if answer is None:
            raise HubError("the hub answered /v1/trust with no body")
        return answer

    async def push(self, events: list[protocol.Event]) -> list[str]:
        """Send events to the ledger; the ids the hub acknowledged."""
        answer = await self._post(
            "/v1/node/events", protocol.EventsRequest(events=events), protocol.EventsAnswer
        )
        return list(answer.acknowledged)
