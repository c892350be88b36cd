"""The site's network through the admin API, against the image's network agent
(image/network.py) on temporary folders, run as kovenlab-network.path would run it: a change
asked for, tried, kept once confirmed over it; one left unconfirmed rolled back; a change
asked for during a trial, a stray confirmation and a wrong setting refused; off the image,
the route says the network is not managed. networkd itself takes the files in the QEMU test
(tests/image/test_hubless_image.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from appliance.app import create_app
from appliance.state.store import Store
from image.network import NETWORK_FILE
from shared.errors import ErrorCode
from tests.conftest import make_settings
from tests.network_agent import Agent

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from appliance.settings import ApplianceSettings
    from tests.conftest import Client

STATIC = {"addresses": ["198.18.7.20/24"], "gateways": ["198.18.7.2"], "dns": ["198.18.7.3"]}


def _keys(settings: ApplianceSettings) -> tuple[dict[str, str], dict[str, str]]:
    store = Store(settings.db_path)
    try:
        admin = store.create_key("ops", admin=True).plaintext
        user = store.create_key("lab-3").plaintext
    finally:
        store.close()
    return {"Authorization": f"Bearer {admin}"}, {"Authorization": f"Bearer {user}"}


async def _appliance(
    aiohttp_client: AiohttpClient, tmp_path: Path, *, managed: bool, speed: float = 1.0
) -> tuple[Client, Agent, dict[str, str], dict[str, str]]:
    agent = Agent(tmp_path / "system", speed)
    settings = make_settings(
        agent.appliance_data,
        network={"agent_dir": str(agent.folder)} if managed else {},
    )
    if managed:
        agent.boot()
    admin, user = _keys(settings)
    client = await aiohttp_client(create_app(settings))
    return client, agent, admin, user


async def _state(client: Client, admin: dict[str, str]) -> Any:
    response = await client.get("/v1/admin/network", headers=admin)
    assert response.status == 200
    return await response.json()


async def _until(client: Client, admin: dict[str, str], outcome: str, bound_s: float) -> Any:
    ends = time.monotonic() + bound_s
    while True:
        state = await _state(client, admin)
        if (state.get("last") or {}).get("outcome") == outcome:
            return state
        assert time.monotonic() < ends, f"no {outcome} in {bound_s} s: {state}"
        await asyncio.sleep(0.05)


async def test_a_change_is_tried_kept_once_confirmed_and_another_rolled_back(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    client, agent, admin, _ = await _appliance(aiohttp_client, tmp_path, managed=True)
    agent.start()
    layout = agent.layout
    try:
        state = await _state(client, admin)
        assert state["managed"] is True
        assert state["applied"]["addresses"] == []  # DHCP, the image's default
        assert state["last"] is None

        asked = await client.put(
            "/v1/admin/network", headers=admin, json={**STATIC, "confirm_within_s": 60}
        )
        assert asked.status == 202, await asked.text()
        change = (await asked.json())["id"]
        trying = await _until(client, admin, "trying", 10)
        assert trying["last"]["id"] == change
        assert trying["last"]["asked_by"].endswith("of ops")
        assert "Address=198.18.7.20/24" in (layout.run / NETWORK_FILE).read_text()

        # While it is on trial: no other change, and only its own id confirms it.
        again = await client.put("/v1/admin/network", headers=admin, json=STATIC)
        assert again.status == 409
        assert (await again.json())["error"]["code"] == ErrorCode.network_trial
        stray = await client.post(
            "/v1/admin/network/confirm", headers=admin, json={"id": "net_0000"}
        )
        assert stray.status == 409
        assert (await stray.json())["error"]["param"] == "id"

        confirmed = await client.post(
            "/v1/admin/network/confirm", headers=admin, json={"id": change}
        )
        assert confirmed.status == 200
        kept = await confirmed.json()
        assert kept["last"]["outcome"] == "applied", kept
        assert kept["applied"]["addresses"] == STATIC["addresses"]
        assert kept["applied"]["dns"] == STATIC["dns"]
    finally:
        agent.stop()


async def test_an_unconfirmed_change_comes_back_to_the_last_working_one(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    # The agent's clock runs 20 times faster: its 10 s bound passes in half a second.
    client, agent, admin, _ = await _appliance(aiohttp_client, tmp_path, managed=True, speed=20.0)
    agent.start()
    layout = agent.layout
    try:
        asked = await client.put(
            "/v1/admin/network",
            headers=admin,
            json={"addresses": ["198.18.9.20/24"], "confirm_within_s": 10},
        )
        assert asked.status == 202
        state = await _until(client, admin, "rolled_back", 30)
        assert "not confirmed within 10 s" in state["last"]["reason"]
        assert state["applied"]["addresses"] == []
        assert not (layout.run / NETWORK_FILE).exists()  # DHCP again
        late = await client.post(
            "/v1/admin/network/confirm", headers=admin, json={"id": state["last"]["id"]}
        )
        assert late.status == 409
    finally:
        agent.stop()


async def test_wrong_settings_and_keys_are_refused_and_off_the_image_nothing_is_managed(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    client, agent, admin, user = await _appliance(aiohttp_client, tmp_path, managed=True)
    layout = agent.layout
    wrong: list[tuple[dict[str, object], str]] = [
        ({"addresses": ["198.18.7.20/24"], "gateways": ["198.18.9.1"]}, "gateways"),
        ({"addresses": ["not an address"]}, "addresses[0]"),
        ({"interfaces": "en*\n[Network]"}, "interfaces"),
        ({"confirm_within_s": 5}, "confirm_within_s"),
        ({"wifi": {"ssid": "x"}}, "wifi"),
        ({"https_proxy": "ftp://p"}, "https_proxy"),
    ]
    for body, param in wrong:
        response = await client.put("/v1/admin/network", headers=admin, json=body)
        assert response.status == 400, body
        error = (await response.json())["error"]
        assert error["param"] == param, error
    for method, path in (("GET", ""), ("PUT", ""), ("POST", "/confirm")):
        response = await client.request(method, f"/v1/admin/network{path}", headers=user, json={})
        assert response.status == 403
    assert not layout.paths.request.exists()  # nothing was asked of the agent
    await client.close()

    off, _, admin, _ = await _appliance(aiohttp_client, tmp_path / "off", managed=False)
    assert await _state(off, admin) == {"object": "network", "managed": False}
    response = await off.put("/v1/admin/network", headers=admin, json=STATIC)
    assert response.status == 409
    assert (await response.json())["error"]["code"] == ErrorCode.network_not_managed
    with contextlib.suppress(FileNotFoundError):
        assert not any((tmp_path / "off" / "system" / "appliance" / "network").iterdir())
