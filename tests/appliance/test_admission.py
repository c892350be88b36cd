"""Admission control with a model that takes its time (the slow scripted one: 20 ms a
step, through the real scheduler): early refusals under a burst, the queue shed at
the first-token objective, S2 preempting S0, quotas, and the authentication throttle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from appliance.app import create_app
from appliance.gateway.appkeys import ADMISSION, REGISTRY
from appliance.inference import admission as admission_module
from appliance.inference import completions
from appliance.serving.catalog import register_file
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from shared.classes import ServiceClass
from shared.errors import ErrorCode, Overloaded
from tests.conftest import SLOW, SLOW_SCRIPT, make_settings, write_script

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from tests.conftest import Client

MODEL = SLOW


async def appliance(
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    slow_model: ModelRecord,
    classes: dict[str, object],
    n_slots: int = 2,
) -> tuple[Client, dict[ServiceClass, str]]:
    settings = make_settings(
        tmp_path / "data",
        model={"default": SLOW, "n_slots": n_slots},
        embeddings={"enabled": False},
        classes=classes,
    )
    store = Store(settings.db_path)
    try:
        store.add_model(slow_model)
        keys = {c: store.create_key(f"account-{c.value}", c).plaintext for c in ServiceClass}
    finally:
        store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    return client, keys


async def streamed(
    client: Client, key: str, prompt: str, max_tokens: int, text: asyncio.Event | None = None
) -> tuple[int, float | None, Any, dict[str, str]]:
    """(status, seconds to the first text chunk, the last JSON seen, headers); ``text`` is
    set when the first text chunk arrives."""
    started = time.monotonic()
    response = await client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        },
    )
    if response.status != 200:
        return response.status, None, await response.json(), dict(response.headers)
    first: float | None = None
    last: Any = None
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        last = json.loads(line[6:])
        if first is None and any(c.get("text") for c in last.get("choices", [])):
            first = time.monotonic() - started
            if text is not None:
                text.set()
    return 200, first, last, dict(response.headers)


async def test_a_burst_beyond_capacity_is_refused_at_once_and_the_rest_meet_the_objective(
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    slow_model: ModelRecord,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenized = 0
    tokenize = completions._tokenize

    async def counted(*args: Any, **kwargs: Any) -> list[int]:
        nonlocal tokenized
        tokenized += 1
        return await tokenize(*args, **kwargs)

    monkeypatch.setattr(completions, "_tokenize", counted)
    first_token_s = 4.0
    client, keys = await appliance(
        aiohttp_client,
        tmp_path,
        slow_model,
        {"s1": {"admit_s": 2.0, "first_token_s": first_token_s}},
    )
    results = await asyncio.gather(
        *(
            streamed(client, keys[ServiceClass.S1], f"Story {i}: once upon a time", 48)
            for i in range(24)
        )
    )
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(served) + len(refused) == 24, [r[0] for r in results]
    assert len(served) >= 2  # the two slots at least
    assert len(refused) >= 8  # two slots cannot serve 24 within 4 s
    # Once the queue is full, a refusal comes before the prompt is even tokenized.
    assert tokenized < len(results)
    for _, _, body, headers in refused:
        assert body["error"]["code"] == ErrorCode.overloaded
        assert "S1" in body["error"]["message"]
        assert 1 <= int(headers["Retry-After"]) <= 60
    # Everything admitted saw its first token within the class's objective (a request the
    # prediction let in that then waited too long would have been shed, not served late).
    for _, ttft, last, _ in served:
        assert ttft is not None
        assert ttft <= first_token_s + 0.5
        assert last["usage"]["completion_tokens"] > 0
    text = await (await client.get("/metrics")).text()
    refusals = re.search(
        r'kvl_admission_decisions_total\{class="S1",decision="(?:admit|first_token)"\} (\S+)', text
    )
    assert refusals is not None
    assert float(refusals.group(1)) >= 1
    # The live objectives saw the same: each request once, by how it ended.
    outcomes = {
        m[1]: float(m[2])
        for m in re.finditer(
            r'^kvl_requests_by_outcome_total\{class="S1",outcome="(\w+)"\} (\S+)$', text, re.M
        )
    }
    assert outcomes["admitted"] == len(served)
    assert outcomes["admit"] + outcomes["first_token"] + outcomes["shed"] == len(refused)


async def test_a_queued_request_past_its_first_token_objective_is_shed(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    # One slot. The door predicts from the average completion (64 tokens at first), so a
    # second request is let in behind a long one, which then holds the slot past the
    # second's first-token objective: the queue drops it rather than serve it late.
    client, keys = await appliance(
        aiohttp_client,
        tmp_path,
        slow_model,
        # The door's prior: 64 tokens at 0.05 s, so the running one frees its slot within
        # 3.2 s by its reckoning, whatever it has made so far: the second is let in.
        {"s1": {"admit_s": 3.3, "first_token_s": 3.5}},
        n_slots=1,
    )
    key = keys[ServiceClass.S1]
    holds = asyncio.Event()  # its first text came: it holds the slot
    long = asyncio.create_task(
        streamed(client, key, "The history of the world begins", 1500, holds)
    )
    await asyncio.wait_for(holds.wait(), 60)
    status, _, body, headers = await streamed(client, key, "Hello", 8)
    assert status == 429, body
    assert body["error"]["code"] == ErrorCode.overloaded
    assert "dropped from the queue" in body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    long.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await long
    text = await (await client.get("/metrics")).text()
    assert 'kvl_admission_sheds_total{class="S1"} 1.0' in text
    assert 'kvl_requests_by_outcome_total{class="S1",outcome="shed"} 1.0' in text


async def test_a_seated_request_whose_prefill_outlasts_its_objective_is_served(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    # A model whose every step takes 1.5 s, as one long prefill on a host busy with other
    # work does: the request took the free slot at once, so it is being served, not waiting,
    # and its first token past the 0.3 s objective is late but not shed.
    store = Store(tmp_path / "catalog.db")
    try:
        script = write_script(tmp_path / "sluggish.json", **{**SLOW_SCRIPT, "step_s": 1.5})
        sluggish = register_file(store, script, SLOW, "1")
    finally:
        store.close()
    client, keys = await appliance(
        aiohttp_client, tmp_path, sluggish, {"s1": {"admit_s": 0.3, "first_token_s": 0.3}}
    )
    status, first, body, _ = await streamed(client, keys[ServiceClass.S1], "Hello", 2)
    assert status == 200, body
    assert first is not None
    assert first > 0.3  # past the objective: only its seat, sent before the step, kept it
    assert body["usage"]["completion_tokens"] == 2
    text = await (await client.get("/metrics")).text()
    assert 'kvl_admission_sheds_total{class="S1"}' not in text
    assert 'kvl_slo_misses_total{class="S1",objective="first_token"} 1.0' in text


async def test_s2_arriving_preempts_running_s0_work_which_still_completes(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    client, keys = await appliance(aiohttp_client, tmp_path, slow_model, {}, n_slots=1)
    generating = asyncio.Event()
    background = asyncio.create_task(
        streamed(client, keys[ServiceClass.S0], "A long tale of a river and its town", 300,
                 generating)
    )  # fmt: skip
    async with asyncio.timeout(120):  # S0 holds the only slot and is generating
        await generating.wait()
    status, ttft, _last, _ = await streamed(client, keys[ServiceClass.S2], "The capital of", 4)
    assert status == 200
    assert ttft is not None
    s0_status, _, s0_last, _ = await background
    assert s0_status == 200
    assert s0_last["usage"]["completion_tokens"] > 4
    preemptions = None
    for _ in range(30):  # counted in the worker's heartbeat, once a second
        text = await (await client.get("/metrics")).text()
        if preemptions := re.search(r"kvl_preemptions_total\{[^}]*\} (\S+)", text):
            break
        await asyncio.sleep(0.1)
    assert preemptions is not None
    assert float(preemptions.group(1)) >= 1


async def test_quotas_refuse_name_the_quota_and_recover(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    client, keys = await appliance(
        aiohttp_client,
        tmp_path,
        slow_model,
        {"s1": {"requests_per_minute": 60}, "s2": {"tokens_per_day": 30}},
    )
    headers = {"Authorization": f"Bearer {keys[ServiceClass.S1]}"}
    body = {"model": "no-such-model", "prompt": "x"}  # cheap: refused after the quota check
    statuses = [
        (await client.post("/v1/completions", headers=headers, json=body)).status for _ in range(60)
    ]
    assert statuses == [404] * 60
    over = await client.post("/v1/completions", headers=headers, json=body)
    assert over.status == 429
    error = (await over.json())["error"]
    assert error["code"] == ErrorCode.rate_limit_exceeded
    assert "requests_per_minute" in error["message"]
    assert over.headers["Retry-After"] == "1"  # one request back per second
    # Time is the subject here: a request comes back only once a second has passed.
    await asyncio.sleep(1.1)
    assert (await client.post("/v1/completions", headers=headers, json=body)).status == 404

    # Tokens per day are charged with what a request actually used.
    s2 = {"Authorization": f"Bearer {keys[ServiceClass.S2]}"}
    spend = {"model": MODEL, "prompt": "Count to ten: one, two,", "max_tokens": 24}
    first = await client.post("/v1/completions", headers=s2, json=spend)
    assert first.status == 200
    used = (await first.json())["usage"]["total_tokens"]
    assert used > 30
    refused = await client.post("/v1/completions", headers=s2, json=spend)
    assert refused.status == 429
    assert "tokens_per_day" in (await refused.json())["error"]["message"]
    assert int(refused.headers["Retry-After"]) > 3600  # the debt refills over the day


async def test_failed_authentication_is_throttled_per_address(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    client, keys = await appliance(
        aiohttp_client, tmp_path, slow_model, {"auth_failures_per_minute": 3}
    )
    wrong = {"Authorization": "Bearer kvl_nothere0_" + "x" * 32}
    assert [(await client.get("/v1/models", headers=wrong)).status for _ in range(3)] == [401] * 3
    throttled = await client.get("/v1/models", headers=wrong)
    assert throttled.status == 429
    assert (await throttled.json())["error"]["code"] == ErrorCode.too_many_auth_failures
    assert int(throttled.headers["Retry-After"]) >= 1
    # From this address even a good key waits: guessing is what is being slowed down.
    good = {"Authorization": f"Bearer {keys[ServiceClass.S1]}"}
    assert (await client.get("/v1/models", headers=good)).status == 429


def _held(text: str) -> float:
    [line] = [x for x in text.splitlines() if x.startswith("kvl_refusals_held_total ")]
    return float(line.split()[1])


async def test_a_key_that_asks_again_without_waiting_is_held_and_no_other_key_is(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    client, keys = await appliance(
        aiohttp_client,
        tmp_path,
        slow_model,
        {
            "s1": {"requests_per_minute": 1},
            "s2": {"requests_per_minute": 1},
            "refusals_per_second": 1,
            "refusal_hold_s": 0.2,
        },
    )
    body = {"model": "no-such-model", "prompt": "x"}  # cheap: refused after the quota check
    s1 = {"Authorization": f"Bearer {keys[ServiceClass.S1]}"}
    s2 = {"Authorization": f"Bearer {keys[ServiceClass.S2]}"}
    assert (await client.post("/v1/completions", headers=s1, json=body)).status == 404
    first = await client.post("/v1/completions", headers=s1, json=body)
    assert first.status == 429
    assert _held(await (await client.get("/metrics")).text()) == 0  # within the rate: at once

    # A client in a loop that asks again the moment it is refused: each answer is still the
    # same 429 with its Retry-After, but most are held first (one a second is not: 0.2 s of
    # hold refills a fifth of one), so the loop runs at the hold's pace, not the CPU's.
    answers = [await client.post("/v1/completions", headers=s1, json=body) for _ in range(20)]
    assert {a.status for a in answers} == {429}
    assert {(await a.json())["error"]["code"] for a in answers} == {ErrorCode.rate_limit_exceeded}
    assert all(int(a.headers["Retry-After"]) >= 1 for a in answers)
    held = _held(await (await client.get("/metrics")).text())
    assert 10 <= held <= 20, held

    # Another key is not held for this one's loop: its first refusal is within its own rate.
    assert (await client.post("/v1/completions", headers=s2, json=body)).status == 404
    assert (await client.post("/v1/completions", headers=s2, json=body)).status == 429
    assert _held(await (await client.get("/metrics")).text()) == held


async def test_a_burst_on_new_connections_is_refused_at_once_and_a_loop_of_them_is_held(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    client, keys = await appliance(
        aiohttp_client,
        tmp_path,
        slow_model,
        {
            "s1": {"requests_per_minute": 1},
            "refusal_burst": 30,
            "refusals_per_second": 1,
            "refusal_hold_s": 0.2,
        },
    )
    body = {"model": "no-such-model", "prompt": "x"}
    s1 = {"Authorization": f"Bearer {keys[ServiceClass.S1]}"}
    assert (await client.post("/v1/completions", headers=s1, json=body)).status == 404
    url = client.make_url("/v1/completions")
    # Each request on its own connection, as a burst of one key's users sends them.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def ask() -> tuple[int, float]:
            started = time.monotonic()
            async with session.post(url, headers=s1, json=body) as response:
                await response.read()
                return response.status, time.monotonic() - started

        burst = await asyncio.gather(*(ask() for _ in range(30)))
        assert {status for status, _ in burst} == {429}
        assert _held(await (await client.get("/metrics")).text()) == 0

        # The same key past its burst, a new connection each time: held at its rate (one a
        # second answered at once; a hold of 0.2 s refills a fifth of one).
        loop = [await ask() for _ in range(20)]
        assert {status for status, _ in loop} == {429}
        held = _held(await (await client.get("/metrics")).text())
        assert 8 <= held <= 20, held


# -- the door's order: refusals first ---------------------------------------------------------


async def test_a_place_past_the_early_check_is_counted_by_the_requests_after_it(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    """A request past the early check holds a place until its prompt is tokenized: the
    requests after it count it as queued, so a burst cannot all pass the check before the
    first of it is submitted; a place left counts no more."""
    client, _ = await appliance(
        aiohttp_client, tmp_path, slow_model, {"s1": {"admit_s": 0.5, "first_token_s": 2.0}}
    )
    admission = client.app[ADMISSION]
    deployment = await client.app[REGISTRY].resolve(MODEL)
    places = []
    for _ in range(64):  # two slots: 48 tokens at 20 ms a step take ~1 s each
        try:
            places.append(admission.refuse_early(deployment, ServiceClass.S1, 8, 48))
        except Overloaded:
            break
    assert 2 <= len(places) < 64
    with pytest.raises(Overloaded):
        admission.refuse_early(deployment, ServiceClass.S1, 8, 48)
    for place in places:
        place.leave()
    with admission.refuse_early(deployment, ServiceClass.S1, 8, 48):
        pass


async def test_admitted_requests_are_prepared_after_the_door_answers_what_came_with_them(
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    slow_model: ModelRecord,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An admitted request waits (one at a time) until a turn of the event loop brings no
    request to the door: the refusals of the burst it came with go out before its prompt
    is rendered; a flood that never stops holds it AFTER_THE_DOOR_S at most."""
    client, _ = await appliance(aiohttp_client, tmp_path, slow_model, {})
    admission = client.app[ADMISSION]
    deployment = await client.app[REGISTRY].resolve(MODEL)
    order: list[str] = []

    async def admitted(name: str) -> None:
        with admission.refuse_early(deployment, ServiceClass.S1, 8, 8):
            await admission.after_the_door()
            order.append(name)

    async def answered(name: str) -> None:
        with admission.refuse_early(deployment, ServiceClass.S1, 8, 8):
            order.append(name)  # a refusal, answered in the turn it came

    # Two admitted, then five that came in the same turn, then three a turn later.
    tasks = [asyncio.create_task(admitted(f"admitted {i}")) for i in range(2)]
    tasks += [asyncio.create_task(answered(f"door {i}")) for i in range(5)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(answered(f"door {i}")) for i in range(5, 8)]
    await asyncio.gather(*tasks)
    assert order == [f"door {i}" for i in range(8)] + ["admitted 0", "admitted 1"]

    # A flood at the door every turn: the admitted request goes ahead after the bound.
    monkeypatch.setattr(admission_module, "AFTER_THE_DOOR_S", 0.05)
    flooding = True

    async def flood() -> None:
        while flooding:
            await answered("flood")
            await asyncio.sleep(0)  # one a turn

    waited = asyncio.create_task(admitted("admitted"))
    flooder = asyncio.create_task(flood())
    started = time.monotonic()
    await waited
    assert 0.05 <= time.monotonic() - started < 2.0
    # The ones after it in the flood go after a turn each, not after the bound each: the
    # model is not starved of work while the door is flooded.
    started = time.monotonic()
    await asyncio.gather(*(admitted(f"next {i}") for i in range(5)))
    assert time.monotonic() - started < 0.2  # five bounds would be 0.25 s
    flooding = False
    await flooder
