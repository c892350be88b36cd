"""Uploads of model files over the operator API (hub/api/uploads.py): in pieces at their
offsets, resumed after a cut and after the hub restarted, checked once whole and
registered; a wrong sha256, a file that is not a GGUF, a piece at the wrong offset or past
the size, and a cancel each refused or ended with nothing registered."""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any

import aiohttp

from hub.app import create_app
from hub.identity import certificates, ssl_context
from hub.state.store import open_store
from shared import pki
from tests.conftest import kvl
from tests.hfhub import tiny_gguf
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp.test_utils import TestServer
    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings

MIB = 1 << 20


class Operator:
    def __init__(self, hub: HubSettings, server: TestServer, token: str) -> None:
        self.base = f"https://127.0.0.1:{server.port}/v1/admin/models/uploads"
        self.pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
        self.headers = {"Authorization": f"Bearer {token}"}

    async def call(
        self, method: str, path: str = "", *, body: Any = None, data: bytes | None = None,
        offset: int | None = None,
    ) -> tuple[int, Any]:  # fmt: skip
        headers = dict(self.headers)
        if offset is not None:
            headers["Upload-Offset"] = str(offset)
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.base + path, json=body, headers=headers, ssl=self.pin,
                            data=None if data is None else io.BytesIO(data)) as response,
        ):  # fmt: skip
            return response.status, await response.json()


def _models(hub: HubSettings) -> list[str]:
    store = open_store(hub)
    try:
        return [m.ref for m in store.deployments.models()]
    finally:
        store.close()


async def test_an_upload_goes_on_after_a_cut_and_a_restart_and_registers_the_checked_model(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path)
    token = kvl("hub", "operators", "create", "--name", "ops", "--data-dir", str(hub.data_dir))
    data = tiny_gguf("upload", 3 * MIB + 17)
    sha256 = hashlib.sha256(data).hexdigest()
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    ops = Operator(hub, server, token.stdout.strip())
    status, upload = await ops.call(
        "POST", body={"name": "tiny", "version": "1", "size_bytes": len(data), "sha256": sha256}
    )
    assert (status, upload["offset"], upload["state"]) == (201, 0, "open"), upload
    path = f"/{upload['id']}"
    status, piece = await ops.call("PATCH", path, data=data[:MIB], offset=0)
    assert (status, piece["offset"]) == (200, MIB), piece
    # The same piece again (a client that did not hear the answer): refused, saying where.
    status, again = await ops.call("PATCH", path, data=data[:MIB], offset=0)
    assert (status, again["error"]["code"]) == (409, "upload_offset_mismatch")
    assert f"stands at {MIB} bytes" in again["error"]["message"]

    # The hub restarts: the upload goes on from where it stood.
    await server.close()
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    ops = Operator(hub, server, token.stdout.strip())
    status, shown = await ops.call("GET", path)
    assert (status, shown["offset"]) == (200, MIB), shown
    status, past = await ops.call("PATCH", path, data=data[MIB:] + b"x", offset=MIB)
    assert (status, past["error"]["code"]) == (413, "request_too_large")
    status, shown = await ops.call("GET", path)
    offset = shown["offset"]
    status, done = await ops.call("PATCH", path, data=data[offset:], offset=offset)
    assert (status, done["state"], done["model"]) == (200, "done", "tiny@1"), done
    assert (hub.artifacts_dir / sha256).read_bytes() == data
    assert _models(hub) == ["tiny@1"]
    status, late = await ops.call("DELETE", path)
    assert (status, late["error"]["code"]) == (409, "job_finished")

    # A file whose bytes are not the sha256 given, and one that is not a GGUF: failed,
    # deleted, nothing registered.
    for name, body, why in (
        ("wrong", tiny_gguf("other", MIB), "sha256"),
        ("notgguf", b"not a model" * 1000, "not a GGUF model"),
    ):
        status, made = await ops.call("POST", body={
            "name": name, "version": "1", "size_bytes": len(body),
            "sha256": sha256 if name == "wrong" else None,
        })  # fmt: skip
        assert status == 201, made
        status, refused = await ops.call("PATCH", f"/{made['id']}", data=body, offset=0)
        assert (status, refused["error"]["code"]) == (400, "invalid_value"), refused
        assert why in refused["error"]["message"]
        status, shown = await ops.call("GET", f"/{made['id']}")
        assert (shown["state"], shown["offset"]) == ("failed", 0), shown
    assert _models(hub) == ["tiny@1"]

    # Cancelled; already registered; too large: refused before a byte.
    status, made = await ops.call("POST", body={"name": "c", "version": "1", "size_bytes": 10})
    status, cancelled = await ops.call("DELETE", f"/{made['id']}")
    assert (status, cancelled["state"]) == (200, "cancelled")
    assert not list(hub.uploads_dir.glob("*.part"))
    for wrong, param in (
        ({"name": "tiny", "version": "1", "size_bytes": 10}, "version"),
        ({"name": "big", "version": "1", "size_bytes": 1 << 43}, "size_bytes"),
    ):
        status, refused = await ops.call("POST", body=wrong)
        assert (status, refused["error"]["param"]) == (400, param), refused
    assert (await ops.call("GET", "/nope"))[0] == 404
