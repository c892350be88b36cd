"""Burst offload end to end: a real hub and two real appliances on loopback (no tunnel).
Appliance A has one batch slot and no queue; while a long request holds it, the next
one it would shed goes through the hub to appliance B, and the client sees one normal
answer naming B. Charged once (B's usage event, none at A); never offloaded twice (B
full as well: the client gets the fleet's 429)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from appliance.app import FLEET
from appliance.gateway.appkeys import CERTIFICATE, NODE_ID, STORE, TRACING
from appliance.state.records import ModelRecord
from hub.app import create_app as create_hub
from hub.appkeys import TRACING as HUB_TRACING
from hub.identity import ssl_context
from hub.planning.offload import NodeLoad, candidates
from hub.settings import HubSettings
from hub.state.store import open_store
from shared import tls
from tests.appliance.fleet_nodes import join
from tests.budget import tries
from tests.conftest import SLOW
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from opentelemetry.proto.trace.v1.trace_pb2 import Span
    from pytest_aiohttp import AiohttpServer

MODEL = SLOW


# -- the hub's choice (pure) ---------------------------------------------------------------


def _load(node: str, queue: int = 0, cpu: float = 10.0, seen: float | None = 100.0) -> NodeLoad:
    return NodeLoad(node, node, (f"{MODEL}@1.0.0",), queue, cpu, 1000, seen)


def test_the_node_with_most_headroom_first_never_the_origin_never_twice() -> None:
    nodes = [_load("a"), _load("b", queue=3), _load("c", queue=1), _load("d", cpu=1.0, queue=3)]
    order = candidates(nodes, model=MODEL, origin="a", offloaded=False, now=110, stale_after_s=45)
    assert [n.id for n in order] == ["c", "d", "b"]
    assert (
        candidates(nodes, model=MODEL, origin="a", offloaded=True, now=110, stale_after_s=45) == []
    )
    # Stale, never seen, or serving another model: not a candidate.
    others = [_load("e", seen=10.0), _load("f", seen=None),
              NodeLoad("g", "g", ("other@1",), 0, 0.0, 1000, 100.0)]  # fmt: skip
    assert candidates(others, model=MODEL, origin="a", offloaded=False, now=110,
                      stale_after_s=45) == []  # fmt: skip
    # A version named must be served.
    assert candidates([_load("b")], model=f"{MODEL}@2.0.0", origin="a", offloaded=False,
                      now=110, stale_after_s=45) == []  # fmt: skip


_NODES = st.lists(
    st.builds(
        NodeLoad,
        id=st.sampled_from("abcdefgh"),
        name=st.just("n"),
        models=st.sampled_from([(f"{MODEL}@1.0.0",), ("other@1",), (), (f"{MODEL}@2.0.0",)]),
        queue_waiting=st.integers(0, 10),
        cpu_percent=st.floats(0, 100),
        memory_available_mib=st.integers(0, 10_000),
        last_seen=st.one_of(st.none(), st.floats(0, 200)),
        revoked=st.booleans(),
        reachable=st.booleans(),
    ),
    max_size=12,
)


@settings(max_examples=tries(300), deadline=None)
@given(nodes=_NODES, origin=st.sampled_from("abcdefgh"), offloaded=st.booleans(),
       model=st.sampled_from([MODEL, f"{MODEL}@1.0.0", "other"]))  # fmt: skip
def test_offload_never_loops_and_only_goes_where_it_can_be_served(
    nodes: list[NodeLoad], origin: str, offloaded: bool, model: str
) -> None:
    chosen = candidates(
        nodes, model=model, origin=origin, offloaded=offloaded, now=200, stale_after_s=45
    )
    if offloaded:
        assert chosen == []  # one hop at most: a request offloaded once stays where it is
    for node in chosen:
        assert node.id != origin
        assert not node.revoked
        assert node.reachable
        assert node.last_seen is not None
        assert 200 - node.last_seen < 45
        assert any(ref == model or ref.split("@")[0] == model for ref in node.models)
    keys = [(n.queue_waiting, n.cpu_percent, -n.memory_available_mib) for n in chosen]
    assert keys == sorted(keys)  # the most headroom first


# -- end to end ----------------------------------------------------------------------------


async def _appliance(
    aiohttp_server: AiohttpServer,
    tmp_path: Path,
    slow_model: ModelRecord,
    hub: HubSettings,
    hub_port: int,
    *,
    name: str,
    sections: dict[str, Any] | None = None,
) -> tuple[web.Application, str, str]:
    """A node with one slot and no queue; (app, base URL, a LAN key)."""
    one_slot = {"n_slots": 1, "max_queue": 0, "n_threads": 1, "n_ctx": 1024}
    node = await join(
        aiohttp_server, tmp_path, slow_model, hub, hub_port, name=name, model=one_slot,
        sections=sections,
    )  # fmt: skip
    return node.app, node.base_url, node.key


async def _ready_in_fleet(hub: HubSettings, names: set[str]) -> None:
    """Until the hub has heard from every node with its model loaded, taking offloaded requests."""
    for _ in range(300):
        store = open_store(hub)
        try:
            ready = {
                n.name
                for n in store.nodes.all()
                if n.capacity.models and n.fleet_url and n.capacity.offload
            }
        finally:
            store.close()
        if names <= ready:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the nodes {names} did not report in")


async def _hold(session: aiohttp.ClientSession, base: str, key: str) -> aiohttp.ClientResponse:
    """A long streamed request that holds the appliance's only slot."""
    response = await session.post(
        f"{base}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 400, "stream": True,
              "temperature": 0},
    )  # fmt: skip
    assert response.status == 200
    await response.content.readline()  # the first chunk: it holds the slot
    return response


async def test_an_overloaded_node_offloads_to_a_peer_with_room(
    aiohttp_server: AiohttpServer, tmp_path: Path, slow_model: ModelRecord
) -> None:
    hub = settings_for(tmp_path)
    hub_server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    assert hub_server.port is not None
    a, a_url, a_key = await _appliance(
        aiohttp_server, tmp_path, slow_model, hub, hub_server.port, name="node-a"
    )
    b, b_url, b_key = await _appliance(
        aiohttp_server, tmp_path, slow_model, hub, hub_server.port, name="node-b"
    )
    await _ready_in_fleet(hub, {"node-a", "node-b"})
    ask = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    # A fleet key (made on the hub, known to every node by its hash): what an offloaded
    # request runs as on the node that serves it. A node's own LAN key stays on that node.
    store = open_store(hub)
    try:
        fleet_key = store.accounts.create_key("lan-user").plaintext
    finally:
        store.close()

    async with aiohttp.ClientSession() as session:
        for url in (a_url, b_url):  # until both nodes pulled the state with the key
            for _ in range(300):
                models = await session.get(
                    f"{url}/v1/models", headers={"Authorization": f"Bearer {fleet_key}"}
                )
                if models.status == 200:
                    break
                await asyncio.sleep(0.1)
        holding = await _hold(session, a_url, a_key)
        # A node's own key is not the fleet's: with A full, its local refusal stands.
        mine = await session.post(
            f"{a_url}/v1/completions", headers={"Authorization": f"Bearer {a_key}"}, json=ask
        )
        assert mine.status == 429, await mine.text()
        assert "X-Kvl-Served-By" not in mine.headers
        a_key = fleet_key
        # A has no room: the request is served by B, through the hub, in one answer.
        answer = await session.post(
            f"{a_url}/v1/completions", headers={"Authorization": f"Bearer {a_key}"}, json=ask
        )
        body = await answer.json()
        assert answer.status == 200, body
        assert answer.headers["X-Kvl-Served-By"] == "node-b"
        assert body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] > 0
        # Streamed too: the events pass through both hops.
        streamed = await session.post(
            f"{a_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {a_key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4, "stream": True},
        )  # fmt: skip
        assert streamed.status == 200
        assert streamed.headers["X-Kvl-Served-By"] == "node-b"
        text = await streamed.text()
        assert text.rstrip().endswith("data: [DONE]")

        # B full as well: the fleet has no room, the client gets 429 with Retry-After, and
        # B never sends the request anywhere else.
        holding_b = await _hold(session, b_url, b_key)
        refused = await session.post(
            f"{a_url}/v1/completions", headers={"Authorization": f"Bearer {a_key}"}, json=ask
        )
        error = (await refused.json())["error"]
        assert refused.status == 429, error
        assert error["code"] == "overloaded"
        assert "node-b" in error["message"]
        assert float(refused.headers["Retry-After"]) > 0
        holding.close()
        holding_b.close()

        # Offloaded requests come from the hub only, over mutual TLS on B's fleet
        # listener: on the LAN API, even with a fleet key, they are refused.
        forged = await session.post(
            f"{b_url}/v1/offloaded/completions",
            headers={"Authorization": f"Bearer {fleet_key}", "X-Kvl-Account": "x",
                     "X-Kvl-Class": "S1"},
            json=ask,
        )  # fmt: skip
        assert forged.status == 401
        assert (await forged.json())["error"]["code"] == "client_certificate_required"
        # The fleet listener: no handshake without a certificate of the fleet, and node A's
        # certificate is not the hub's.
        listener = f"https://127.0.0.1:{b[FLEET].fleet_port}/v1/offloaded/completions"
        trust = b[CERTIFICATE].trust()
        assert trust is not None
        with pytest.raises(aiohttp.ClientError):
            await session.post(listener, json=ask, ssl=tls.client_context(trust))
        as_a = tls.client_context(trust, a[CERTIFICATE].files)
        impostor = await session.post(
            listener, json=ask, ssl=as_a, headers={"Authorization": f"Bearer {fleet_key}"}
        )
        assert impostor.status == 403
        assert (await impostor.json())["error"]["code"] == "certificate_mismatch"

    # Charged once: the two offloaded requests are B's usage, under A's account name.
    def usage(app: web.Application) -> list[Any]:
        store = app[STORE].sync
        return [
            tuple(r)
            for r in store.db.execute(
                "SELECT a.name, e.route FROM usage_events e JOIN accounts a"
                " ON a.id = e.account_id WHERE e.status = 200"
            ).fetchall()
        ]

    served = [
        ("lan-user", "/v1/offloaded/chat/completions"),
        ("lan-user", "/v1/offloaded/completions"),
    ]
    await until(lambda: sorted(usage(b)) == served, "B's usage of the two offloaded requests")
    assert usage(a) == []  # A served nothing to completion (its held streams were cut)


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_an_offloaded_request_is_one_trace_through_both_nodes_and_the_hub(
    aiohttp_server: AiohttpServer, tmp_path: Path, slow_model: ModelRecord
) -> None:
    """Both appliances and the hub export to one real OTLP/HTTP receiver (protobuf, as a
    collector gets it). A client's request with its own `traceparent`, offloaded: one
    trace, client → A's server span → A's offload span → the hub's span → B's spans."""
    received: list[tuple[dict[str, str], Span]] = []  # (resource attributes, span)

    async def traces(request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                received.extend((resource, span) for span in scope.spans)
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/traces", traces)
    otlp = await aiohttp_server(collector)
    traced = {"tracing": {"otlp_endpoint": str(otlp.make_url("/v1/traces"))}}
    hub = settings_for(tmp_path, **traced)
    hub_app = create_hub(hub)
    hub_server = await aiohttp_server(hub_app, ssl=ssl_context(hub))
    assert hub_server.port is not None
    a, a_url, a_key = await _appliance(
        aiohttp_server, tmp_path, slow_model, hub, hub_server.port, name="node-a",
        sections=traced,
    )  # fmt: skip
    b, b_url, _ = await _appliance(
        aiohttp_server, tmp_path, slow_model, hub, hub_server.port, name="node-b",
        sections=traced,
    )  # fmt: skip
    await _ready_in_fleet(hub, {"node-a", "node-b"})
    store = open_store(hub)
    try:
        fleet_key = store.accounts.create_key("lan-user").plaintext
    finally:
        store.close()
    async with aiohttp.ClientSession() as session:
        # Until both nodes pulled the state with the key: B, which serves the request with
        # the client's key, refuses a key it does not hold yet.
        for url in (a_url, b_url):
            for _ in range(300):
                models = await session.get(
                    f"{url}/v1/models", headers={"Authorization": f"Bearer {fleet_key}"}
                )
                if models.status == 200:
                    break
                await asyncio.sleep(0.1)
        holding = await _hold(session, a_url, a_key)
        answer = await session.post(
            f"{a_url}/v1/completions",
            headers={"Authorization": f"Bearer {fleet_key}", "traceparent": TRACEPARENT},
            json={"model": MODEL, "prompt": "Once", "max_tokens": 4, "temperature": 0},
        )
        assert answer.status == 200, await answer.text()
        assert answer.headers["X-Kvl-Served-By"] == "node-b"
        await answer.read()
        holding.close()

    trace_id = bytes.fromhex(TRACEPARENT.split("-")[1])
    for tracing in (a[TRACING], b[TRACING], hub_app[HUB_TRACING]):
        # In a thread: the exporter posts to the receiver, which runs on this loop.
        assert await asyncio.to_thread(tracing.flush)

    def ours(span: Span) -> bool:
        return span.trace_id == trace_id

    for _ in range(100):
        names = {s.name for _, s in received if ours(s)}
        if {"hub.offload", "POST /v1/offloaded/completions", "worker"} <= names:
            break
        await asyncio.sleep(0.05)
    a_id, b_id = a[NODE_ID], b[NODE_ID]

    def one(service: str, name: str, instance: str | None = None) -> Span:
        found = [
            s
            for r, s in received
            if ours(s) and s.name == name and r["service.name"] == service
            and instance in {None, r.get("service.instance.id")}
        ]  # fmt: skip
        assert len(found) == 1, (service, name, [s.name for _, s in received if ours(s)])
        return found[0]

    a_server = one("kovenlab-appliance", "POST /v1/completions", a_id)
    a_offload = one("kovenlab-appliance", "offload", a_id)
    hub_span = one("kovenlab-hub", "hub.offload")
    b_server = one("kovenlab-appliance", "POST /v1/offloaded/completions", b_id)
    assert a_server.parent_span_id.hex() == TRACEPARENT.split("-")[2]  # the client's
    assert a_offload.parent_span_id == a_server.span_id
    assert hub_span.parent_span_id == a_offload.span_id
    assert b_server.parent_span_id == hub_span.span_id
    assert b_server.kind == b_server.SPAN_KIND_SERVER
    assert hub_span.kind == hub_span.SPAN_KIND_SERVER
    assert a_offload.kind == a_offload.SPAN_KIND_CLIENT
    hub_attributes = {x.key: x.value.string_value for x in hub_span.attributes}
    assert hub_attributes["kvl.served_by"] == "node-b"
    # Every span the hub made is of the client's trace (it had no other request), and so
    # is every span of B's but those of the key polls before: B's stages hang off its
    # server span, in the client's trace.
    assert all(ours(s) for r, s in received if r["service.name"] == "kovenlab-hub")
    polls = {s.trace_id for r, s in received if s.name == "GET /v1/models"}
    b_spans = [s for r, s in received if r.get("service.instance.id") == b_id]
    assert all(ours(s) for s in b_spans if s.trace_id not in polls)
    b_children = {s.name for s in b_spans if s.parent_span_id == b_server.span_id}
    assert {"auth", "admission", "worker"} <= b_children, b_children
