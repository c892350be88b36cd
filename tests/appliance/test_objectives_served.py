"""The live objectives with the real model: every generation route counted, each request
once (served, refused at the door, over its quota, cancelled, failed by a worker crash),
`admitted + sum(refused) == requests` once all have ended, the same counts on /metrics,
and a restart of the appliance resumes them in the same epoch."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from typing import TYPE_CHECKING

import grpc

from appliance.app import create_app
from appliance.gateway.appkeys import ADMISSION, REGISTRY, STORE
from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2 as pb
from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2_grpc as pb_grpc
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from shared import protocol
from shared.classes import ServiceClass
from shared.errors import ErrorCode
from tests.conftest import SLOW, free_port, make_settings
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp import web
    from pytest_aiohttp import AiohttpClient

    from appliance.settings import ApplianceSettings
    from tests.conftest import Client

MODEL = SLOW
SHORT = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
LONG = {"model": MODEL, "prompt": "Tell a very long story.", "max_tokens": 400}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def started(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings
) -> tuple[web.Application, Client]:
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    return app, client


def series(app: web.Application) -> dict[tuple[str, str], protocol.ObjectiveSeries]:
    return {(s.service_class, s.account): s for s in app[ADMISSION].book.snapshot()}


def by_outcome(metrics: str) -> dict[tuple[str, str], float]:
    return {
        (m[1], m[2]): float(m[3])
        for m in re.finditer(
            r'^kvl_requests_by_outcome_total\{class="(\w+)",outcome="(\w+)"\} (\S+)$',
            metrics,
            re.MULTILINE,
        )
    }


async def test_each_request_is_counted_once_by_how_it_ended_and_a_restart_resumes(
    aiohttp_client: AiohttpClient, tmp_path: Path, slow_model: ModelRecord
) -> None:
    grpc_port = free_port()
    settings = make_settings(
        tmp_path / "data",
        embeddings={"enabled": False},
        grpc={"enabled": True, "port": grpc_port},
        # S2 here cannot meet its objectives at all: refused at the door. S3: one request
        # a minute.
        classes={
            "s2": {"admit_s": 0.01, "first_token_s": 0.01, "complete_s": 0.01},
            "s3": {"requests_per_minute": 1},
        },
    )
    store = Store(settings.db_path)
    try:
        store.add_model(slow_model)
        served = store.create_key("served", ServiceClass.S1).plaintext
        door = store.create_key("door", ServiceClass.S2).plaintext
        limited = store.create_key("limited", ServiceClass.S3).plaintext
    finally:
        store.close()
    app, client = await started(aiohttp_client, settings)
    epoch = await app[STORE].run(app[STORE].sync.objectives_epoch)

    # Served, on every generation route: completions, chat (whole and streamed),
    # responses, gRPC.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for path, body in (
        ("/v1/completions", SHORT),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4}),
    ):
        response = await client.post(path, headers=auth(served), json=body)
        assert response.status == 200, await response.text()
        await response.read()

    def generate() -> None:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        call = stub.Generate(
            pb.GenerateRequest(model=MODEL, prompt="Hello", max_tokens=4),
            metadata=(("authorization", f"Bearer {served}"),),
            timeout=60,
        )
        assert list(call)[-1].finish_reason in {"stop", "length"}

    await asyncio.to_thread(generate)
    # A bad request never reaches admission: counted nowhere.
    missing = await client.post(
        "/v1/completions", headers=auth(served), json={"model": "x", "prompt": "x"}
    )
    assert missing.status == 404

    # Cancelled: its client goes away after the first chunk.
    stream = await client.post(
        "/v1/completions", headers=auth(served), json={**LONG, "stream": True}
    )
    assert stream.status == 200
    await stream.content.readline()
    stream.close()
    await until(lambda: series(app)[("S1", "served")].admitted == 6, "the cancelled one ended")

    # Failed: the worker dies mid-stream (a 5xx while serving an admitted request).
    (replica,) = app[REGISTRY].replicas()
    pid = replica.pid
    assert pid is not None
    stream = await client.post(
        "/v1/completions", headers=auth(served), json={**LONG, "stream": True}
    )
    assert stream.status == 200
    await stream.content.readline()
    os.kill(pid, signal.SIGKILL)
    assert ErrorCode.model_unavailable.value in (await stream.read()).decode()
    await until(lambda: replica.ready and replica.pid != pid, "the worker back", timeout_s=120)

    # Refused at the door (for good: not even an idle node meets S2's objectives here),
    # and over a quota.
    for _ in range(2):
        refused = await client.post("/v1/completions", headers=auth(door), json=SHORT)
        assert refused.status == 400
        assert (await refused.json())["error"]["code"] == ErrorCode.prompt_too_long_for_class
    statuses = [
        (await client.post("/v1/completions", headers=auth(limited), json=SHORT)).status
        for _ in range(2)
    ]
    assert statuses == [200, 429]

    counted = series(app)
    s1, s2, s3 = counted[("S1", "served")], counted[("S2", "door")], counted[("S3", "limited")]
    assert (s1.requests, s1.admitted, s1.refused) == (7, 6, {"error": 1})
    assert s1.missed.get("complete", 0) >= 1  # the failed one at least
    # Five served to their end; the cancelled one counts for `complete` neither way.
    assert s1.met.get("complete", 0) + s1.missed.get("complete", 0) == 5 + 1
    assert s1.completion.count == 5
    assert s1.ttft.count == 6
    assert s2.requests == 2
    assert sum(s2.refused.get(r, 0) for r in ("admit", "first_token")) == 2
    assert s2.missed == {"admit": 2, "first_token": 2, "complete": 2}
    assert (s3.requests, s3.admitted, s3.refused) == (2, 1, {"quota": 1})
    assert s3.met.get("complete", 0) + s3.missed.get("complete", 0) == 1  # quota: none
    for s in counted.values():
        assert s.admitted + sum(s.refused.values()) == s.requests
    metrics = by_outcome(await (await client.get("/metrics")).text())
    assert metrics[("S1", "admitted")] == 6
    assert metrics[("S1", "error")] == 1
    assert metrics[("S3", "quota")] == 1
    assert metrics[("S2", "admit")] + metrics[("S2", "first_token")] == 2

    # A restart resumes every count, in the same epoch; the worker's restart is kept too.
    before = app[ADMISSION].book.snapshot()
    await client.close()
    app, client = await started(aiohttp_client, settings)
    assert app[ADMISSION].book.snapshot() == before
    assert await app[STORE].run(app[STORE].sync.objectives_epoch) == epoch
    assert await app[STORE].run(app[STORE].sync.worker_restart_count) == 1
    assert by_outcome(await (await client.get("/metrics")).text()) == metrics
    response = await client.post("/v1/completions", headers=auth(served), json=SHORT)
    assert response.status == 200
    assert series(app)[("S1", "served")].admitted == 7
