"""What the tests of an appliance in a fleet share: a provisioning file for a hub on
loopback, an in-process appliance enrolled with it, and a fleet account on its store."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from appliance.app import create_app
from appliance.gateway.appkeys import REGISTRY
from appliance.state.store import Store
from hub.identity import certificates
from hub.state.store import open_store
from shared import protocol
from tests.conftest import SCRIPTED, make_settings

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp import web
    from pytest_aiohttp import AiohttpClient

    from appliance.state.records import ModelRecord
    from appliance.state.store import Account, AsyncStore
    from hub.settings import HubSettings
    from tests.conftest import Client


def provisioning(tmp_path: Path, hub: HubSettings, port: int, uses: int = 1) -> Path:
    store = open_store(hub)
    try:
        token = store.tokens.create("school-a", uses=uses, expires_in_s=600).plaintext
        # The account of the appliances' LAN key (`fleet_appliance`): a fleet account, so
        # its usage goes to the hub (a node's own accounts keep theirs).
        store.accounts.put("lan-user", "S1")
    finally:
        store.close()
    ca, _ = certificates(hub)
    path = tmp_path / "kovenlab.json"
    path.write_text(
        json.dumps(
            {
                "hub_url": f"https://127.0.0.1:{port}",
                "token": token,
                "hub_fingerprint": ca.fingerprint,
                "name": "lab-server",
            }
        )
    )
    return path


async def complete(client: Any, key: str, model: str = SCRIPTED) -> None:
    response = await client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "prompt": "Hi", "max_tokens": 2},
    )
    assert response.status == 200, await response.text()


async def given_by_hub(store: AsyncStore, name: str = "lan-user") -> bool:
    """Whether the node holds `name` as the fleet's account (a heartbeat brought the hub's
    desired state): only then is its usage synced to the hub."""
    account = await store.run(store.sync.get_account, name)
    return account is not None and account.fleet


async def fleet_account(store: AsyncStore, name: str = "lan-user") -> Account:
    """An account of the fleet on a node's store, as the hub's desired state gives it
    (accounts made on the node keep their usage there; the fleet's is synced)."""
    given = protocol.AccountState(name=name, service_class="S1")
    await store.run(
        store.sync.apply_desired_state,
        protocol.DesiredState(node_id="-", serial=0, accounts=[given], keys=[]),
    )
    return await store.run(store.sync.ensure_account, name)


async def fleet_appliance(
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    model: ModelRecord,
    provisioning_file: Path,
    **fleet: object,
) -> tuple[web.Application, Client, str]:
    """An in-process appliance in the fleet (no tunnel) serving ``model`` (the scripted
    one, unless the model is what is tested), loaded; (app, client, a LAN key)."""
    settings = make_settings(
        tmp_path / "data",
        model={"default": model.name, "chat_default": model.name},
        embeddings={"enabled": False},
        fleet={"provisioning_file": str(provisioning_file), "tunnel": False, **fleet},
    )
    store = Store(settings.db_path)
    store.add_model(model)
    key = store.create_key("lan-user").plaintext
    store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    return app, client, key
