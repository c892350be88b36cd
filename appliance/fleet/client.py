"""HTTP calls to the hub, with its certificate pinned by fingerprint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from types import TracebackType

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


class HubClient:
    def __init__(self, base_url: str, pin: bytes, token: str | None = None) -> None:
        self._base = base_url.rstrip("/")
        self._ssl = aiohttp.Fingerprint(pin)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    @classmethod
    def for_node(cls, identity: Identity, base_url: str) -> HubClient:
        return cls(base_url, identity.pin(), identity.node_token)

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

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._session.post(
                self._base + path, json=body, headers=self._headers, ssl=self._ssl
            ) as response:
                if response.status >= 500:
                    raise HubError(f"the hub answered {response.status} to {path}")
                payload: dict[str, Any] = await response.json(content_type=None)
                if response.status >= 400:
                    error = payload.get("error") or {}
                    raise HubRefusedError(
                        response.status, str(error.get("code")), str(error.get("message"))
                    )
                return payload
        except aiohttp.ServerFingerprintMismatch as err:
            raise HubRefusedError(
                0,
                "fingerprint_mismatch",
                "the hub's certificate does not match the pinned fingerprint",
            ) from err
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HubError(f"the hub is unreachable ({type(err).__name__}: {err})") from err

    async def enroll(
        self,
        provisioning: Provisioning,
        wg_public_key: str,
        versions: dict[str, str],
        lan_csr: str | None = None,
    ) -> dict[str, Any]:
        return await self._post(
            "/v1/enroll",
            {
                "token": provisioning.token,
                "name": provisioning.name,
                "wg_public_key": wg_public_key,
                "labels": provisioning.labels,
                "versions": versions,
                "lan_csr": lan_csr,
            },
        )

    async def heartbeat(self, versions: dict[str, str], capacity: dict[str, Any]) -> dict[str, Any]:
        """The hub's answer: `received_at`, and the `desired_serial` it has now."""
        return await self._post("/v1/node/heartbeat", {"versions": versions, "capacity": capacity})

    async def state(self, after: int) -> dict[str, Any] | None:
        """This node's desired state, or None when it has not changed since ``after``."""
        try:
            async with self._session.get(
                f"{self._base}/v1/node/state",
                params={"after": str(after)},
                headers=self._headers,
                ssl=self._ssl,
            ) as response:
                if response.status == 204:
                    return None
                if response.status >= 500:
                    raise HubError(f"the hub answered {response.status} to /v1/node/state")
                payload: dict[str, Any] = await response.json(content_type=None)
                if response.status >= 400:
                    error = payload.get("error") or {}
                    raise HubRefusedError(
                        response.status, str(error.get("code")), str(error.get("message"))
                    )
                return payload
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HubError(f"the hub is unreachable ({type(err).__name__}: {err})") from err

    async def leases(self, accounts: list[str], finals: dict[str, int]) -> dict[str, Any]:
        """Report retired leases' final spend and ask for new ones (hub/api.py `leases`)."""
        return await self._post("/v1/node/leases", {"accounts": accounts, "finals": finals})

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

    async def artifact(self, sha256: str, offset: int = 0) -> aiohttp.ClientResponse:
        """A model file placed on this node, from byte `offset` (206) or whole (200); the
        caller reads and releases it. Raises HubError when the hub cannot be reached."""
        headers = dict(self._headers)
        if offset:
            # The hub's ETag is the digest: a resume never splices two different files.
            headers |= {"Range": f"bytes={offset}-", "If-Range": f'"{sha256}"'}
        try:
            return await self._session.get(
                f"{self._base}/v1/node/artifacts/{sha256}",
                headers=headers,
                ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60),
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HubError(f"the hub is unreachable ({type(err).__name__}: {err})") from err

    async def push(self, events: list[dict[str, Any]]) -> list[str]:
        """Send events to the ledger; the ids the hub acknowledged."""
        answer = await self._post("/v1/node/events", {"events": events})
        return [str(i) for i in answer.get("acknowledged", [])]
