"""The door on the real model (the embedded default, one llama.cpp thread): objectives that
scale with the prompt, calibrated from the model's own speed measured at its load. An idle
node serves a prompt near its context under the default objectives; a prompt no wait could
bring within its class is refused for good (400, no Retry-After), with the figures; and a
host whose cores are busy with other work, while the model's slots are free, still admits."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from appliance.app import create_app
from appliance.gateway.appkeys import ADMISSION, REGISTRY, SETTINGS
from appliance.state.store import Store
from shared.classes import ServiceClass
from shared.errors import ErrorCode
from tests.conftest import REAL_MODELS, make_settings

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from appliance.state.records import ModelRecord
    from tests.conftest import Client

pytestmark = pytest.mark.model

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank. "
# The node's own defaults for S1 (make_settings gives the real model a patient S1).
S1 = {"admit_s": 5, "first_token_s": 10, "complete_s": 120}
# S2 with no allowance per prompt token and a short base: a long prompt cannot meet it.
S2 = {"admit_s": 0.1, "first_token_s": 0.3, "complete_s": 60, "first_token_per_token_s": 0}
# S3 with a base of a second and the model's own allowance.
S3 = {"admit_s": 1, "first_token_s": 1, "complete_s": 60}


async def _appliance(
    aiohttp_client: AiohttpClient, tmp_path: Path, model: ModelRecord
) -> tuple[Any, Client, dict[ServiceClass, str]]:
    settings = make_settings(
        tmp_path / "data",
        model={**REAL_MODELS, "n_slots": 2, "n_ctx": 2048},
        embeddings={"enabled": False},
        classes={"s1": S1, "s2": S2, "s3": S3},
    )
    store = Store(settings.db_path)
    try:
        store.add_model(model)
        keys = {c: store.create_key(f"account-{c.value}", c).plaintext for c in ServiceClass}
    finally:
        store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    return app, client, keys


async def _complete(client: Client, key: str, prompt: str) -> tuple[int, dict[str, Any], Any]:
    response = await client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0},
    )
    return response.status, dict(response.headers), await response.json()


async def test_an_idle_node_serves_a_long_prompt_and_refuses_for_good_what_no_wait_fits(
    aiohttp_client: AiohttpClient, tmp_path: Path, default_model: ModelRecord
) -> None:
    app, client, keys = await _appliance(aiohttp_client, tmp_path, default_model)
    (loaded,) = [d for d in app[REGISTRY].loaded_models() if d.record.ref == default_model.ref]
    idle = loaded.calibration
    assert idle is not None  # measured at load
    assert idle.prefill_tok_s > 0
    assert idle.token_s > 0

    # Near the context (2048): S1's first token is allowed 10 s and the model's own time for
    # each prompt token, which an idle node meets.
    prompt = SENTENCE * 140
    status, _, body = await _complete(client, keys[ServiceClass.S1], prompt)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 1800
    # Its decode calls came back timed (twice a second): the model's speed now, against
    # the idle speed (a factor of that speed, whatever this host does meanwhile).
    for _ in range(300):  # the next report is at most half a second away
        if loaded.slowdown != 1.0:
            break
        await asyncio.sleep(0.1)
    assert loaded.slowdown != 1.0
    assert loaded.slowdown > 0

    # S2 allows 0.3 s and nothing per token: no wait would bring this prompt within it.
    status, headers, body = await _complete(client, keys[ServiceClass.S2], prompt)
    assert status == 400, body
    assert "Retry-After" not in headers
    error = body["error"]
    assert error["code"] == ErrorCode.prompt_too_long_for_class
    message = error["message"]
    found = re.search(r"class S2 takes at most (\d+) on this node", message)
    assert found is not None, message
    most = int(found.group(1))
    assert most < body_tokens(app, default_model.ref, prompt)
    # The admin API shows the same figures: the speed measured, what each class admits.
    admin = await _admin_key(app)
    listed = await (await client.get("/v1/admin/models", headers=admin)).json()
    (entry,) = [m for m in listed["data"] if m["ref"] == default_model.ref]
    door = entry["door"]
    assert door["idle_speed"]["measured"] is True
    assert door["objectives"]["S2"]["largest_prompt"] == most
    assert door["objectives"]["S2"]["first_token_per_prompt_token_s"] == 0
    assert door["objectives"]["S1"]["first_token_per_prompt_token_s"] > 0
    assert "tokens/s idle" in message
    assert "S0" in message  # the class that would take it
    # A prompt within what S2 takes is served.
    status, _, body = await _complete(client, keys[ServiceClass.S2], "Hello")
    assert status == 200, body


async def _admin_key(app: Any) -> dict[str, str]:
    store = Store(app[SETTINGS].db_path)
    try:
        key = store.create_key("operator", ServiceClass.S1, admin=True).plaintext
    finally:
        store.close()
    return {"Authorization": f"Bearer {key}"}


def body_tokens(app: Any, ref: str, prompt: str) -> int:
    (loaded,) = [d for d in app[REGISTRY].loaded_models() if d.record.ref == ref]
    return len(loaded.require_vocab().tokenize(prompt, chat=False))


@pytest.fixture
def busy_host() -> Iterator[None]:
    """Two processes that burn a core each, as other work on the host would."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


async def test_a_busy_host_with_free_slots_admits_and_measures(
    aiohttp_client: AiohttpClient, tmp_path: Path, default_model: ModelRecord, busy_host: None
) -> None:
    """With the cores busy, the model runs slower than the objectives' base allows for, but
    its slots are free: each request is admitted and served (and measured), not refused
    with every slot free."""
    app, client, keys = await _appliance(aiohttp_client, tmp_path, default_model)
    for n in range(3):
        prompt = f"Note {n}. " + SENTENCE * 30
        status, _, body = await _complete(client, keys[ServiceClass.S3], prompt)
        assert status == 200, body
    series = {(s.service_class, s.account): s for s in app[ADMISSION].book.snapshot()}
    s3 = series[("S3", "account-S3")]
    assert (s3.requests, s3.admitted) == (3, 3)
