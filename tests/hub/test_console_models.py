"""The console's Add model page over real HTTPS on loopback: the models the hub holds, a
pull started from its form (the hub's pull job, by the logged-in user), its progress in the
page's stream, and a file uploaded in pieces through the page's own calls, which need the
login's CSRF token in a header and this console's origin."""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any

import pytest

from hub.state.store import open_store
from tests.console import add_user, console_settings, open_console, start, stream_event
from tests.hfhub import tiny_gguf

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings
    from tests.console import Console
    from tests.hub.conftest import HubDatabase


@pytest.fixture
async def hub(tmp_path: Path, hub_database: HubDatabase) -> HubSettings:
    # Pulls from nowhere: the page's subject is the job it starts, not the download.
    settings = console_settings(tmp_path, hub_database)
    return settings.model_copy(
        update={"models": settings.models.model_copy(update={"hf_endpoint": "http://127.0.0.1:9"})}
    )


@pytest.fixture
async def console(aiohttp_server: AiohttpServer, hub: HubSettings) -> AsyncIterator[Console]:
    add_user(hub)
    server = await start(aiohttp_server, hub)
    async with open_console(server, hub) as c:
        yield c


async def _call(
    console: Console, method: str, path: str, *, csrf: str | None, origin: bool = True,
    body: Any = None, data: bytes | None = None, offset: int | None = None,
) -> tuple[int, Any]:  # fmt: skip
    headers = {"Origin": console.base} if origin else {}
    if csrf is not None:
        headers["X-CSRF-Token"] = csrf
    if offset is not None:
        headers["Upload-Offset"] = str(offset)
    async with console.session.request(
        method, console.base + path, json=body, headers=headers,
        data=None if data is None else io.BytesIO(data),
    ) as response:  # fmt: skip
        return response.status, await response.json()


async def test_the_models_page_pulls_and_uploads_and_shows_their_progress(
    console: Console, hub: HubSettings
) -> None:
    assert await console.login() == 303
    status, page, _ = await console.get("/console/models")
    assert status == 200
    assert "No model yet." in page

    status, _, answer = await console.post(
        "/console/models/pull", {"reference": "hf://owner/repo:Q4_K_M", "name": "", "version": ""}
    )
    assert status == 303, answer
    store = open_store(hub)
    try:
        [pull] = store.pulls.recent()
    finally:
        store.close()
    assert (pull.reference, pull.created_by) == ("hf://owner/repo:Q4_K_M", "ops")
    status, page, _ = await console.post("/console/models/pull", {"reference": "ftp://x/y"})
    assert status == 400
    assert "Not pulled" in page

    async with console.session.get(console.base + "/console/models/stream") as response:
        seen = await stream_event(response, "models")
    assert seen["pulls"][0]["reference"] == "hf://owner/repo:Q4_K_M"

    # An upload in two pieces through the page's calls: registered once whole.
    data = tiny_gguf("console", (1 << 20) + 5)
    body = {"name": "mine", "version": "1", "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    for csrf, origin in ((None, True), ("wrong", True), (console.csrf, False)):
        status, refused = await _call(
            console, "POST", "/console/models/uploads", csrf=csrf, origin=origin, body=body
        )
        assert (status, refused["error"]["code"]) == (403, "permission_denied")
    status, made = await _call(console, "POST", "/console/models/uploads", csrf=console.csrf,
                               body=body)  # fmt: skip
    assert status == 201, made
    path = f"/console/models/uploads/{made['id']}"
    status, piece = await _call(console, "PATCH", path, csrf=console.csrf, data=data[:1000],
                                offset=0)  # fmt: skip
    assert (status, piece["offset"]) == (200, 1000), piece
    status, shown = await _call(console, "GET", path, csrf=console.csrf)
    assert (status, shown["offset"], shown["created_by"]) == (200, 1000, "ops")
    status, done = await _call(console, "PATCH", path, csrf=console.csrf, data=data[1000:],
                               offset=1000)  # fmt: skip
    assert (status, done["state"], done["model"]) == (200, "done", "mine@1"), done
    status, page, _ = await console.get("/console/models")
    assert "mine@1" in page
    assert "upload" in page
