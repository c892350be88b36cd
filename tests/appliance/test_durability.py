"""kill -9 of a real appliance under load, at 50 random points (12 in `just test-fast`), while it
syncs to a real hub: after every kill the database passes `PRAGMA integrity_check`, and in the
end every request a client saw answered is in the appliance's ledger once and in the hub's
once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
from typing import TYPE_CHECKING

import aiohttp

from appliance.state.records import ModelRecord
from appliance.state.store import Store
from hub.app import create_app as create_hub
from hub.identity import certificates, ssl_context
from hub.state.store import open_store
from tests.budget import tries
from tests.conftest import SCRIPTED, free_port, spawn_appliance, wait_ready
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

KILLS = tries(50)
CLIENTS = 3


async def load(base_url: str, key: str, answered: set[str], stop: asyncio.Event) -> None:
    """Completions in a loop until ``stop``; the id of every response read whole."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": SCRIPTED, "prompt": "Hello", "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                async with session.post(
                    f"{base_url}/v1/completions", json=body, headers=headers
                ) as response:
                    if response.status == 200:
                        answered.add((await response.json())["id"].removeprefix("cmpl-"))
            except (aiohttp.ClientError, json.JSONDecodeError, ConnectionError):
                await asyncio.sleep(0.05)


async def test_every_answered_request_survives_kill_9_exactly_once(
    aiohttp_server: AiohttpServer, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    hub = settings_for(tmp_path)
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    hub_store = open_store(hub)
    token = hub_store.tokens.create("site", uses=1, expires_in_s=3600).plaintext
    hub_store.accounts.put("load", "S1")  # a fleet account: its usage goes to the hub
    hub_store.close()
    provisioning = tmp_path / "kovenlab.json"
    provisioning.write_text(
        json.dumps(
            {
                "hub_url": f"https://127.0.0.1:{hub_server.port}",
                "token": token,
                "hub_fingerprint": certificates(hub)[0].fingerprint,
                "name": "durable",
            }
        )
    )
    data = tmp_path / "appliance"
    store = Store(data / "appliance.db")
    store.add_model(scripted_model)
    key = store.create_key("load").plaintext
    store.close()
    env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_MODEL__DEFAULT": SCRIPTED,
        "KVL_MODEL__N_CTX": "512",
        "KVL_FLEET__PROVISIONING_FILE": str(provisioning),
        "KVL_FLEET__TUNNEL": "false",
        # Plain HTTP on loopback across restarts (the LAN certificate has its own test).
        "KVL_FLEET__LAN_TLS": "false",
        "KVL_FLEET__SYNC_INTERVAL_S": "0.5",
        "KVL_FLEET__HEARTBEAT_S": "1",
    }
    answered: set[str] = set()
    rng = random.Random(7)
    with (data / "serve.log").open("wb") as log:
        for _ in range(KILLS):
            port = free_port()
            process = spawn_appliance(data, port, env, log)
            base_url = f"http://127.0.0.1:{port}"
            try:
                await asyncio.to_thread(wait_ready, base_url, process)
                stop = asyncio.Event()
                clients = [
                    asyncio.create_task(load(base_url, key, answered, stop)) for _ in range(CLIENTS)
                ]
                # The subject: a kill at a random moment of the load, not a condition.
                await asyncio.sleep(rng.uniform(0.05, 1.5))
                os.kill(process.pid, signal.SIGKILL)
                await asyncio.to_thread(process.wait)
                stop.set()
                await asyncio.gather(*clients)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            with contextlib.closing(sqlite3.connect(data / "appliance.db")) as db:
                assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)

        # A last start drains what is left in the outbox.
        port = free_port()
        process = spawn_appliance(data, port, env, log)
        try:
            await asyncio.to_thread(wait_ready, f"http://127.0.0.1:{port}", process)
            for _ in range(300):
                local = Store(data / "appliance.db")
                try:
                    lag = local.outbox_lag()
                finally:
                    local.close()
                if lag == 0:
                    break
                await asyncio.sleep(0.1)
            assert lag == 0
        finally:
            process.terminate()
            await asyncio.to_thread(process.wait)

    assert len(answered) > KILLS  # the load really ran between the kills
    local = Store(data / "appliance.db")
    try:
        mine = [e.id for e in local.usage_events(limit=1_000_000)]
    finally:
        local.close()
    hub_store = open_store(hub)
    try:
        ledger = [r["event_id"] for r in hub_store.db.query("SELECT event_id FROM ledger")]
    finally:
        hub_store.close()
    assert len(mine) == len(set(mine))
    assert len(ledger) == len(set(ledger))
    # Every answered request is recorded once here and once at the hub; the hub holds
    # nothing the appliance did not record (a request cut by the kill may be recorded
    # without its answer reaching the client: it ran, so it counts).
    assert answered <= set(mine)
    assert set(ledger) == set(mine)
