"""Nodes a test enrolls straight in a hub's store, and the calls it makes as one: each
with its bearer token and the protocol's headers, each refusal in the one error shape."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from hub.state.store import HubStore
from shared import protocol
from shared.errors import ErrorCode
from tests.hubs import PREFIX, new_key

if TYPE_CHECKING:
    from aiohttp.test_utils import TestClient


def enroll_node(store: HubStore, name: str) -> tuple[str, str]:
    token = store.tokens.create("site", uses=1, expires_in_s=60).plaintext
    enrolled = store.nodes.enroll(
        token, name=name, wg_public_key=new_key(), overlay_prefix=PREFIX, labels={}, versions={}
    )
    return enrolled.node.id, enrolled.node_token


async def node_call(
    client: TestClient[Any, Any],
    method: str,
    path: str,
    token: str,
    body: str | bytes = "",
    *,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    response = await client.request(
        method,
        path,
        data=body or None,
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            **protocol.HEADERS,
            **(headers or {}),
        },
    )
    raw = await response.read()
    return response.status, json.loads(raw) if raw else None


def assert_refused(status: int, body: Any, what: str) -> None:
    assert 400 <= status < 500, f"{what}: {status} {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, what
    assert ErrorCode(error["code"]).status == status, what
