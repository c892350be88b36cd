"""What the tests of the appliance's gateway share: the model they ask, an API key's
header, a request, and the one error shape every refusal takes."""

from __future__ import annotations

import json
from typing import Any

from shared.errors import ErrorCode
from tests.conftest import SCRIPTED, Client

# The scripted model (tests/conftest.py); the tests of the model itself (marked `model`) get
# the real default model, Gemma 3 270M.
MODEL = SCRIPTED


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(body: Any, code: ErrorCode, param: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code.value
    assert body["error"]["type"] == code.type
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


async def post(client: Client, path: str, key: str, body: Any) -> tuple[int, Any, Any]:
    response = await client.post(path, headers=auth(key), data=json.dumps(body))
    return response.status, await response.json(), response.headers
