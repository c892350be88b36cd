"""A model brought to a fleet end to end: a hub and an appliance, each in its own network
namespace, the appliance enrolled and talking to the hub only through a real wireguard-go
tunnel. The operator pulls a GGUF from a Hugging Face repository (a local stand-in for the
public Hub, which these machines cannot reach: tests/hfhub.py, named by `HF_ENDPOINT` as
huggingface_hub reads it), which the hub inspects and sizes; deploys it with a preset (its
own context and slots, and an alias); the node fetches it through the tunnel, loads it with
that preset, evaluates it and reports the score; and a LAN client with the official `openai`
package reaches it by its alias."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from appliance.serving.catalog import CHAT_MODEL_NAME, EMBEDDED
from appliance.serving.evaluation import INSTRUCTIONS
from appliance.state.store import Store
from hub.identity import certificates
from hub.settings import HubSettings
from hub.state.nodes import Node
from hub.state.store import open_store
from shared import protocol
from tests.conftest import SCRIPTED, kvl
from tests.hfhub import Repo, StandIn
from tests.netns import A_ADDR, Link, linked_namespaces, spawn, stop
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from appliance.state.records import ModelRecord

pytestmark = [pytest.mark.netns, pytest.mark.model]

REPOSITORY = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"  # the embedded chat model's bytes
PULLED = "smollm2-135m-instruct@q4_1"  # the name and version the pull gives it

# A LAN client in the node's namespace: the official SDK, by the alias.
CLIENT = """
import json, sys, openai
client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key=sys.argv[1])
answer = client.chat.completions.create(
    model="gpt-4o-mini", max_tokens=8, temperature=0,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
)
listed = {m.id: m.model_extra for m in client.models.list().data}
print(json.dumps({"content": answer.choices[0].message.content, "models": listed}))
"""


@pytest.fixture
def link() -> Iterator[Link]:
    with linked_namespaces() as made:
        yield made


def _node(hub: HubSettings) -> Node | None:
    store = open_store(hub)
    try:
        nodes = store.nodes.all()
        return nodes[0] if nodes and nodes[0].capacity.models else None
    finally:
        store.close()


def _evaluation(hub: HubSettings) -> protocol.Evaluation | None:
    node = _node(hub)
    return None if node is None else node.capacity.evaluations.get(PULLED)


async def test_a_pulled_model_is_deployed_with_a_preset_and_answers_by_its_alias(
    link: Link, tmp_path: Path, scripted_model: ModelRecord, aiohttp_server: AiohttpServer
) -> None:
    smol = EMBEDDED[CHAT_MODEL_NAME].sources()[0].read_bytes()
    stand_in = await StandIn({REPOSITORY: Repo({FILE: smol})}, tmp_path / "stand-in").start(
        aiohttp_server
    )
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node"
    hub = HubSettings.model_validate({
        "data_dir": hub_dir, "server": {"names": [A_ADDR]},
        "overlay": {"endpoint": f"{A_ADDR}:51820", "interface": f"kvh{link.suffix}"},
        "fleet": {"placement_every_s": 0.5},
    })  # fmt: skip
    fingerprint = certificates(hub)[0].fingerprint
    hub_store = open_store(hub)
    token = hub_store.tokens.create("school", uses=1, expires_in_s=600).plaintext
    hub_store.accounts.put("lan", "S1")
    hub_store.close()
    provisioning = tmp_path / "kovenlab.json"
    provisioning.write_text(json.dumps({
        "hub_url": f"https://{A_ADDR}:8443", "token": token, "hub_fingerprint": fingerprint,
        "name": "lab-server",
    }))  # fmt: skip
    store = Store(node_dir / "appliance.db")
    store.add_model(scripted_model)  # the node's own model: the placed one is the subject
    lan_key = store.create_key("lan").plaintext
    store.close()
    hub_env = {
        "KVL_HUB_SERVER__NAMES": json.dumps([A_ADDR]),
        "KVL_HUB_OVERLAY__ENDPOINT": f"{A_ADDR}:51820",
        "KVL_HUB_OVERLAY__INTERFACE": f"kvh{link.suffix}",
        "KVL_HUB_FLEET__PLACEMENT_EVERY_S": "0.5",
    }
    node_env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_MODEL__DEFAULT": SCRIPTED,
        "KVL_MODEL__CHAT_DEFAULT": SCRIPTED,
        "KVL_MODEL__N_CTX": "512",  # the node's own; the preset gives the placed model more
        "KVL_MODEL__N_SLOTS": "1",
        "KVL_MODEL__N_THREADS": "1",
        "KVL_FLEET__PROVISIONING_FILE": str(provisioning),
        "KVL_FLEET__INTERFACE": f"kvn{link.suffix}",
        "KVL_FLEET__HEARTBEAT_S": "1",
    }
    serve_hub = ["hub", "serve", "--data-dir", str(hub_dir), "--host", A_ADDR]
    hub_process = spawn(link, link.a, serve_hub, hub_env, tmp_path / "hub.log")
    serve_node = ["appliance", "serve", "--data-dir", str(node_dir), "--host", "127.0.0.1",
                  "--port", "8080"]  # fmt: skip
    node_process = spawn(link, link.b, serve_node, node_env, tmp_path / "node.log")
    try:
        # Heartbeats reach the hub only from the node's overlay address: through the tunnel.
        await until(lambda: _node(hub), "the node heartbeating through the tunnel", 120)

        # Pulled on the hub's data directory while it serves (the stand-in by HF_ENDPOINT):
        # the file picked by its quantisation, inspected, a replica sized.
        pulled = await asyncio.to_thread(
            kvl, "hub", "models", "pull", f"hf://{REPOSITORY}:Q4_1", "--data-dir", str(hub_dir),
            env={"HF_ENDPOINT": stand_in.hub_url},
        )  # fmt: skip
        assert f"model {PULLED}: hf://{REPOSITORY}@" in pulled.stdout, pulled.stdout
        assert "llama 135M Q4_1" in pulled.stdout, pulled.stdout
        assert "MiB a replica" in pulled.stdout, pulled.stdout
        deployed = await asyncio.to_thread(
            kvl, "hub", "deploy", PULLED, "--context", "1024", "--slots", "2",
            "--alias", "gpt-4o-mini", "--data-dir", str(hub_dir),
        )  # fmt: skip
        assert "MiB a replica" in deployed.stderr, deployed.stderr

        # Fetched through the tunnel, loaded with the preset, evaluated, reported.
        score = await until(lambda: _evaluation(hub), "the placed model's evaluation", 300)
        assert score.total == len(INSTRUCTIONS)
        assert score.load_s > 0
        assert score.memory_mib > 0
        node = _node(hub)
        assert node is not None
        assert PULLED in node.capacity.models
        assert not node.capacity.placement_errors

        # A LAN client reaches it by its alias with the official SDK.
        client = await asyncio.to_thread(
            subprocess.run,
            link.argv(link.b, sys.executable, "-c", CLIENT, lan_key),
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr
        seen = json.loads(client.stdout)
        assert seen["content"], seen
        placed = seen["models"][PULLED.split("@", maxsplit=1)[0]]
        assert (placed["context_length"], placed["slots"]) == (1024, 2), placed
        assert "gpt-4o-mini" in placed["aliases"], placed
    finally:
        stop(node_process)
        stop(hub_process)
