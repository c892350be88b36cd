"""Placement end to end: a real hub and two real appliances on loopback. A deployment
waits for a node; the first node to join gets it (the model registered, loaded, pinned,
reported in its heartbeat); a second node joining moves nothing; when the first node
stays away past the grace period the replica moves to the second; draining that node
takes it off again. And the artifact download on its own: resumed after a cut, refused
when the file is not the one placed."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
from typing import TYPE_CHECKING, Any

import aiohttp
from wireguard_tools import WireguardKey

from appliance.fleet.client import HubClient
from appliance.fleet.placement import Converger
from appliance.gateway.appkeys import REGISTRY
from appliance.serving.evaluation import INSTRUCTIONS
from appliance.serving.presets import Presets
from appliance.serving.registry import ModelNotReadyError
from appliance.state.records import ModelRecord
from appliance.state.store import AsyncStore, Store
from hub.app import create_app as create_hub
from hub.identity import certificates, ssl_context
from hub.settings import HubSettings
from hub.state.store import open_store
from shared import pki, protocol
from tests.appliance.fleet_nodes import join, placement_hub
from tests.conftest import kvl, write_script
from tests.hfhub import tiny_gguf
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp import web
    from aiohttp.test_utils import TestServer
    from pytest_aiohttp import AiohttpServer


async def _join(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    record: ModelRecord,
    hub: HubSettings,
    hub_port: int,
    *,
    name: str,
) -> tuple[web.Application, TestServer]:
    node = await join(aiohttp_server, tmp_path, record, hub, hub_port, name=name,
                      model={"n_ctx": 512, "n_threads": 1, "n_slots": 1},
                      fleet={"sync_interval_s": 1})  # fmt: skip
    return node.app, node.server


def _served(app: web.Application) -> set[str]:
    return {r.ref for r in app[REGISTRY].served()}


def _placed(hub: HubSettings) -> list[str]:
    store = open_store(hub)
    try:
        names = {n.id: n.name for n in store.nodes.all()}
        return sorted(names[n] for _, n, _ in store.deployments.placements())
    finally:
        store.close()


async def test_a_deployment_follows_nodes_that_join_leave_and_drain(
    aiohttp_server: AiohttpServer, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    # Model scripts (placement is the subject, not the model): the nodes serve one of their
    # own; the one placed is another file, which they fetch from the hub.
    hub = placement_hub(tmp_path)
    data = str(hub.data_dir)
    placed = write_script(tmp_path / "placed.json", reply="Placed by the hub.")
    kvl("hub", "models", "add", str(placed), "--name", "placed", "--version", "1",
        "--data-dir", data)  # fmt: skip
    deployment = kvl("hub", "deploy", "placed@1", "--replicas", "1", "--data-dir", data)
    deployment_id = deployment.stdout.strip()
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    await asyncio.sleep(0.5)
    assert _placed(hub) == []  # no node yet: it waits

    a, a_server = await _join(aiohttp_server, tmp_path, scripted_model, hub, hub_server.port,
                              name="node-a")  # fmt: skip
    await until(lambda: "placed@1" in _served(a), "the replica on the first node", timeout_s=60)
    assert _placed(hub) == ["node-a"]

    b, _ = await _join(aiohttp_server, tmp_path, scripted_model, hub, hub_server.port,
                       name="node-b")  # fmt: skip
    await asyncio.sleep(2)
    assert _placed(hub) == ["node-a"]  # a node joining moves nothing
    assert "placed@1" not in _served(b)

    await a_server.close()  # node A goes away: past the grace period its replica moves
    await until(lambda: "placed@1" in _served(b), "the replica on the second node", timeout_s=60)
    assert _placed(hub) == ["node-b"]
    listed = kvl("hub", "deployments", "--data-dir", data).stdout
    assert f"{deployment_id}" in listed
    assert "1/1  node-b" in listed

    kvl("hub", "nodes", "drain", "node-b", "--data-dir", data)  # nowhere else to go
    await until(
        lambda: "placed@1" not in _served(b), "the replica off the drained node", timeout_s=60
    )
    assert _placed(hub) == []
    assert scripted_model.ref in _served(b)  # its own default model stays


async def test_a_deployment_s_preset_is_how_its_node_loads_and_serves_the_model(
    aiohttp_server: AiohttpServer, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    # The placed script answers a prompt that holds the preset's system prompt otherwise,
    # and its replies hold the preset's stop string.
    hub = placement_hub(tmp_path)
    data = str(hub.data_dir)
    placed = write_script(
        tmp_path / "placed.json",
        reply="Plain. END and more",
        rules=[{"contains": "You are a terse pirate.", "reply": "Arr. END matey"}],
    )
    kvl("hub", "models", "add", str(placed), "--name", "placed", "--version", "1",
        "--data-dir", data)  # fmt: skip
    deployed = kvl("hub", "deploy", "placed@1", "--context", "1024", "--slots", "3",
                   "--alias", "gpt-4o-mini", "--system-prompt", "You are a terse pirate.",
                   "--stop", "END", "--temperature", "0.2", "--data-dir", data)  # fmt: skip
    assert "MiB a replica" in deployed.stderr
    listed = json.loads(kvl("hub", "deployments", "--json", "--data-dir", data).stdout)
    assert listed["preset"] == {"n_ctx": 1024, "n_slots": 3, "temperature": 0.2,
                                "system_prompt": "You are a terse pirate.", "stop": ["END"],
                                "aliases": ["gpt-4o-mini"]}  # fmt: skip
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    own = {"n_ctx": 512, "n_threads": 1, "n_slots": 1}  # the node's settings
    node = await join(aiohttp_server, tmp_path, scripted_model, hub, hub_server.port,
                      name="node-a", model=own)  # fmt: skip
    await until(lambda: "placed@1" in _served(node.app), "the replica on the node", timeout_s=60)
    [loaded] = [d for d in node.app[REGISTRY].loaded_models() if d.record.ref == "placed@1"]
    assert (loaded.options.n_ctx, loaded.options.n_slots) == (1024, 3)  # not the node's own
    assert loaded.preset is not None
    assert loaded.preset.temperature == 0.2

    headers = {"Authorization": f"Bearer {node.key}"}
    async with aiohttp.ClientSession(node.base_url, headers=headers) as http:

        async def chat(model: str, messages: list[dict[str, str]]) -> str:
            async with http.post(
                "/v1/chat/completions", json={"model": model, "messages": messages}
            ) as response:
                body = await response.json()
                assert response.status == 200, body
                return str(body["choices"][0]["message"]["content"])

        question = [{"role": "user", "content": "Hello?"}]
        # The alias names the placed model; its system prompt goes first; its stop ends it.
        assert await chat("gpt-4o-mini", question) == "Arr. "
        # A chat with a system message of its own keeps it.
        plain = [{"role": "system", "content": "Be plain."}, *question]
        assert await chat("placed", plain) == "Plain. "
        async with http.get("/v1/models") as response:
            models = {m["id"]: m for m in (await response.json())["data"]}
        assert "gpt-4o-mini" in models["placed"]["aliases"]
        # The node evaluated the placed model (with its preset: every reply is the
        # pirate's, cut at the stop string, so it follows none of the instructions) and
        # told the hub, with its load time and memory.
        await until(lambda: _evaluation(hub) is not None, "the evaluation at the hub")
        score = _evaluation(hub)
        assert score is not None
        assert (score.followed, score.total) == (0, len(INSTRUCTIONS))
        assert score.load_s > 0
        assert score.memory_mib > 0
        # The node's own model does not take the placed model's preset.
        async with http.post(
            "/v1/chat/completions", json={"model": scripted_model.name, "messages": question}
        ) as r:
            assert r.status == 200
            assert "Arr" not in (await r.json())["choices"][0]["message"]["content"]


def _evaluation(hub: HubSettings) -> protocol.Evaluation | None:
    store = open_store(hub)
    try:
        [node] = store.nodes.all()
        return node.capacity.evaluations.get("placed@1")
    finally:
        store.close()


def _forget_models(store: Store) -> None:
    with store.db.conn:
        store.db.execute("DELETE FROM models")


class _NoLoads:
    """The converger's registry: here only the download is under test."""

    presets = Presets()

    def served(self) -> list[Any]:
        return []

    def loaded_models(self) -> list[Any]:
        return []

    async def load(self, model: str, *, replicas: int | None, pinned: bool | None) -> None:
        raise ModelNotReadyError(f"{model} is not a model")

    async def release(self, model: str) -> None:
        raise ModelNotReadyError(model)


async def test_a_placed_artifact_is_fetched_resumed_and_checked(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    # Placed within 0.3 s, and given up only after the hub's default grace: one heartbeat
    # keeps the node placeable for the whole test however busy the machine is (at
    # placement_hub's 4 s, a loaded run lost the placement before the last fetch).
    hub = settings_for(tmp_path, fleet={"placement_every_s": 0.3})
    blob = tiny_gguf("placed", 3 * 2**20 + 123)  # a GGUF header the hub reads, then bytes
    source = tmp_path / "weights.bin"
    source.write_bytes(blob)
    data = str(hub.data_dir)
    kvl("hub", "models", "add", str(source), "--name", "tiny", "--version", "1", "--data-dir", data)
    kvl("hub", "deploy", "tiny@1", "--data-dir", data)
    store = open_store(hub)
    token = store.tokens.create("s", uses=1, expires_in_s=60).plaintext
    node = store.nodes.enroll(token, name="n",
                              wg_public_key=str(WireguardKey.generate().public_key()),
                              overlay_prefix="100.64.0.0/10", labels={}, versions={})  # fmt: skip
    store.close()
    server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    client = HubClient(f"https://127.0.0.1:{server.port}", pin, node.node_token)
    # The node's heartbeat makes it placeable (memory from its model budget).
    await client.heartbeat({}, protocol.Capacity(model_memory_mib=10_000))
    await until(lambda: bool(_placed(hub)), "the placement", timeout_s=60)
    # The site's update window reaches its nodes with the desired state (protocol 9).
    kvl("hub", "releases", "window", "s", "--from", "02:00", "--to", "05:00", "--data-dir", data)
    state = await client.state(-1)
    assert state is not None
    assert state.window == protocol.UpdateWindow(start_min=120, end_min=300)
    [placed] = state.models
    sha256 = hashlib.sha256(blob).hexdigest()
    assert (placed.name, placed.sha256) == ("tiny", sha256)

    local = AsyncStore(tmp_path / "node" / "appliance.db")
    await local.open()
    models = tmp_path / "node" / "models"
    noon = datetime.datetime(2026, 12, 7, 12, 0, tzinfo=datetime.UTC).timestamp()
    try:
        await local.run(local.sync.apply_desired_state, state)
        # A download cut after its first megabyte resumes from there (HTTP Range).
        models.mkdir(parents=True)
        partial = models / f"tiny-1-{sha256[:12]}.gguf.part"
        partial.write_bytes(blob[: 2**20])
        # Outside the window the model file waits, saying why; nothing is fetched.
        waiting = Converger(local, _NoLoads(), models, clock=lambda: noon)  # type: ignore[arg-type]
        await waiting.converge(client)
        assert "update window (02:00 to 05:00 UTC)" in waiting.errors["tiny@1"]
        assert partial.read_bytes() == blob[: 2**20]
        assert await local.run(local.sync.get_model, "tiny", "1") is None
        # Within it (03:00 UTC), fetched.
        at_three = noon - 9 * 3600
        converger = Converger(local, _NoLoads(), models, clock=lambda: at_three)  # type: ignore[arg-type]
        await converger.converge(client)
        record = await local.run(local.sync.get_model, "tiny", "1")
        assert record is not None
        assert record.sha256 == sha256
        assert (models / f"tiny-1-{sha256[:12]}.gguf").read_bytes() == blob
        assert not partial.exists()
        assert "is not a model" in converger.errors["tiny@1"]  # loading is the registry's

        # The hub's copy is damaged: the node refuses it and registers nothing.
        kvl("hub", "models", "add", str(source), "--name", "tiny", "--version", "2",
            "--data-dir", data)  # fmt: skip
        (hub.artifacts_dir / sha256).write_bytes(blob[:-1] + b"\0")
        await local.run(local.sync.apply_desired_state, state.model_copy(update={
            "serial": state.serial + 1,
            "models": [placed.model_copy(update={"version": "2", "sha256": sha256})],
        }))  # fmt: skip
        (models / f"tiny-1-{sha256[:12]}.gguf").unlink()
        await local.run(_forget_models, local.sync)
        await converger.converge(client)
        assert "not" in converger.errors["tiny@2"]
        assert await local.run(local.sync.get_model, "tiny", "2") is None
        assert not list(models.glob("tiny-2-*"))
    finally:
        await client.close()
        await local.close()
