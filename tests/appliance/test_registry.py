"""The model registry: memory planning (pure, property-based), the estimate of a real GGUF
model, then the admin API, loading on demand, LRU unloading, pins and the router with the
scripted models in real workers (the registry is the subject, not the model)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.app import create_app
from appliance.gateway.appkeys import REGISTRY
from appliance.serving.engine import EngineOptions
from appliance.serving.registry import Resident, estimate_mb, plan_eviction
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from shared.errors import ErrorCode
from shared.gguf import REPLICA_OVERHEAD_MIB
from tests.budget import tries
from tests.conftest import SCRIPTED, SLOW, make_settings

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from tests.conftest import Client

MODEL = SCRIPTED

# -- planning --------------------------------------------------------------------------------

residents_st = st.lists(
    st.builds(
        Resident,
        ref=st.text("abcdef", min_size=1, max_size=3),
        memory_mb=st.floats(1, 1000),
        last_used=st.floats(0, 100),
        pinned=st.booleans(),
        busy=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda r: r.ref,
)


@settings(max_examples=tries(300), derandomize=True, deadline=None)
@given(residents_st, st.floats(0, 2000), st.floats(0, 4000))
def test_eviction_frees_enough_least_recently_used_first_and_never_pinned_or_busy(
    residents: list[Resident], need: float, budget: float
) -> None:
    plan = plan_eviction(residents, need, budget)
    by_ref = {r.ref: r for r in residents}
    idle = [r for r in residents if not (r.pinned or r.busy)]

    def kept(gone: list[Resident]) -> float:
        """The memory of what stays, exactly rounded (a total less the ones gone is not)."""
        return math.fsum(r.memory_mb for r in residents if r not in gone)

    if plan is None:
        # Impossible even with every idle model gone.
        assert kept(idle) + need > budget
        return
    chosen = [by_ref[ref] for ref in plan]
    assert all(not (r.pinned or r.busy) for r in chosen)
    assert kept(chosen) + need <= budget
    # Least recently used first, and no more than needed: without the last one chosen,
    # the model would not fit.
    ordered = sorted(idle, key=lambda r: r.last_used)
    assert chosen == ordered[: len(chosen)]
    if chosen:
        assert kept(chosen[:-1]) + need > budget


def test_every_idle_model_gone_fits_a_budget_they_filled_exactly() -> None:
    """The memory that stays is summed afresh: the total less each model unloaded leaves a
    rounding residue (1024.28... - 1024.28... + 0 > 0 once), which refused a plan that
    fits."""
    sizes = [0.1, 0.2, 0.3, 512.7, 511.283546106]
    residents = [
        Resident(str(i), size, float(i), pinned=False, busy=False) for i, size in enumerate(sizes)
    ]
    assert sum(sizes) - sizes[0] - sizes[1] - sizes[2] - sizes[3] - sizes[4] != 0.0
    assert plan_eviction(residents, 0.0, 0.0) == ("0", "1", "2", "3", "4")


def test_the_estimate_counts_weights_kv_cache_and_overhead(default_model: ModelRecord) -> None:
    one = estimate_mb(default_model, EngineOptions(n_ctx=2048, n_slots=1))
    four = estimate_mb(default_model, EngineOptions(n_ctx=2048, n_slots=4))
    weights = default_model.size_bytes / 2**20
    assert one > weights + REPLICA_OVERHEAD_MIB
    # Gemma 3 270M, 18 layers of one KV head of 256 for K and V, f16: 3 full-attention layers
    # (3 KiB a cell) hold every slot's 2048 cells; 15 sliding ones (15 KiB a cell) hold their
    # window of 512 for each sequence (the slots and the prefix store) and a batch of 512.
    full = 3 * 2048 * 3 * 1024
    sliding = (3072 - 1536) * 15 * 1024
    assert four - one == pytest.approx((full + sliding) / 2**20)


# -- the admin API and on-demand loading -----------------------------------------------------


def admin(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def ask(client: Client, key: str, model: str, max_tokens: int = 4) -> tuple[int, Any]:
    body = {"model": model, "prompt": "The sea is", "max_tokens": max_tokens, "temperature": 0}
    response = await client.post("/v1/completions", headers=admin(key), json=body)
    return response.status, await response.json()


async def states(client: Client, key: str) -> dict[str, Any]:
    response = await client.get("/v1/admin/models", headers=admin(key))
    assert response.status == 200, await response.text()
    return {m["ref"]: m for m in (await response.json())["data"] if m["format"] == "script"}


def registry_app(tmp_path: Path, record: ModelRecord, **model: object) -> tuple[Any, str]:
    """An appliance whose store has ``record``, its default model, in three versions (the
    same file)."""
    settings = make_settings(
        tmp_path / "data",
        model={"default": record.name, "chat_default": record.name, "n_slots": 1, **model},
        embeddings={"enabled": False},
        # Loading and routing are under test here, not admission: objectives that a busy
        # CI machine cannot miss (test_admission.py holds the door to its objectives).
        classes={"s1": {"admit_s": 60, "first_token_s": 120}},
    )
    store = Store(settings.db_path)
    try:
        store.add_model(record)
        for version in ("b", "c"):
            store.add_model(replace(record, version=version))
        key = store.create_key("ops", admin=True).plaintext
        user_key = store.create_key("someone").plaintext
    finally:
        store.close()
    return create_app(settings), f"{key} {user_key}"


async def test_models_load_on_demand_within_the_budget_lru_first_and_pins_hold(
    aiohttp_client: AiohttpClient, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    # Room for exactly two replicas of this model: the default (pinned) and one more.
    each = estimate_mb(scripted_model, EngineOptions(n_ctx=2048, n_slots=1))
    app, keys = registry_app(tmp_path, scripted_model, memory_budget_mb=int(2 * each) + 1)
    key, user_key = keys.split()
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    v = scripted_model.version
    b, c = f"{MODEL}@b", f"{MODEL}@c"

    forbidden = await client.get("/v1/admin/models", headers=admin(user_key))
    assert forbidden.status == 403
    assert (await forbidden.json())["error"]["code"] == ErrorCode.permission_denied

    before = await states(client, key)
    assert before[f"{MODEL}@{v}"]["state"] == "ready"
    assert before[f"{MODEL}@{v}"]["pinned"] is True
    assert before[b]["state"] == before[c]["state"] == "unloaded"

    # A request for a registered model that is not loaded loads it and is served.
    status, body = await ask(client, user_key, b)
    assert status == 200, body
    assert body["model"] == b
    # The next one needs room: b is idle and unpinned, so it goes.
    status, body = await ask(client, user_key, c)
    assert status == 200, body
    now = await states(client, key)
    assert (now[b]["state"], now[c]["state"]) == ("unloaded", "ready")
    assert now[c]["replicas"][0]["submitted"] == 1
    assert now[c]["memory_estimate_mib"] == pytest.approx(each, abs=0.1)

    # Pinned, c stays; nothing else can be unloaded, so b does not fit.
    pin = await client.post(
        "/v1/admin/models", headers=admin(key), json={"model": c, "pinned": True}
    )
    assert pin.status == 200
    assert (await pin.json())["pinned"] is True
    status, body = await ask(client, user_key, b)
    assert status == 503
    assert body["error"]["code"] == ErrorCode.insufficient_memory
    assert "pinned" in body["error"]["message"]

    refused = await client.delete(f"/v1/admin/models/{c}", headers=admin(key))
    assert refused.status == 409
    assert (await refused.json())["error"]["code"] == ErrorCode.model_pinned
    await client.post("/v1/admin/models", headers=admin(key), json={"model": c, "pinned": False})
    gone = await client.delete(f"/v1/admin/models/{c}", headers=admin(key))
    assert gone.status == 200
    assert (await gone.json())["state"] == "unloaded"
    assert (await states(client, key))[c]["state"] == "unloaded"

    missing = await client.delete(f"/v1/admin/models/{MODEL}@nope", headers=admin(key))
    assert missing.status == 404
    status, body = await ask(client, user_key, "no-such-model")
    assert status == 404
    assert body["error"]["code"] == ErrorCode.model_not_found


async def test_the_router_spreads_requests_over_replicas(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    # The slow scripted model: each request holds its slot for a second, so all four are
    # routed before the first is done.
    app, keys = registry_app(tmp_path, slow_model)
    key, user_key = keys.split()
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    b = f"{SLOW}@b"
    loaded = await client.post(
        "/v1/admin/models", headers=admin(key), json={"model": b, "replicas": 2}
    )
    assert loaded.status == 200, await loaded.text()
    replicas = (await loaded.json())["replicas"]
    assert len(replicas) == 2
    assert replicas[0]["pid"] != replicas[1]["pid"]

    results = await asyncio.gather(*(ask(client, user_key, b, max_tokens=50) for _ in range(4)))
    assert [status for status, _ in results] == [200] * 4, results
    routed = [r["submitted"] for r in (await states(client, key))[b]["replicas"]]
    # One slot each: four requests at once go two and two, by least outstanding work.
    assert routed == [2, 2]

    bad = await client.post(
        "/v1/admin/models", headers=admin(key), json={"model": b, "replicas": 99}
    )
    assert bad.status == 400
    assert (await bad.json())["error"]["param"] == "replicas"
