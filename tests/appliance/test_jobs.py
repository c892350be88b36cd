"""Durable jobs (IF-4): the API in process, the state layer, and `kill -9` of a real appliance.

Webhooks go to a real aiohttp server on 127.0.0.1 that verifies them with `shared.webhooks`,
as a receiver would.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
from aiohttp import ClientSession, web
from pytest_aiohttp import AiohttpClient, AiohttpServer

from appliance.app import create_app
from appliance.gateway.appkeys import ADMISSION, REGISTRY
from appliance.gateway.jobs import JOBS
from appliance.settings import ApplianceSettings
from appliance.state.jobs import JobFinishedError, JobNotFoundError, JobStore, NewItem
from appliance.state.records import ModelRecord
from appliance.state.store import NotFoundError, Store
from shared.errors import ErrorCode
from shared.webhooks import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    ReplayGuard,
    SignatureMismatchError,
    WebhookVerificationError,
    verify,
)
from tests.conftest import (
    SLOW,
    Client,
    free_port,
    kvl,
    make_settings,
    spawn_appliance,
    wait_ready,
)
from tests.gateway import MODEL, assert_error, auth
from tests.waiting import until

ENDED = frozenset({"completed", "failed", "cancelled"})


def ended(job: dict[str, Any]) -> bool:
    return job["status"] in ENDED


FAST_JOBS: dict[str, object] = {
    "max_items": 8,
    "retry_initial_s": 0.05,
    "retry_max_s": 0.5,
    "webhook_backoff_initial_s": 0.05,
    "webhook_backoff_max_s": 0.2,
    # The receivers are on loopback, where webhooks go only when the operator says so.
    "webhook_allow": ["127.0.0.1/8"],
}


@pytest.fixture
def settings(tmp_path: Path, scripted_models: list[ModelRecord]) -> ApplianceSettings:
    """conftest's settings (the scripted models: jobs are the subject, not the model), with
    job retries fast enough for tests."""
    s = make_settings(tmp_path / "data", jobs=FAST_JOBS)
    store = Store(s.db_path)
    for record in scripted_models:
        store.add_model(record)
    store.close()
    return s


def chat_item(custom_id: str, content: str = "Say hi", **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }
    return {"custom_id": custom_id, "url": "/v1/chat/completions", "body": body}


def text_item(custom_id: str, prompt: str = "Once upon a time", **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return {"custom_id": custom_id, "url": "/v1/completions", "body": body}


async def create_job(client: Client, key: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = await client.post("/v1/jobs", headers=auth(key), json=body)
    return response.status, await response.json()


async def get_job(client: Client, key: str, job_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/jobs/{job_id}", headers=auth(key))
    assert response.status == 200, await response.text()
    job: dict[str, Any] = await response.json()
    return job


async def wait_for(
    fetch: Callable[[], Awaitable[dict[str, Any]]],
    done: Callable[[dict[str, Any]], bool] = ended,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Fetch a job until `done(job)` holds (by default: until it ended); the last fetched."""
    job: dict[str, Any] = {}

    async def check() -> bool:
        nonlocal job
        job = await fetch()
        return done(job)

    await until(check, timeout_s=timeout_s)
    return job


async def wait_job(
    client: Client,
    key: str,
    job_id: str,
    done: Callable[[dict[str, Any]], bool] = ended,
) -> dict[str, Any]:
    return await wait_for(lambda: get_job(client, key, job_id), done)


async def results(client: Client, key: str, job_id: str, query: str = "") -> dict[str, Any]:
    response = await client.get(f"/v1/jobs/{job_id}/results{query}", headers=auth(key))
    assert response.status == 200, await response.text()
    page: dict[str, Any] = await response.json()
    return page


def webhook_secret(db_path: Path, account: str) -> str:
    store = Store(db_path)
    try:
        return JobStore(store.db).webhook_secret(account)
    finally:
        store.close()


def job_usage(db_path: Path) -> list[dict[str, Any]]:
    with closing(sqlite3.connect(db_path)) as db:
        db.row_factory = sqlite3.Row
        rows = db.execute("SELECT * FROM usage_events WHERE route = '/v1/jobs'").fetchall()
    return [dict(r) for r in rows]


# -- a webhook receiver, as a customer would write it ------------------------------------------


@dataclass
class Receiver:
    """Verifies every delivery, does its effect once per delivery id (ReplayGuard), and
    answers 500 to the first `fail_first` requests anyway, as if its answer were lost."""

    url: str
    secret: str = ""
    fail_first: int = 0
    guard: ReplayGuard = field(default_factory=ReplayGuard)
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    effects: list[dict[str, Any]] = field(default_factory=list)
    refused: list[WebhookVerificationError] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append((dict(request.headers), body))
        self.arrived.set()
        try:
            verify(self.secret, body, request.headers.get(SIGNATURE_HEADER))
        except WebhookVerificationError as err:
            self.refused.append(err)
            return web.Response(status=400, text=str(err))
        if self.guard.admit(request.headers[DELIVERY_HEADER]):
            self.effects.append(json.loads(body))
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.Response(status=500)
        return web.Response(status=204)

    async def wait(self, requests: int, timeout_s: float = 60.0) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.requests) < requests:
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def receiver(aiohttp_server: AiohttpServer) -> Receiver:
    app = web.Application()
    hook = Receiver(url="")
    app.router.add_post("/hook", hook.handle)
    server = await aiohttp_server(app)  # on 127.0.0.1
    hook.url = str(server.make_url("/hook"))
    return hook


# -- the API, in process -----------------------------------------------------------------------


async def test_a_jobs_results_are_what_the_routes_answer(
    client: Client, api_key: str, settings: ApplianceSettings
) -> None:
    """Each item alone (a greedy request sharing no batch), against the same request sent to
    its route: the same text, finish reason and usage."""
    cases = [(chat_item("c"), "/v1/chat/completions"), (text_item("t"), "/v1/completions")]
    for item, route in cases:
        response = await client.post(
            "/v1/jobs", headers=auth(api_key), json={"requests": [item], "metadata": {"k": "v"}}
        )
        assert response.status == 202, await response.text()
        created = await response.json()
        assert response.headers["Location"] == f"/v1/jobs/{created['id']}"
        assert created["object"] == "job"
        assert created["status"] in {"queued", "running"}
        assert created["progress"] == {"total": 1, "completed": 0, "failed": 0}
        assert created["metadata"] == {"k": "v"}
        assert created["webhook"] is None
        job = await wait_job(client, api_key, created["id"])
        assert job["status"] == "completed", job
        assert job["progress"] == {"total": 1, "completed": 1, "failed": 0}
        assert job["created_at"] <= job["started_at"] <= job["completed_at"]
        page = await results(client, api_key, job["id"])
        assert page["has_more"] is False
        [result] = page["data"]
        assert (result["custom_id"], result["status_code"]) == (item["custom_id"], 200)
        direct = await client.post(route, headers=auth(api_key), json=item["body"])
        assert direct.status == 200
        expected = await direct.json()
        got = result["body"]
        for name in ("object", "model", "choices", "usage"):
            assert got[name] == expected[name], name
        assert got["id"] != expected["id"]
    usage = job_usage(settings.db_path)
    assert len(usage) == 2
    assert {u["status"] for u in usage} == {200}


async def test_progress_counts_items_that_fail_and_results_page(
    client: Client, api_key: str, settings: ApplianceSettings
) -> None:
    # Valid when created; at run time its prompt and max_tokens overflow the 2048 context:
    # its result is the route's 400, and the job goes on.
    too_long = text_item("long", prompt="word " * 1500, max_tokens=1000)
    body = {"requests": [text_item("a"), too_long, chat_item("b"), text_item("c", prompt="Hi")]}
    status, created = await create_job(client, api_key, body)
    assert status == 202, created
    job = await wait_job(client, api_key, created["id"])
    assert job["status"] == "completed"
    assert job["progress"] == {"total": 4, "completed": 3, "failed": 1}
    first = await results(client, api_key, job["id"], "?limit=2")
    assert [r["custom_id"] for r in first["data"]] == ["a", "long"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("a", "long", True)
    failed = first["data"][1]
    assert failed["status_code"] == 400
    assert_error(failed["body"], ErrorCode.context_length_exceeded)
    rest = await results(client, api_key, job["id"], "?after=long")
    assert [r["custom_id"] for r in rest["data"]] == ["b", "c"]
    assert rest["has_more"] is False
    assert all(r["status_code"] == 200 for r in rest["data"])
    for query, param in [("?limit=0", "limit"), ("?limit=x", "limit"), ("?after=nope", "after")]:
        response = await client.get(f"/v1/jobs/{job['id']}/results{query}", headers=auth(api_key))
        assert response.status == 400
        assert_error(await response.json(), ErrorCode.invalid_value, param)
    # A job none of whose items succeeds has failed.
    status, created = await create_job(client, api_key, {"requests": [too_long]})
    job = await wait_job(client, api_key, created["id"])
    assert (job["status"], job["progress"]["failed"]) == ("failed", 1)
    metrics = await (await client.get("/metrics")).text()
    assert 'kvl_jobs_total{status="completed"} 1.0' in metrics
    assert 'kvl_jobs_total{status="failed"} 1.0' in metrics
    assert 'kvl_job_items_total{outcome="completed"} 3.0' in metrics
    assert 'kvl_job_items_total{outcome="failed"} 2.0' in metrics
    # Usage is recorded for what generated, as the route records it (the 400s never did).
    assert len(job_usage(settings.db_path)) == 3


BAD_JOBS: list[tuple[dict[str, Any], ErrorCode | None, str]] = [
    (
        {"requests": [chat_item("a"), {**chat_item("b"), "body": {"model": MODEL}}]},
        ErrorCode.missing_required_parameter,
        "requests[1].body.messages",
    ),
    (
        {"requests": [chat_item("a", temperature=3)]},
        ErrorCode.invalid_value,
        "requests[0].body.temperature",
    ),
    (
        {"requests": [chat_item("a", stream=True)]},
        ErrorCode.unsupported_parameter,
        "requests[0].body.stream",
    ),
    (
        {"requests": [chat_item("a", tools=[{"type": "function"}])]},
        ErrorCode.missing_required_parameter,
        "requests[0].body.tools[0].function",
    ),
    (
        {"requests": [text_item("a", max_tokens=5000)]},
        ErrorCode.invalid_value,
        "requests[0].body.max_tokens",
    ),
    (
        {"requests": [text_item("a"), text_item("b", model="no-such-model")]},
        ErrorCode.model_not_found,
        "requests[1].body.model",
    ),
    (
        {
            "requests": [
                chat_item(
                    "a",
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                    },
                )
            ]
        },
        ErrorCode.invalid_schema,
        "requests[0].body.response_format.json_schema.schema",
    ),
    (
        {"requests": [{**text_item("a"), "url": "/v1/embeddings"}]},
        ErrorCode.invalid_value,
        "requests[0].url",
    ),
    (
        {"requests": [text_item("a"), text_item("b"), text_item("a")]},
        ErrorCode.invalid_value,
        "requests[2].custom_id",
    ),
    ({"requests": [text_item(str(i)) for i in range(9)]}, ErrorCode.invalid_value, "requests"),
    ({"requests": []}, ErrorCode.invalid_value, "requests"),
    ({"requests": [text_item("a")], "webhook_url": "ftp://example.org/hook"}, None, "webhook_url"),
    ({"requests": [text_item("a")], "webhook_url": "http://"}, None, "webhook_url"),
    ({"requests": [text_item("a")], "webhook_url": "http://h:99999/"}, None, "webhook_url"),
    # Addresses webhooks may not go to (the tests' allow-list names 127.0.0.1/8 alone).
    *(
        ({"requests": [text_item("a")], "webhook_url": url}, None, "webhook_url")
        for url in (
            "http://10.1.2.3/hook",
            "https://192.168.0.10:8443/hook",
            "http://169.254.169.254/latest/meta-data/",
            "http://100.64.0.1/hook",
            "http://0.0.0.0:8080/",
            "http://224.0.0.1/",
            "http://[fd00::1]/hook",
            "http://[fe80::1]/hook",
            "http://[::1]/hook",
            "http://[::ffff:192.168.0.1]/hook",
        )
    ),
    ({"requests": [text_item("a")], "metadata": {"k": "v" * 513}}, None, "metadata.k"),
    ({"requests": [text_item("a")], "priority": 1}, ErrorCode.unknown_parameter, "priority"),
]


async def test_a_bad_item_refuses_the_whole_job_naming_it(
    client: Client, api_key: str, settings: ApplianceSettings
) -> None:
    # One app for every case: each would otherwise load the model for a 400.
    for body, code, param in BAD_JOBS:
        status, answer = await create_job(client, api_key, body)
        expected = code or ErrorCode.invalid_value
        assert status == expected.status, (param, answer)
        assert_error(answer, expected, param)
    with closing(sqlite3.connect(settings.db_path)) as db:
        assert db.execute("SELECT COUNT(*) FROM jobs").fetchone() == (0,)


async def test_another_accounts_jobs_are_not_found(
    client: Client, api_key: str, settings: ApplianceSettings
) -> None:
    status, created = await create_job(client, api_key, {"requests": [text_item("a")]})
    assert status == 202
    store = Store(settings.db_path)
    other = store.create_key("other").plaintext
    store.close()
    job_id = created["id"]
    for method, path in [
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/results"),
        ("DELETE", f"/v1/jobs/{job_id}"),
    ]:
        response = await client.request(method, path, headers=auth(other))
        assert response.status == 404, path
        assert_error(await response.json(), ErrorCode.job_not_found)
        unknown = await client.request(
            method, path.replace(job_id, "job_nope"), headers=auth(api_key)
        )
        assert unknown.status == 404
        assert_error(await unknown.json(), ErrorCode.job_not_found)
    job = await wait_job(client, api_key, job_id)
    assert job["status"] == "completed"  # the other account's DELETE did nothing


async def test_cancel_stops_the_job_keeps_its_results_and_tells_the_webhook(
    client: Client, api_key: str, settings: ApplianceSettings, receiver: Receiver
) -> None:
    receiver.secret = webhook_secret(settings.db_path, "tester")
    # Two run at a time: when the first pair is done, the second runs and two wait. On the
    # slow scripted model, a second each.
    items = [
        text_item(str(i), prompt=f"{i}, {i + 1}, {i + 2},", max_tokens=50, model=SLOW)
        for i in range(6)
    ]
    status, created = await create_job(
        client, api_key, {"requests": items, "webhook_url": receiver.url}
    )
    assert status == 202, created
    assert created["webhook"]["status"] == "waiting"
    job_id = created["id"]
    await wait_job(client, api_key, job_id, lambda j: j["progress"]["completed"] >= 1)
    response = await client.delete(f"/v1/jobs/{job_id}", headers=auth(api_key))
    assert response.status == 200, await response.text()
    cancelled = await response.json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["completed_at"] is not None
    assert 1 <= cancelled["progress"]["completed"] < 6
    # Items in flight stop; nothing starts again.
    assert client.app is not None
    runner = client.app[JOBS].runner

    async def idle() -> bool:
        return runner.running(job_id) == 0

    await until(idle, timeout_s=30)
    job = await get_job(client, api_key, job_id)
    assert job["status"] == "cancelled"
    # An item in flight may have finished while the cancel went through: its result stays.
    in_flight = settings.jobs.max_concurrent_items
    assert 0 <= job["progress"]["completed"] - cancelled["progress"]["completed"] <= in_flight
    page = await results(client, api_key, job_id)
    assert len(page["data"]) == job["progress"]["completed"]
    usage = job_usage(settings.db_path)
    done = [u for u in usage if u["status"] == 200]
    assert len(done) == job["progress"]["completed"]  # charged for exactly the results
    # The rest spent tokens only if they were in flight (499); none started after the cancel.
    assert {u["status"] for u in usage} <= {200, 499}
    assert len(usage) <= cancelled["progress"]["completed"] + in_flight
    # Cancelling again: it already ended.
    again = await client.delete(f"/v1/jobs/{job_id}", headers=auth(api_key))
    assert again.status == 409
    assert_error(await again.json(), ErrorCode.job_finished)
    await receiver.wait(1)
    [event] = receiver.effects
    assert (event["type"], event["data"]["id"]) == ("job.cancelled", job_id)
    assert event["data"]["status"] == "cancelled"
    assert not receiver.refused


async def test_a_failing_receiver_gets_retries_of_one_delivery_with_one_effect(
    client: Client, api_key: str, settings: ApplianceSettings, receiver: Receiver
) -> None:
    receiver.secret = webhook_secret(settings.db_path, "tester")
    receiver.fail_first = 2  # it does the effect, then its answer is lost, twice
    status, created = await create_job(
        client, api_key, {"requests": [text_item("a")], "webhook_url": receiver.url}
    )
    assert status == 202, created
    job = await wait_job(
        client, api_key, created["id"], lambda j: j["webhook"]["status"] == "delivered"
    )
    assert job["status"] == "completed"
    webhook = job["webhook"]
    assert webhook["attempts"] == 3
    assert webhook["last_status_code"] == 204
    assert webhook["delivered_at"] is not None
    assert len(receiver.requests) == 3
    ids = {headers[DELIVERY_HEADER] for headers, _ in receiver.requests}
    assert ids == {webhook["delivery_id"]}  # the same delivery every time
    assert len({body for _, body in receiver.requests}) == 1  # the same body too
    assert not receiver.refused  # each attempt signed anew, each verified
    [event] = receiver.effects
    assert event["id"] == webhook["delivery_id"]
    assert event["type"] == "job.completed"
    assert event["data"]["id"] == job["id"]
    assert event["data"]["progress"] == {"total": 1, "completed": 1, "failed": 0}
    # A replay of the delivered request verifies (it is fresh) but has no second effect; a
    # tampered copy is refused.
    headers, body = receiver.requests[-1]
    replay = {
        SIGNATURE_HEADER: headers[SIGNATURE_HEADER],
        DELIVERY_HEADER: headers[DELIVERY_HEADER],
    }
    async with ClientSession() as session:
        async with session.post(receiver.url, data=body, headers=replay) as response:
            assert response.status == 204
        tampered = body.replace(b'"completed"', b'"cancelled"', 1)
        async with session.post(receiver.url, data=tampered, headers=replay) as response:
            assert response.status == 400
    assert len(receiver.effects) == 1
    assert isinstance(receiver.refused[-1], SignatureMismatchError)
    metrics = await (await client.get("/metrics")).text()
    assert 'kvl_webhook_deliveries_total{outcome="retried"} 2.0' in metrics
    assert 'kvl_webhook_deliveries_total{outcome="delivered"} 1.0' in metrics


def metric(text: str, sample: str) -> float:
    """The value of one sample (`name{labels}`) in a /metrics answer; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


async def test_the_runner_and_the_webhook_loop_survive_their_own_exceptions(
    client: Client,
    api_key: str,
    settings: ApplianceSettings,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each loop's body raises once (a bug, a database error): it is counted, and the same
    loop still runs the job and delivers its webhook."""
    receiver.secret = webhook_secret(settings.db_path, "tester")
    assert client.app is not None
    service = client.app[JOBS]
    failed: list[str] = []

    def once(name: str, real: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        async def flaky() -> Any:
            if name not in failed:
                failed.append(name)
                raise RuntimeError(f"{name}: a bug, once")
            return await real()

        return flaky

    monkeypatch.setattr(
        service.runner, "_launch_pending", once("runner", service.runner._launch_pending)
    )
    monkeypatch.setattr(service.sender, "_launch_due", once("webhooks", service.sender._launch_due))
    status, created = await create_job(
        client, api_key, {"requests": [text_item("a")], "webhook_url": receiver.url}
    )
    assert status == 202, created
    job = await wait_job(
        client, api_key, created["id"], lambda j: j["webhook"]["status"] == "delivered"
    )
    assert job["progress"] == {"total": 1, "completed": 1, "failed": 0}
    assert failed == ["runner", "webhooks"]
    await receiver.wait(1)
    assert [e["data"]["id"] for e in receiver.effects] == [job["id"]]
    text = await (await client.get("/metrics")).text()
    for loop in ("jobs.runner", "jobs.webhooks"):
        assert metric(text, f'kvl_background_failures_total{{loop="{loop}"}}') == 1.0, loop


async def test_an_account_over_its_quota_does_not_hold_up_another_accounts_jobs(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    """One request a minute per account: the first account's job is refused (429
    rate_limit_exceeded) from its second item on, for a minute. Its items wait; the other
    account's job, created after it, runs meanwhile."""
    strict = make_settings(
        settings.data_dir, jobs=FAST_JOBS, classes={"s1": {"requests_per_minute": 1}}
    )
    store = Store(strict.db_path)
    other = store.create_key("other").plaintext
    store.close()
    app = create_app(strict)
    client: Client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    # More items than run at once, so that a runner stuck on this job has no free place.
    items = [text_item(str(i)) for i in range(2 * strict.jobs.max_concurrent_items + 1)]
    status, first = await create_job(client, api_key, {"requests": items})
    assert status == 202, first

    async def refused() -> bool:
        text = await (await client.get("/metrics")).text()
        return metric(text, 'kvl_quota_refusals_total{class="S1",quota="requests_per_minute"}') > 0

    await until(refused, timeout_s=60)
    status, second = await create_job(client, other, {"requests": [text_item("b")]})
    assert status == 202, second
    job = await wait_for(lambda: get_job(client, other, second["id"]), timeout_s=30)
    assert job["status"] == "completed", job
    assert job["progress"] == {"total": 1, "completed": 1, "failed": 0}
    # The first job waits its quota out: one item done (its one request of the minute), no
    # item failed for it.
    waiting = await get_job(client, api_key, first["id"])
    assert waiting["status"] == "running", waiting
    assert waiting["progress"] == {"total": len(items), "completed": 1, "failed": 0}
    cancelled = await client.delete(f"/v1/jobs/{first['id']}", headers=auth(api_key))
    assert cancelled.status == 200


async def test_a_full_queue_is_retried_not_the_items_result(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    """One slot, no queue: while a live request holds the slot, the job's item gets 429
    queue_full; it waits and runs once the slot is free."""
    strict = settings.model_copy(
        update={"model": settings.model.model_copy(update={"max_queue": 0, "n_slots": 1})}
    )
    app = create_app(strict)
    client: Client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    # The slow scripted model: the live request would hold its slot for 20 s.
    live = await client.post(
        "/v1/completions",
        headers=auth(api_key),
        json={
            "model": SLOW,
            "prompt": "1, 2, 3,",
            "max_tokens": 1000,
            "temperature": 0,
            "stream": True,
        },
    )
    assert live.status == 200
    await live.content.readline()  # it holds the slot
    item = text_item("a", model=SLOW)
    status, created = await create_job(client, api_key, {"requests": [item]})
    assert status == 202

    async def retried() -> bool:
        text = await (await client.get("/metrics")).text()
        return 'kvl_job_items_total{outcome="retried"}' in text

    await until(retried, timeout_s=60)
    live.close()  # the live request ends; its slot frees
    job = await wait_job(client, api_key, created["id"])
    assert job["progress"] == {"total": 1, "completed": 1, "failed": 0}
    [result] = (await results(client, api_key, job["id"]))["data"]
    assert result["status_code"] == 200
    assert len(job_usage(settings.db_path)) == 1


async def test_a_full_outbox_is_waited_out_however_long_not_the_items_result(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, api_key: str
) -> None:
    """While the outbox is full (the hub away too long) the job's item gets 503
    outbox_full: more tries than `jobs.item_max_attempts` allows for other 503s, and it
    still waits, then runs once the hub has drained the outbox."""
    quick = settings.model_copy(
        update={
            "jobs": settings.jobs.model_copy(
                update={"item_max_attempts": 1, "retry_initial_s": 0.05, "retry_max_s": 0.1}
            )
        }
    )
    app = create_app(quick)
    client: Client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    app[ADMISSION].outbox_full = True  # what the fleet link sets at the bound
    status, created = await create_job(client, api_key, {"requests": [text_item("a")]})
    assert status == 202

    async def retried_thrice() -> bool:
        text = await (await client.get("/metrics")).text()
        line = next(
            (
                x
                for x in text.splitlines()
                if x.startswith('kvl_job_items_total{outcome="retried"}')
            ),
            None,
        )
        return line is not None and float(line.split()[-1]) >= 3

    await until(retried_thrice, timeout_s=60)
    job = await (await client.get(f"/v1/jobs/{created['id']}", headers=auth(api_key))).json()
    assert job["status"] in {"queued", "running"}
    assert job["progress"]["completed"] == job["progress"]["failed"] == 0
    app[ADMISSION].outbox_full = False  # the hub acknowledged a batch
    job = await wait_job(client, api_key, created["id"])
    assert job["progress"] == {"total": 1, "completed": 1, "failed": 0}


# -- the state layer ---------------------------------------------------------------------------


@pytest.fixture
def job_store(tmp_path: Path) -> Iterator[JobStore]:
    store = Store(tmp_path / "appliance.db")
    store.create_key("alice")
    store.create_key("bob")
    yield JobStore(store.db)
    store.close()


def _account(jobs: JobStore, name: str) -> int:
    row = jobs.db.execute("SELECT id FROM accounts WHERE name = ?", [name]).fetchone()
    return int(row[0])


def _new(jobs: JobStore, n: int, webhook_url: str | None = None) -> str:
    items = [NewItem(str(i), "/v1/completions", {"model": MODEL, "prompt": "x"}) for i in range(n)]
    job = jobs.create(
        account_id=_account(jobs, "alice"),
        key_prefix="p",
        items=items,
        metadata={},
        webhook_url=webhook_url,
    )
    return job.id


def test_a_finished_item_is_never_handed_out_or_overwritten(job_store: JobStore) -> None:
    job_id = _new(job_store, 3, webhook_url="http://127.0.0.1:9/hook")
    assert [i.index for i in job_store.pending_items(10)] == [0, 1, 2]
    assert [i.index for i in job_store.pending_items(10, skip={(job_id, 0)})] == [1, 2]
    assert job_store.start(job_id)
    assert not job_store.start(job_id)
    assert job_store.finish_item(job_id, 0, 200, {"n": 1}).recorded
    assert not job_store.finish_item(job_id, 0, 200, {"n": 2}).recorded
    assert [i.index for i in job_store.pending_items(10)] == [1, 2]
    assert job_store.finish_item(job_id, 1, 400, {"error": {}}).ended is None
    outcome = job_store.finish_item(job_id, 2, 200, {"n": 3})
    assert outcome.ended is not None
    assert (outcome.ended.status, outcome.ended.completed, outcome.ended.failed) == (
        "completed",
        2,
        1,
    )
    assert outcome.ended.delivery is not None
    assert outcome.ended.delivery.event == "job.completed"
    assert job_store.pending_items(10) == []
    page, more = job_store.results(job_id, _account(job_store, "alice"), after=None, limit=10)
    assert [r.response for r in page] == [{"n": 1}, {"error": {}}, {"n": 3}]
    assert not more


def test_cancel_ends_a_job_once_and_only_for_its_account(job_store: JobStore) -> None:
    job_id = _new(job_store, 2)
    alice, bob = _account(job_store, "alice"), _account(job_store, "bob")
    with pytest.raises(JobNotFoundError):
        job_store.cancel(job_id, bob)
    with pytest.raises(JobNotFoundError):
        job_store.get(job_id, bob)
    job = job_store.cancel(job_id, alice)
    assert (job.status, job.delivery) == ("cancelled", None)  # no webhook_url, no delivery
    with pytest.raises(JobFinishedError):
        job_store.cancel(job_id, alice)
    assert job_store.pending_items(10) == []
    # An item in flight at the cancel that finishes anyway keeps its result; the job stays
    # cancelled.
    assert job_store.finish_item(job_id, 0, 200, {}).recorded
    assert job_store.get(job_id).status == "cancelled"


def test_a_job_is_made_with_all_its_items_or_not_at_all(job_store: JobStore) -> None:
    # Two items with one custom_id: the items' insert fails after the job's row was made.
    items = [NewItem("same", "/v1/completions", {"model": MODEL, "prompt": "x"})] * 2
    with pytest.raises(sqlite3.IntegrityError):
        job_store.create(
            account_id=_account(job_store, "alice"),
            key_prefix="p",
            items=items,
            metadata={},
            webhook_url="http://127.0.0.1:9/hook",
        )
    assert job_store.list_jobs(None, after=None, limit=10) == ([], False)
    assert job_store.pending_items(10) == []


def test_a_cancel_that_fails_midway_changes_nothing(
    job_store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _new(job_store, 2, webhook_url="http://127.0.0.1:9/hook")
    ended = job_store._end  # the step that fails

    def end_then_fail(*args: Any) -> None:
        ended(*args)  # the job ended and its delivery made, then:
        raise RuntimeError("the disk is full")

    monkeypatch.setattr(job_store, "_end", end_then_fail)
    with pytest.raises(RuntimeError):
        job_store.cancel(job_id, _account(job_store, "alice"))
    job = job_store.get(job_id)
    assert (job.status, job.ended_at, job.delivery) == ("queued", None, None)
    assert [i.index for i in job_store.pending_items(10)] == [0, 1]


def test_a_delivery_is_retried_until_its_deadline_then_given_up(job_store: JobStore) -> None:
    job_id = _new(job_store, 1, webhook_url="http://127.0.0.1:9/hook")
    delivery = job_store.finish_item(job_id, 0, 200, {}).ended.delivery  # type: ignore[union-attr]
    assert delivery is not None
    assert [d.id for d in job_store.due_deliveries(10)] == [delivery.id]
    assert job_store.due_deliveries(10, skip={delivery.id}) == []
    assert job_store.fix_payload(delivery.id, "first") == "first"
    assert job_store.fix_payload(delivery.id, "second") == "first"  # every retry, one body
    failed = job_store.delivery_attempted(
        delivery.id, status_code=500, error="HTTP 500", delivered=False, retry_s=60, backoff_s=1e6
    )
    assert failed.status == "pending"
    assert failed.first_attempt_at is not None
    # The backoff would overshoot the deadline: the last try falls on it.
    assert failed.next_attempt_at == pytest.approx(failed.first_attempt_at + 60)
    assert job_store.due_deliveries(10) == []
    assert job_store.next_delivery_at() == failed.next_attempt_at
    gave_up = job_store.delivery_attempted(
        delivery.id, status_code=None, error="refused", delivered=False, retry_s=0, backoff_s=1
    )
    assert (gave_up.status, gave_up.attempts, gave_up.next_attempt_at) == ("failed", 2, None)
    assert job_store.next_delivery_at() is None


def test_a_rotated_secret_signs_beside_the_new_one_for_its_grace(job_store: JobStore) -> None:
    first = job_store.webhook_secret("alice")
    assert first.startswith("whsec_")
    assert job_store.webhook_secret("alice") == first
    second = job_store.webhook_secret("alice", rotate=True, grace_s=60)
    assert second != first
    signing = job_store.signing_secrets(_account(job_store, "alice"))
    assert (signing.current, signing.previous) == (second, (first,))
    third = job_store.webhook_secret("alice", rotate=True, grace_s=0)
    signing = job_store.signing_secrets(_account(job_store, "alice"))
    assert (signing.current, signing.previous) == (third, ())
    with pytest.raises(NotFoundError):
        job_store.webhook_secret("nobody")


def test_the_cli_shows_and_rotates_an_accounts_webhook_secret(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path)]
    kvl("appliance", "keys", "create", "--account", "alice", *data)
    secret = ["appliance", "accounts", "webhook-secret", "--account", "alice", *data]
    shown = kvl(*secret).stdout.strip()
    assert shown.startswith("whsec_")
    assert kvl(*secret).stdout.strip() == shown
    rotated = kvl(*secret, "--rotate")
    assert rotated.stdout.strip() not in {"", shown}
    assert "previous secret" in rotated.stderr
    missing = kvl(
        "appliance", "accounts", "webhook-secret", "--account", "nobody", *data, check=False
    )
    assert missing.returncode == 1
    assert "no account 'nobody'" in missing.stderr


# -- a real appliance, killed ------------------------------------------------------------------


def _items_done(db_path: Path, job_id: str) -> dict[int, tuple[float, str]]:
    with closing(sqlite3.connect(db_path)) as db:
        rows = db.execute(
            "SELECT idx, ended_at, response FROM job_items"
            " WHERE job_id = ? AND status IN ('completed', 'failed')",
            [job_id],
        ).fetchall()
    return {idx: (ended, response) for idx, ended, response in rows}


async def start_appliance(
    data_dir: Path, env: dict[str, str], log: IO[bytes]
) -> tuple[subprocess.Popen[bytes], str]:
    """`kvl appliance serve` on a free loopback port, once ready (waited for off the loop)."""
    port = free_port()
    process = spawn_appliance(data_dir, port, env, log)
    base_url = f"http://127.0.0.1:{port}"
    await asyncio.to_thread(wait_ready, base_url, process)
    return process, base_url


async def fetch_json(http: ClientSession, path: str) -> dict[str, Any]:
    async with http.get(path) as response:
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def test_a_job_survives_kill_9_and_completes_each_item_once(
    tmp_path: Path, slow_model: ModelRecord, receiver: Receiver
) -> None:
    data_dir = tmp_path / "appliance"
    store = Store(data_dir / "appliance.db")
    # The slow scripted model: an item takes most of a second, so the job is mid-way when
    # the appliance is killed (the jobs' durability is the subject, not the model).
    store.add_model(slow_model)
    store.close()
    data = ["--data-dir", str(data_dir)]
    key = kvl("appliance", "keys", "create", "--account", "batch", *data).stdout.strip()
    receiver.secret = kvl(
        "appliance", "accounts", "webhook-secret", "--account", "batch", *data
    ).stdout.strip()
    env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_MODEL__DEFAULT": SLOW,
        "KVL_MODEL__CHAT_DEFAULT": SLOW,
        "KVL_MODEL__N_CTX": "2048",
        "KVL_JOBS__WEBHOOK_BACKOFF_INITIAL_S": "0.1",
        "KVL_JOBS__WEBHOOK_BACKOFF_MAX_S": "1",
        "KVL_JOBS__WEBHOOK_ALLOW": '["127.0.0.1/8"]',  # the receiver is on loopback
    }
    db_path = data_dir / "appliance.db"
    total = 8
    items = [
        text_item(str(i), prompt=f"{i}, {i + 1}, {i + 2},", max_tokens=32, model=SLOW)
        for i in range(total)
    ]
    with (data_dir / "serve.log").open("ab") as log:
        process, base_url = await start_appliance(data_dir, env, log)
        try:
            async with ClientSession(base_url, headers=auth(key)) as http:
                async with http.post(
                    "/v1/jobs", json={"requests": items, "webhook_url": receiver.url}
                ) as response:
                    assert response.status == 202, await response.text()
                    job_id = (await response.json())["id"]

                async def one_done() -> bool:
                    return bool(_items_done(db_path, job_id))

                await until(one_done, timeout_s=120)
            process.send_signal(signal.SIGKILL)
            await asyncio.to_thread(process.wait)
            before = _items_done(db_path, job_id)
            assert 0 < len(before) < total, "the job must be mid-way when the appliance dies"
            assert not receiver.requests

            process, base_url = await start_appliance(data_dir, env, log)  # the same data
            async with ClientSession(base_url, headers=auth(key)) as http:
                job = await wait_for(lambda: fetch_json(http, f"/v1/jobs/{job_id}"), timeout_s=180)
                page = await fetch_json(http, f"/v1/jobs/{job_id}/results")
                # The webhook goes out after the job completes: wait for it while the
                # appliance that sends it still runs, not after it has been stopped.
                await receiver.wait(1)
        finally:
            process.terminate()
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)
    assert job["status"] == "completed", job
    assert job["progress"] == {"total": total, "completed": total, "failed": 0}
    assert [r["custom_id"] for r in page["data"]] == [str(i) for i in range(total)]
    assert {r["status_code"] for r in page["data"]} == {200}
    after = _items_done(db_path, job_id)
    for index, result in before.items():
        assert after[index] == result, "an item finished before the kill never runs again"
    # Each item charged exactly once, however often it started.
    usage = job_usage(db_path)
    assert len(usage) == total
    assert {u["status"] for u in usage} == {200}
    [event] = receiver.effects
    assert not receiver.refused
    assert (event["type"], event["data"]["id"]) == ("job.completed", job_id)
    assert event["data"]["progress"]["completed"] == total
