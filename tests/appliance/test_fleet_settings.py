"""Node settings from the hub: a real hub and a real appliance on loopback (the subject is
the settings, not the tunnel or the model: model scripts). A fleet-wide chat default staged
through a rollout reaches the node (which serves chats without `model` on it), and aborted,
goes back; done, it is the fleet's; a site's value wins over the fleet's, a node's over its
site's, and `kvl hub settings` shows where each came from."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import aiohttp

from appliance.gateway.appkeys import ADMISSION, NAMES
from appliance.gateway.packages import PACKAGES
from appliance.serving.catalog import register_file
from appliance.state.store import Store
from hub.app import create_app as create_hub
from hub.identity import ssl_context
from shared.classes import ServiceClass
from tests.appliance.fleet_nodes import FleetNode, join
from tests.conftest import kvl, write_script
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from appliance.state.records import ModelRecord
    from hub.settings import HubSettings


async def _chat(node: FleetNode) -> str:
    """A chat without `model`: the reply of the node's chat default."""
    headers = {"Authorization": f"Bearer {node.key}"}
    body = {"messages": [{"role": "user", "content": "Hello?"}]}
    async with (
        aiohttp.ClientSession(node.base_url, headers=headers) as http,
        http.post("/v1/chat/completions", json=body) as response,
    ):
        answer: dict[str, Any] = await response.json()
        assert response.status == 200, answer
        return str(answer["choices"][0]["message"]["content"])


async def _hub_cli(hub: HubSettings, *args: str) -> str:
    done = await asyncio.to_thread(kvl, "hub", *args, "--data-dir", str(hub.data_dir))
    return done.stdout


async def _rollout_state(hub: HubSettings, rollout_id: str) -> str:
    shown = json.loads(await _hub_cli(hub, "rollouts", "show", rollout_id, "--json"))
    return str(shown["state"])


async def test_a_fleet_wide_chat_default_is_rolled_out_rolled_back_and_made_the_fleets(
    aiohttp_server: AiohttpServer, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    hub = settings_for(tmp_path, fleet={"placement_every_s": 0.3, "rollout_every_s": 0.2})
    catalog = Store(tmp_path / "pirate.db")
    try:
        pirate = register_file(
            catalog, write_script(tmp_path / "pirate.json", reply="Arr.", rules=[]), "pirate", "1"
        )
    finally:
        catalog.close()
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    node = await join(aiohttp_server, tmp_path, scripted_model, hub, hub_server.port,
                      name="node-a", model={"n_ctx": 512, "n_threads": 1, "n_slots": 1},
                      others=[pirate])  # fmt: skip
    own = await _chat(node)
    assert own == "Hello from the scripted model."  # its own chat default
    applied = node.app[NAMES].hub.digest()

    # Staged: the canary (the only node) gets it, applies it, reports it; the soak holds
    # the rollout running.
    started = await _hub_cli(hub, "rollouts", "start", "--setting", "chat_default=pirate",
                             "--soak", "1h", "--no-burn-gate")  # fmt: skip
    rollout = started.split()[1]
    assert "chat_default=pirate at fleet" in started, started
    await until(lambda: node.app[NAMES].hub.chat_default == "pirate", "the setting applied")
    assert await _chat(node) == "Arr."
    shown = json.loads(await _hub_cli(hub, "settings", "show", "--node", "node-a", "--json"))
    assert shown["values"] == {"chat_default": {"value": "pirate", "from": "fleet (rollout)"}}
    await until(lambda: _applied(hub, "node-a"), "the node reporting it applied them")
    assert await _hub_cli(hub, "settings", "show") == ""  # nothing is the fleet's yet

    # Aborted: the node goes back to its own, reports so, and the rollout ends.
    await _hub_cli(hub, "rollouts", "abort", rollout)
    await until(lambda: node.app[NAMES].hub.chat_default is None, "the setting taken back")
    assert await _chat(node) == own
    await until(lambda: _in_state(hub, rollout, "aborted"), "the rollout aborted")
    assert node.app[NAMES].hub.digest() == applied

    # Rolled out to the end: the fleet's value from then on.
    done = await _hub_cli(hub, "rollouts", "start", "--setting", "chat_default=pirate",
                          "--soak", "0", "--no-burn-gate")  # fmt: skip
    await until(lambda: _in_state(hub, done.split()[1], "done"), "the rollout done")
    assert "fleet" in await _hub_cli(hub, "settings", "show")
    assert await _chat(node) == "Arr."

    # The most specific scope wins: the site's over the fleet's, the node's over the site's.
    await _hub_cli(hub, "settings", "set", "chat_default", scripted_model.name, "--site", "site")
    await until(lambda: node.app[NAMES].hub.chat_default == scripted_model.name, "the site's")
    assert await _chat(node) == own
    diff = await _hub_cli(hub, "settings", "diff", "node-a")
    assert diff.strip() == f"chat_default: pirate -> {scripted_model.name} (site:site)", diff
    await _hub_cli(hub, "settings", "set", "chat_default", "pirate", "--node", "node-a")
    await until(lambda: node.app[NAMES].hub.chat_default == "pirate", "the node's own value")
    shown = json.loads(await _hub_cli(hub, "settings", "show", "--node", "node-a", "--json"))
    assert shown["values"]["chat_default"]["from"].startswith("node:")
    # A service class's objective: admission holds S1's first token to it, and the live
    # objectives count against it (what the heartbeat sends the hub).
    await _hub_cli(hub, "settings", "set", "objectives.S1.first_token_s", "42", "--site", "site")
    admission = node.app[ADMISSION]
    await until(
        lambda: admission.class_settings(ServiceClass.S1).first_token_s == 42.0, "S1's objective"
    )
    assert admission.book.objectives["S1"].first_token_s == 42.0
    assert admission.class_settings(ServiceClass.S1).admit_s == 5.0  # the node's own stays
    assert admission.book.objectives_s()["S1"]["first_token"] == 42.0
    # And its allowance per prompt token (protocol 8): the node's own is its model's speed.
    await _hub_cli(hub, "settings", "set", "objectives.S1.first_token_per_token_s", "0.002")
    await until(
        lambda: admission.class_settings(ServiceClass.S1).first_token_per_token_s == 0.002,
        "S1's allowance per prompt token",
    )
    assert admission.allowances(ServiceClass.S1, scripted_model.ref)[0] == 0.002
    assert admission.targets(ServiceClass.S1, scripted_model.ref, 1000).first_token_s == 44.0
    # The content packages' settings: the model that writes them, the one that checks them,
    # its attempts, the cache's cap; unset, the node's own again.
    packages = node.app[PACKAGES]
    own_attempts, own_cap = packages.settings.max_attempts, packages.cache.max_bytes
    hub_set = (("packages.model", "pirate"), ("packages.max_attempts", "7"),
               ("packages.cache_max_mb", "64"), ("packages.check_model", "parrot"))  # fmt: skip
    for key, value in hub_set:
        await _hub_cli(hub, "settings", "set", key, value)

    def packages_now() -> tuple[str, int, int, str | None]:
        return (packages.model, packages.settings.max_attempts, packages.cache.max_bytes,
                packages.settings.check_model)  # fmt: skip

    # Each `set` is a desired state of its own: the node may apply them one at a time.
    await until(
        lambda: packages_now() == ("pirate", 7, 64 << 20, "parrot"), "the packages' settings"
    )
    assert packages.settings.item_max_tokens == 320  # the node's own stays
    for key, _ in hub_set:
        await _hub_cli(hub, "settings", "unset", key)
    own_packages = (scripted_model.name, own_attempts, own_cap, None)
    await until(lambda: packages_now() == own_packages, "the node's own again")

    # A key or a value the hub does not set is refused, naming it; nothing changes.
    refused = await asyncio.to_thread(
        kvl, "hub", "settings", "set", "model.n_ctx", "9", "--data-dir", str(hub.data_dir),
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "not a node setting the hub sets" in refused.stderr, refused.stderr
    refused = await asyncio.to_thread(
        kvl, "hub", "settings", "set", "packages.max_attempts", "99", "--data-dir",
        str(hub.data_dir), check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "not a value of packages.max_attempts" in refused.stderr, refused.stderr


async def _in_state(hub: HubSettings, rollout_id: str, state: str) -> bool:
    return await _rollout_state(hub, rollout_id) == state


async def _applied(hub: HubSettings, name: str) -> bool:
    shown = json.loads(await _hub_cli(hub, "settings", "show", "--node", name, "--json"))
    return bool(shown["applied"])
