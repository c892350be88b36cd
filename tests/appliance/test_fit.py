"""The memory one replica is estimated to need (shared/gguf.py `replica_mib`: what the
appliance's budget counts and the hub's placement plans with) against what the worker of
each embedded model holds resident once it has served, at the node's default context and
slots: within 15 %."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from appliance.app import create_app
from appliance.gateway.appkeys import PRESETS, REGISTRY
from appliance.serving.catalog import CHAT_MODEL_NAME, DEFAULT_MODEL_NAME
from appliance.state.store import Store
from shared.gguf import DEFAULT_N_CTX, DEFAULT_N_SLOTS
from shared.protocol import ModelPreset
from tests.conftest import REAL_MODELS, make_settings

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp.test_utils import TestClient
    from pytest_aiohttp import AiohttpClient

    from appliance.state.records import ModelRecord

pytestmark = pytest.mark.model


async def test_the_estimate_is_within_15_percent_of_a_serving_workers_resident_memory(
    aiohttp_client: AiohttpClient, tmp_path: Path, default_model: ModelRecord
) -> None:
    settings = make_settings(
        tmp_path / "data",
        model={**REAL_MODELS, "n_ctx": DEFAULT_N_CTX, "n_slots": DEFAULT_N_SLOTS},
        embeddings={"enabled": False},
    )
    store = Store(settings.db_path)
    store.add_model(default_model)
    key = store.create_key("fit", admin=True).plaintext
    store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    headers = {"Authorization": f"Bearer {key}"}
    # Each model serves once: its compute buffers are in use, as on a serving node.
    for model in (DEFAULT_MODEL_NAME, CHAT_MODEL_NAME):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        answer = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert answer.status == 200, await answer.text()
    seen = await _memory(client, headers)
    assert set(seen) == {DEFAULT_MODEL_NAME, CHAT_MODEL_NAME}, seen
    for name, (estimate, resident) in seen.items():
        assert abs(estimate - resident) <= 0.15 * resident, (name, estimate, resident)

    # A deployment's preset with a q8_0 KV cache: the chat model loaded again with it holds
    # about half the cache (SmolLM2's is most of its replica), and the estimate follows.
    registry = app[REGISTRY]
    [chat] = [r.ref for r in registry.served() if r.name == CHAT_MODEL_NAME]
    await registry.unload(chat)
    app[PRESETS].set({chat: ModelPreset(kv_type="q8_0")})
    body = {"model": chat, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    answer = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert answer.status == 200, await answer.text()
    estimate, resident = (await _memory(client, headers))[CHAT_MODEL_NAME]
    assert abs(estimate - resident) <= 0.15 * resident, (estimate, resident)
    assert resident < 0.75 * seen[CHAT_MODEL_NAME][1], (resident, seen)


async def _memory(
    client: TestClient[Any, Any], headers: dict[str, str]
) -> dict[str, tuple[float, float]]:
    """name → (estimate, resident) MiB of the embedded models loaded."""
    listed: dict[str, Any] = await (await client.get("/v1/admin/models", headers=headers)).json()
    return {
        e["name"]: (e["memory_estimate_mib"], e["memory_resident_mib"])
        for e in listed["data"]
        if e["name"] in {DEFAULT_MODEL_NAME, CHAT_MODEL_NAME} and e["memory_resident_mib"]
    }
