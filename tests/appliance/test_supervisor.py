"""Model workers are separate processes: a crash or a hang costs only their in-flight requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import psutil
import pytest
from pytest_aiohttp import AiohttpClient

from appliance.app import create_app
from appliance.gateway.appkeys import REGISTRY
from appliance.serving.engine import EngineOptions, Finished, GenerationRequest, TextDelta
from appliance.serving.sampling_options import Sampling
from appliance.serving.scripted import LOGPROB
from appliance.serving.supervisor import Replica, Restart, SupervisorOptions, WorkerUnavailableError
from appliance.settings import ApplianceSettings
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from shared.errors import ErrorCode
from tests.appliance.logits import MAX_DRIFT
from tests.conftest import SLOW, Client
from tests.waiting import until

# The slow scripted model: 400 tokens take 8 s, a stream to kill (the supervisor is the
# subject, not the model).
MODEL = SLOW
LONG = {"model": MODEL, "prompt": "Tell a very long story.", "max_tokens": 400, "temperature": 0}
PROMPT = tuple(b"Tell a very long story.")  # the scripted model's tokens are bytes


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_kill_9_mid_stream(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    # The worker runs below the gateway's priority by `model.worker_nice` (10 by default).
    assert settings.model.worker_nice == 10
    model = settings.model.model_copy(update={"worker_nice": 7, "default": SLOW})
    app = create_app(settings.model_copy(update={"model": model}))
    client: Client = await aiohttp_client(app)
    host = app[REGISTRY]
    await host.wait_loaded()
    (replica,) = host.replicas()
    assert replica is not None
    first_pid = replica.pid
    assert first_pid is not None
    assert psutil.Process(first_pid).nice() == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)

    stream = await client.post(
        "/v1/completions", headers=auth(api_key), json={**LONG, "stream": True}
    )
    assert stream.status == 200
    await stream.content.readline()  # it is generating
    whole = asyncio.create_task(client.post("/v1/completions", headers=auth(api_key), json=LONG))
    await until(lambda: replica.outstanding == 2, timeout_s=120)

    os.kill(first_pid, signal.SIGKILL)

    # The streamed request ends with an error event; the waiting one gets 503 + Retry-After.
    events = [
        line for line in (await stream.read()).decode().splitlines() if line.startswith("data: ")
    ]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == ErrorCode.model_unavailable.value
    response = await whole
    assert response.status == 503
    assert int(response.headers["Retry-After"]) >= 1
    body = await response.json()
    assert body["error"]["code"] == ErrorCode.model_unavailable.value
    assert "restarting" in body["error"]["message"]

    # The gateway never went down, and the worker comes back with a new process.
    assert (await client.get("/healthz")).status == 200
    await until(lambda: replica.ready and replica.pid != first_pid, timeout_s=120)
    ok = await client.post("/v1/completions", headers=auth(api_key), json={**LONG, "max_tokens": 4})
    assert ok.status == 200, await ok.text()

    metrics = await (await client.get("/metrics")).text()
    assert 'kvl_worker_restarts_total{kind="exited",model="scripted-slow@' in metrics
    store = Store(settings.db_path)
    restarts = store.worker_restarts()
    store.close()
    assert [r["kind"] for r in restarts] == ["exited"]
    # -9 as a rule; asyncio reports 255 when another waiter reaped the child first.
    assert restarts[0]["exit_code"] in {-signal.SIGKILL, 255}


async def test_a_frozen_worker_is_detected_and_replaced(slow_model: ModelRecord) -> None:
    restarts: list[Restart] = []

    async def record(restart: Restart) -> None:
        restarts.append(restart)

    replica = Replica(
        slow_model,
        EngineOptions(n_ctx=512, n_threads=1),
        SupervisorOptions(heartbeat_s=0.2, heartbeat_timeout_s=1.5, backoff_initial_s=0.1),
        on_restart=record,
    )
    await replica.start()
    try:
        frozen = replica.pid
        assert frozen is not None
        run = replica.submit(
            GenerationRequest(
                prompt_tokens=PROMPT, max_tokens=300, sampling=Sampling(temperature=0)
            )
        )
        await anext(run)
        os.kill(frozen, signal.SIGSTOP)  # alive, but silent: no heartbeats, no tokens
        with pytest.raises(WorkerUnavailableError) as stopped:
            await drain(run)
        assert stopped.value.retry_after > 0
        await until(lambda: replica.ready and replica.pid != frozen, timeout_s=120)
        assert [r.kind for r in restarts] == ["heartbeat"]
        again = replica.submit(GenerationRequest(prompt_tokens=PROMPT, max_tokens=2))
        events = [event async for event in again]
        assert events[-1].finish_reason in {"stop", "length"}  # type: ignore[union-attr]
    finally:
        await replica.close()
    assert replica.pid is not None
    assert not _alive(replica.pid)


async def test_logprobs_cross_the_worker_pipe_as_the_engine_made_them(
    scripted_model: ModelRecord,
) -> None:
    """The scripted model's made-up logprobs (each token LOGPROB, its alternatives the next
    byte values, less likely), through a real worker process: each arrives as it was made,
    tuples again, with the delta whose text it completes."""
    replica = Replica(scripted_model, EngineOptions(n_ctx=512), SupervisorOptions())
    await replica.start()
    try:
        request = GenerationRequest(prompt_tokens=tuple(b"ping"), max_tokens=8, logprobs=3)
        events = [event async for event in replica.submit(request)]
    finally:
        await replica.close()
    done = events[-1]
    assert isinstance(done, Finished)
    assert done.text == "pong"
    entries = [lp for e in events if isinstance(e, TextDelta) for lp in e.logprobs]
    assert [entry.id for entry in entries] == list(b"pong")
    for entry in entries:
        assert entry.logprob == LOGPROB
        assert isinstance(entry.top, tuple)
        assert entry.top == tuple((entry.id + i, LOGPROB - 2.0 * i) for i in range(3))


async def test_logprobs_sampling_and_shared_prompts_cross_the_worker_pipe(
    default_model: ModelRecord,
) -> None:
    # On the real model: logit_bias and prompt sharing act only in llama.cpp (a scripted
    # model ignores both), so only there would a field the pipe dropped fail this test.
    # Two siblings (OpenAI's n) with the new sampling fields, through a real worker process;
    # prefix sharing is otherwise off and the prompt is short.
    replica = Replica(
        default_model,
        EngineOptions(n_ctx=512, n_slots=2, n_threads=1, prefix_min_tokens=0),
        SupervisorOptions(heartbeat_s=0.2),
    )
    await replica.start()
    try:
        banned = 506  # " the", greedy's first pick after this prompt
        sampling = Sampling(
            temperature=0.0, top_k=40, min_p=0.05, repeat_penalty=1.1, logit_bias=((banned, -100),)
        )
        request = GenerationRequest(
            prompt_tokens=(2, 818, 5279, 529, 7001, 563),  # "The capital of France is"
            max_tokens=8,
            sampling=sampling,
            logprobs=3,
            share_prompt=True,
        )
        runs = [replica.submit(request), replica.submit(request)]
        events = [[event async for event in run] for run in runs]
    finally:
        await replica.close()
    finished, firsts = [], []
    for stream in events:
        done = stream[-1]
        assert isinstance(done, Finished)
        finished.append(done)
        entries = [lp for e in stream if isinstance(e, TextDelta) for lp in e.logprobs]
        assert len(entries) == done.completion_tokens > 0
        assert all(len(entry.top) == 3 and isinstance(entry.top, tuple) for entry in entries)
        assert banned not in [entry.id for entry in entries]
        firsts.append(dict(entries[0].top))
    assert [f.cached_tokens for f in finished] == [0, 5]
    # The copied prompt gives the first token the computed one's distribution, within the
    # rounding of a different batch layout (test_batching's MAX_DRIFT on logits; a logprob
    # moves at most twice that). Not the same greedy text: a near-tie may flip with it.
    # Each one's most likely first token is among the other's three most likely.
    computed, copied = firsts
    assert max(computed, key=computed.__getitem__) in copied
    assert max(copied, key=copied.__getitem__) in computed
    for token in computed.keys() & copied.keys():
        assert abs(computed[token] - copied[token]) < 2 * MAX_DRIFT


async def drain(run: Any) -> None:
    async for _ in run:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
