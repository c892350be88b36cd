"""A server that stops while a client's keep-alive connection still sends requests: its
store is closed, so the request is answered 503 `shutting_down` in the one error shape,
and the connection closes (the client's next request reaches the server that follows),
never a 500 with a traceback. Seen when a hub was replaced on its port under load."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from aiohttp import web

from appliance.gateway.appkeys import STORE
from hub.http import errors
from shared.db import AsyncStore
from shared.errors import ErrorCode, ShuttingDown

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from aiohttp import ClientResponse
    from pytest_aiohttp import AiohttpClient

    from tests.conftest import Client


class _Nothing:
    def close(self) -> None:
        pass

    def answer(self) -> int:
        return 42


async def test_a_closed_store_refuses_work_as_shutting_down() -> None:
    store: AsyncStore[_Nothing] = AsyncStore(lambda _: _Nothing(), None)
    await store.open()
    assert await store.run(store.sync.answer) == 42
    await store.close()
    with pytest.raises(ShuttingDown):
        await store.run(store.sync.answer)


async def test_the_hub_answers_503_and_closes_the_connection(
    aiohttp_client: AiohttpClient,
) -> None:
    async def stopped(request: web.Request) -> web.Response:
        raise ShuttingDown("the server is stopping; send the request again", retry_after=1)

    app = web.Application(middlewares=[errors])
    app.router.add_get("/v1/x", stopped)
    await _refused((await aiohttp_client(app)).get("/v1/x"))


async def test_an_appliance_whose_store_closed_answers_503_and_closes_the_connection(
    client: Client, api_key: str
) -> None:
    # The store as the app's cleanup leaves it while a connection lives; open again after,
    # for the cleanup's own steps that write before the store closes.
    store = client.app[STORE]
    store._closed = True
    try:
        await _refused(client.get("/v1/models", headers={"Authorization": f"Bearer {api_key}"}))
    finally:
        store._closed = False


async def _refused(sent: Awaitable[ClientResponse]) -> None:
    response = await sent
    assert response.status == 503
    assert (await response.json())["error"]["code"] == ErrorCode.shutting_down.value
    assert response.headers["Retry-After"] == "1"
    assert response.headers.get("Connection", "").lower() == "close"
