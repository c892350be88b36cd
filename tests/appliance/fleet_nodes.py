"""In-process appliances that have joined a hub on loopback (no tunnel), each serving on
the port its heartbeats announce, so the hub can reach it (offload, placement)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.app import create_app
from appliance.gateway.appkeys import REGISTRY
from appliance.state.store import Store
from hub.identity import certificates
from hub.state.store import open_store
from tests.conftest import free_port, make_settings
from tests.hubs import settings_for

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from aiohttp import web
    from aiohttp.test_utils import TestServer
    from pytest_aiohttp import AiohttpServer

    from appliance.state.records import ModelRecord
    from hub.settings import HubSettings


def placement_hub(tmp_path: Path) -> HubSettings:
    """A hub on loopback that places models every 0.3 s and gives a node up (stale at
    2 s, offline at 4 s, its placements moved 4 s later) within seconds."""
    return settings_for(
        tmp_path,
        fleet={"stale_after_s": 2, "offline_after_s": 4, "offline_grace_s": 4,
               "placement_every_s": 0.3},
    )  # fmt: skip


@dataclass
class FleetNode:
    app: web.Application
    server: TestServer
    base_url: str
    key: str  # a LAN key of the account "lan-user"


async def join(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    record: ModelRecord,
    hub: HubSettings,
    hub_port: int,
    *,
    name: str,
    model: dict[str, Any],
    fleet: dict[str, Any] | None = None,
    sections: dict[str, Any] | None = None,
    others: Sequence[ModelRecord] = (),
) -> FleetNode:
    """An appliance enrolled with the hub through a provisioning file of its own, serving
    ``record`` (its default model), loaded; ``model``: its model settings; ``sections``:
    more of its settings (`tracing`); ``others``: more models registered on it."""
    store = open_store(hub)
    token = store.tokens.create("site", uses=1, expires_in_s=600).plaintext
    store.accounts.put("lan-user", "S1")  # the LAN key's account, the fleet's: usage syncs
    store.close()
    provisioning = tmp_path / f"{name}.json"
    provisioning.write_text(json.dumps({
        "hub_url": f"https://127.0.0.1:{hub_port}", "token": token,
        "hub_fingerprint": certificates(hub)[0].fingerprint, "name": name,
    }))  # fmt: skip
    port = free_port()
    settings = make_settings(
        tmp_path / name,
        model={"default": record.name, "chat_default": record.name, **model},
        embeddings={"enabled": False},
        server={"port": port},
        fleet={"provisioning_file": str(provisioning), "tunnel": False, "lan_tls": False,
               "heartbeat_s": 1, "sync_interval_s": 0.5, **(fleet or {})},
        **(sections or {}),
    )  # fmt: skip
    local = Store(settings.db_path)
    for registered in (record, *others):
        local.add_model(registered)
    key = local.create_key("lan-user").plaintext
    local.close()
    app = create_app(settings)
    server = await aiohttp_server(app, port=port)
    await app[REGISTRY].wait_loaded()
    return FleetNode(app, server, f"http://127.0.0.1:{port}", key)
