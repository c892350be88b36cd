"""Releases and staged rollouts at the hub, end to end on a real hub (aiohttp on loopback,
its rollout loop every 50 ms) on both stores: releases uploaded over the operator API, a
rollout reaching its canary, then its waves, only as the nodes' heartbeats report the new
version good; a rollback halting it with the reason, the nodes not yet reached never
getting the target; abort giving the nodes reached their previous release; a model
rollout moving a deployment's placements one node at a time; and every wrong request a
4xx that changes nothing.

The nodes here are the test's own HubClients speaking protocol 6 (their heartbeats say
what a node's updater would: the hub judges only what heartbeats report); the appliance's
side of a release (fetch, install) is tested in tests/appliance/test_release.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from wireguard_tools import WireguardKey

from appliance.fleet.client import HubClient
from hub.app import create_app
from hub.identity import certificates, ssl_context
from hub.planning.rollout import Strategy
from hub.rollouts import begin, burn_rates, evaluate
from hub.settings import HubSettings
from hub.state.deployments import DeploymentRecord, ModelArtifact
from hub.state.nodes import Heartbeat
from hub.state.store import HubStore, open_store
from shared import pki, protocol
from tests.conftest import kvl
from tests.hub.backups import fresh_database, hub_cli
from tests.hubs import settings_for
from tests.releases import speak_releases
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase


def _settings(tmp_path: Path, database: HubDatabase) -> HubSettings:
    return settings_for(
        tmp_path, database, fleet={"rollout_every_s": 0.05, "placement_every_s": 0.1}
    )


def _enroll(store: HubStore, name: str, site: str) -> str:
    token = store.tokens.create(site, uses=1, expires_in_s=60).plaintext
    key = str(WireguardKey.generate().public_key())
    return store.nodes.enroll(token, name=name, wg_public_key=key, overlay_prefix="100.64.0.0/10",
                        labels={}, versions={}).node_token  # fmt: skip


class Fleet:
    """A hub on loopback, its operator token, and nodes that heartbeat what they're told."""

    def __init__(self, settings: HubSettings, base: str, pin: aiohttp.Fingerprint) -> None:
        self.settings = settings
        self.base = base
        self.pin = pin
        self.operator = ""
        self.tokens: dict[str, str] = {}  # each node's node token, by name
        self.nodes: dict[str, HubClient] = {}

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.operator}"}
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.base + path, headers=headers, ssl=self.pin, **kw) as r,
        ):
            body = await r.read()
            return r.status, json.loads(body) if body else None

    async def as_old_node(
        self, name: str, version: int, method: str, path: str, **kw: Any
    ) -> tuple[int, Any]:
        """A call of node `name` speaking protocol `version` (as an older node would)."""
        headers = {
            "Authorization": f"Bearer {self.tokens[name]}",
            protocol.PROTOCOL_HEADER: str(version),
        }
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.base + path, headers=headers, ssl=self.pin, **kw) as r,
        ):
            return r.status, await r.json()

    async def beat(self, name: str, **capacity: Any) -> None:
        await self.nodes[name].heartbeat({}, protocol.Capacity(**capacity))

    async def release_of(self, name: str) -> str | None:
        state = await self.nodes[name].state(-1)
        assert state is not None
        return None if state.release is None else state.release.version

    async def rollout(self, rollout_id: str) -> dict[str, Any]:
        status, view = await self.call("GET", f"/v1/admin/rollouts/{rollout_id}")
        assert status == 200, view
        return view  # type: ignore[no-any-return]

    def node_state(self, view: dict[str, Any], name: str) -> str:
        return next(str(n["state"]) for w in view["waves"] for n in w["nodes"] if n["name"] == name)


def _image(
    version: str, state: protocol.ImageState = "good", target: str | None = None
) -> protocol.ImageStatus:
    return protocol.ImageStatus(version=version, slot="rootfs.0", state=state, target=target)


@pytest.fixture
async def fleet(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> AsyncIterator[Fleet]:
    settings = _settings(tmp_path, hub_database)
    data = str(settings.data_dir)
    operator = kvl("hub", "operators", "create", "--name", "ops", "--data-dir", data)
    store = open_store(settings)
    tokens = {name: _enroll(store, name, site)
              for name, site in (("n1", "north"), ("n2", "north"), ("n3", "south"),
                                 ("n4", "south"))}  # fmt: skip
    store.close()
    server = await aiohttp_server(create_app(settings), ssl=ssl_context(settings))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(settings)[1].fingerprint))
    fleet = Fleet(settings, f"https://127.0.0.1:{server.port}", pin)
    fleet.operator = operator.stdout.strip()
    fleet.tokens = tokens
    fleet.nodes = {name: HubClient(fleet.base, pin, token) for name, token in tokens.items()}
    try:
        yield fleet
    finally:
        for client in fleet.nodes.values():
            await client.close()


async def test_a_release_rolls_out_wave_by_wave_halts_on_a_rollback_and_aborts_back(
    fleet: Fleet,
) -> None:
    bundles = {v: f"bundle {v} ".encode() * 1000 for v in ("1.0", "1.1")}
    for version, bundle in bundles.items():
        status, body = await fleet.call(
            "POST", f"/v1/admin/releases?version={version}&notes=n{version}", data=bundle
        )
        assert status == 201, body
        assert body["sha256"] == hashlib.sha256(bundle).hexdigest()
    # The same version twice, a version that is not one, a query the route does not know.
    for query, code in (("version=1.1", "rollout_conflict"), ("version=../x", "invalid_value"),
                        ("version=2&x=1", "invalid_value")):  # fmt: skip
        status, body = await fleet.call("POST", f"/v1/admin/releases?{query}", data=b"x")
        assert (status, body["error"]["code"]) == (409 if "conflict" in code else 400, code)
    status, listed = await fleet.call("GET", "/v1/admin/releases")
    assert sorted(r["version"] for r in listed["data"]) == ["1.0", "1.1"]

    for name in fleet.nodes:
        await fleet.beat(name, image=_image("1.0"))
    await until(lambda: speak_releases(fleet.settings), "every node's heartbeat stored")

    strategy = {"canary": 1, "waves": [50, 100], "soak_s": 0, "max_unavailable": 1,
                "max_burn_rate": None}  # fmt: skip
    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts", json={"kind": "release", "release": "1.1",
                                            "strategy": strategy})  # fmt: skip
    assert status == 201, view
    rollout_id = view["id"]
    assert [[n["name"] for n in w["nodes"]] for w in view["waves"]] == [
        ["n1"],
        ["n2"],
        ["n3", "n4"],
    ]
    # A second release rollout while this one runs: refused.
    status, body = await fleet.call(
        "POST", "/v1/admin/rollouts", json={"kind": "release", "release": "1.0"}
    )
    assert (status, body["error"]["code"]) == (409, "rollout_conflict")

    await until(lambda: _targets(fleet, "n1", "1.1"), "the canary given 1.1")
    assert await fleet.release_of("n2") is None
    sha = hashlib.sha256(bundles["1.1"]).hexdigest()
    # The canary fetches the bundle, resumably; a node not reached cannot.
    response = await fleet.nodes["n1"].artifact(sha, 100)
    assert (response.status, await response.read()) == (206, bundles["1.1"][100:])
    response.release()
    response = await fleet.nodes["n2"].artifact(sha)
    assert response.status == 404
    response.release()

    # The canary installs (still running 1.0): the rollout waits on it.
    await fleet.beat("n1", image=_image("1.0", "installed-pending-reboot", "1.1"))
    view = await fleet.rollout(rollout_id)
    assert (view["phase"], fleet.node_state(view, "n1")) == ("canary", "targeted")
    await fleet.beat("n1", image=_image("1.1", "good", "1.1"))
    await until(lambda: _targets(fleet, "n2", "1.1"), "wave 1 reached once the canary is good")

    await fleet.beat("n2", image=_image("1.0", "rolled-back", "1.1").model_copy(
        update={"error": "booted the previous image (1.0) again"}))  # fmt: skip
    view = await until(lambda: _halted(fleet, rollout_id), "the rollout halted")
    assert "node n2: rolled back" in view["reason"]
    assert "booted the previous image" in view["reason"]
    assert (fleet.node_state(view, "n2"), view["phase"]) == ("failed", "halted at wave 1")
    for name in ("n3", "n4"):
        assert await fleet.release_of(name) is None
    status, body = await fleet.call("POST", f"/v1/admin/rollouts/{rollout_id}/pause")
    assert (status, body["error"]["code"]) == (409, "rollout_conflict")

    # Abort: the nodes reached get the release they ran before, the others nothing.
    status, view = await fleet.call("POST", f"/v1/admin/rollouts/{rollout_id}/abort")
    assert (status, view["state"]) == (200, "rolling-back"), view
    assert await fleet.release_of("n1") == "1.0"
    assert await fleet.release_of("n2") == "1.0"
    assert await fleet.release_of("n3") is None
    await fleet.beat("n1", image=_image("1.0", "good", "1.0"))
    await fleet.beat("n2", image=_image("1.0", "good", "1.0"))
    await until(lambda: _state_is(fleet, rollout_id, "aborted"), "aborted once the nodes are back")
    status, body = await fleet.call("POST", f"/v1/admin/rollouts/{rollout_id}/resume")
    assert (status, body["error"]["code"]) == (409, "rollout_conflict")


async def _targets(fleet: Fleet, name: str, version: str) -> bool:
    return await fleet.release_of(name) == version


async def _halted(fleet: Fleet, rollout_id: str) -> dict[str, Any] | None:
    view = await fleet.rollout(rollout_id)
    return view if view["state"] == "halted" else None


async def _state_is(fleet: Fleet, rollout_id: str, state: str) -> bool:
    return bool((await fleet.rollout(rollout_id))["state"] == state)


async def test_a_node_without_an_updater_halts_the_release_at_once(fleet: Fleet) -> None:
    status, body = await fleet.call("POST", "/v1/admin/releases?version=2.0", data=b"b" * 10)
    assert status == 201, body
    for name in fleet.nodes:
        await fleet.beat(name)
    await until(lambda: speak_releases(fleet.settings), "every node's heartbeat stored")
    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "release", "release": "2.0",
              "strategy": {"canary_nodes": ["n3"], "max_burn_rate": None}},
    )  # fmt: skip
    assert status == 201, view
    await until(lambda: _targets(fleet, "n3", "2.0"), "the named canary given 2.0")
    await fleet.beat("n3", release_error="this node has no image updater")
    view = await until(lambda: _halted(fleet, view["id"]), "the rollout halted")
    assert "node n3: failed to update: this node has no image updater" in view["reason"]
    # Resumed: the node is judged again, and halts it again while it says the same.
    status, view = await fleet.call("POST", f"/v1/admin/rollouts/{view['id']}/resume")
    # The answer is the rollout just after the resume: running, or halted again already
    # when a round of the loop (every 0.05 s here) judged the node before it was read.
    assert status == 200, view
    assert view["state"] in {"running", "halted"}, view
    await until(lambda: _halted(fleet, view["id"]), "halted again")


async def _aborted_after_the_canary(fleet: Fleet) -> str:
    """A release rollout of 1.1 over the fleet (every node on 1.0) that reached its canary,
    n1, which installed 1.1 and said so; then aborted: the rollout's id."""
    store = open_store(fleet.settings)
    for version in ("1.0", "1.1", "1.2"):
        store.rollouts.add_release(version, "", version[-1] * 64, 10)
    store.close()
    for name in fleet.nodes:
        await fleet.beat(name, image=_image("1.0"))
    await until(lambda: speak_releases(fleet.settings), "every node's heartbeat stored")
    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "release", "release": "1.1",
              "strategy": {"canary_nodes": ["n1"], "soak_s": 3600, "max_burn_rate": None}},
    )  # fmt: skip
    assert status == 201, view
    await until(lambda: _targets(fleet, "n1", "1.1"), "the canary given 1.1")
    await fleet.beat("n1", image=_image("1.1", "good", "1.1"))
    await until(lambda: _stored_image(fleet.settings, "n1") == "1.1", "n1's 1.1 stored")
    status, view = await fleet.call("POST", f"/v1/admin/rollouts/{view['id']}/abort")
    assert (status, view["state"]) == (200, "rolling-back"), view
    assert await fleet.release_of("n1") == "1.0"
    return str(view["id"])


def _stored_image(settings: HubSettings, name: str) -> str | None:
    """The version a node's last heartbeat, as stored, said it runs."""
    store = open_store(settings)
    try:
        node = next(n for n in store.nodes.all() if n.name == name)
        return None if node.capacity.image is None else node.capacity.image.version
    finally:
        store.close()


def _silence(settings: HubSettings, name: str, for_s: float) -> None:
    """Time passing for a node that went quiet: its last heartbeat, as stored, made `for_s`
    older (the hub's loop reads the clock; the node's silence is what the test moves)."""
    store = open_store(settings)
    try:
        node = next(n for n in store.nodes.all() if n.name == name)
        assert node.last_seen is not None
        store.nodes.record_heartbeats(
            [Heartbeat(node.id, node.last_seen - for_s, node.versions, node.capacity)]
        )
    finally:
        store.close()


def _member(view: dict[str, Any], name: str) -> dict[str, Any]:
    return next(n for w in view["waves"] for n in w["nodes"] if n["name"] == name)


async def test_a_rollback_ends_without_an_offline_node_which_returns_to_the_fleets_release(
    fleet: Fleet,
) -> None:
    rollout_id = await _aborted_after_the_canary(fleet)
    # n1 never reports 1.0 back, and goes quiet. While the fleet still counts it online the
    # rollback waits for it, and no release rollout can start.
    view = await fleet.rollout(rollout_id)
    assert (view["state"], _member(view, "n1")["status"]) == ("rolling-back", "online")
    status, body = await fleet.call(
        "POST", "/v1/admin/rollouts", json={"kind": "release", "release": "1.2"}
    )
    assert (status, body["error"]["code"]) == (409, "rollout_conflict")
    assert "finish it" in body["error"]["message"]

    # Silent for the fleet's offline window (`fleet.offline_after_s`): the rollback ends
    # by itself, and n1 is recorded as never having confirmed.
    _silence(fleet.settings, "n1", fleet.settings.fleet.offline_after_s)
    await until(lambda: _state_is(fleet, rollout_id, "aborted"), "the rollback over without n1")
    view = await fleet.rollout(rollout_id)
    n1 = _member(view, "n1")
    assert (n1["state"], n1["status"]) == ("unconfirmed", "offline")
    assert n1["note"].startswith("never confirmed: offline, not heard for ")
    assert view["reason"] == "aborted by ops; never confirmed (offline): n1"
    assert [_member(view, n)["state"] for n in ("n2", "n3", "n4")] == ["waiting"] * 3

    # n1 returns, still running the aborted 1.1: it is told 1.0, what the fleet runs.
    await fleet.beat("n1", image=_image("1.1", "good", "1.1"))
    assert await fleet.release_of("n1") == "1.0"
    assert (await fleet.rollout(rollout_id))["state"] == "aborted"
    # And the next release rollout starts.
    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts", json={"kind": "release", "release": "1.2"}
    )
    assert status == 201, view


async def test_finish_ends_a_rollback_and_records_the_nodes_that_never_confirmed(
    fleet: Fleet,
) -> None:
    rollout_id = await _aborted_after_the_canary(fleet)
    # n1 stays online, and keeps saying it runs 1.1: the rollback would wait forever.
    await fleet.beat("n1", image=_image("1.1", "good", "1.1"))
    status, view = await fleet.call("POST", f"/v1/admin/rollouts/{rollout_id}/finish")
    assert (status, view["state"]) == (200, "aborted"), view
    assert view["reason"] == "aborted by ops; rollback finished by ops; never confirmed: n1"
    n1 = _member(view, "n1")
    assert (n1["state"], n1["note"]) == (
        "unconfirmed", "never confirmed: the rollback was finished by ops")  # fmt: skip
    assert [_member(view, n)["state"] for n in ("n2", "n3", "n4")] == ["waiting"] * 3
    # Its target stays the release it had before, and the next rollout starts.
    assert await fleet.release_of("n1") == "1.0"
    status, started = await fleet.call(
        "POST", "/v1/admin/rollouts", json={"kind": "release", "release": "1.2"}
    )
    assert status == 201, started
    # Finished once: a second finish is refused, and changes nothing.
    status, body = await fleet.call("POST", f"/v1/admin/rollouts/{rollout_id}/finish")
    assert (status, body["error"]["code"]) == (409, "rollout_conflict")
    assert body["error"]["message"] == (
        f"rollout {rollout_id} is aborted: only a rolling-back rollout can be finished"
    )
    assert (await fleet.rollout(rollout_id))["reason"] == view["reason"]


async def test_finish_is_refused_for_a_rollout_that_is_not_rolling_back(fleet: Fleet) -> None:
    assert (await fleet.call("POST", "/v1/admin/releases?version=1.0", data=b"x"))[0] == 201
    for name in fleet.nodes:
        await fleet.beat(name)
    await until(lambda: speak_releases(fleet.settings), "every node's heartbeat stored")
    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "release", "release": "1.0", "strategy": {"max_burn_rate": None}},
    )  # fmt: skip
    assert status == 201, view
    status, body = await fleet.call("POST", f"/v1/admin/rollouts/{view['id']}/pause")
    assert (status, body["state"]) == (200, "paused")
    status, body = await fleet.call("POST", f"/v1/admin/rollouts/{view['id']}/finish")
    assert (status, body["error"]["code"]) == (409, "rollout_conflict")
    assert body["error"]["message"] == (
        f"rollout {view['id']} is paused: only a rolling-back rollout can be finished "
        "(abort it first)"
    )
    assert (await fleet.rollout(view["id"]))["state"] == "paused"
    assert (await fleet.call("POST", "/v1/admin/rollouts/nope/finish"))[0] == 404


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"kind": "release"}, 400, "invalid_value"),
        ({"kind": "release", "release": "9.9"}, 404, "not_found"),
        ({"kind": "model", "deployment": "nope", "model": "m@1"}, 404, "not_found"),
        ({"kind": "release", "release": "1.0", "deployment": "d"}, 400, "invalid_value"),
        ({"kind": "release", "release": "1.0", "strategy": {"waves": [60, 40]}}, 400,
         "invalid_value"),
        ({"kind": "release", "release": "1.0", "strategy": {"soak_s": -1}}, 400, "invalid_value"),
        ({"kind": "release", "release": "1.0", "strategy": {"canary_nodes": ["ghost"]}}, 404,
         "not_found"),
        ({"kind": "release", "release": "1.0", "strategy": {"waves": [50], "sites": [["a"]]}},
         400, "invalid_value"),
    ],
)  # fmt: skip
async def test_a_wrong_rollout_request_is_a_4xx_that_starts_nothing(
    fleet: Fleet, body: dict[str, Any], status: int, code: str
) -> None:
    assert (await fleet.call("POST", "/v1/admin/releases?version=1.0", data=b"x"))[0] == 201
    for name in fleet.nodes:
        await fleet.beat(name)
    await until(lambda: speak_releases(fleet.settings), "every node's heartbeat stored")
    got, answer = await fleet.call("POST", "/v1/admin/rollouts", json=body)
    assert (got, answer["error"]["code"]) == (status, code), answer
    assert (await fleet.call("GET", "/v1/admin/rollouts"))[1]["data"] == []
    assert (await fleet.call("GET", "/v1/admin/rollouts/nope"))[0] == 404
    assert (await fleet.call("POST", "/v1/admin/rollouts/nope/pause"))[0] == 404


async def test_a_model_rollout_moves_a_deployment_one_placement_at_a_time(fleet: Fleet) -> None:
    store = open_store(fleet.settings)
    for version in ("1", "2"):
        store.deployments.add_model(ModelArtifact("tiny", version, version * 64, 10, "gguf", 100))
    store.deployments.add(DeploymentRecord("dep", "tiny@1", 2, "S1", "I1", {}))
    store.close()
    for name in ("n1", "n2"):
        await fleet.beat(name, model_memory_mib=1000)
    await until(lambda: _placed_on(fleet.settings) == ["n1", "n2"], "both replicas placed")
    for name in ("n1", "n2"):
        await fleet.beat(name, model_memory_mib=1000, models=["tiny@1"])

    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "model", "deployment": "dep", "model": "tiny@2",
              "strategy": {"soak_s": 0, "max_burn_rate": None}},
    )  # fmt: skip
    assert status == 201, view
    assert view["target"] == {"deployment": "dep", "model": "tiny@2", "from": "tiny@1"}
    await until(lambda: _models_of(fleet, "n1", ["tiny@2"]), "the canary moved to tiny@2")
    assert await _models_of(fleet, "n2", ["tiny@1"])
    await fleet.beat("n1", model_memory_mib=1000, models=["tiny@2"])
    await until(lambda: _models_of(fleet, "n2", ["tiny@2"]), "the second placement moved")
    await fleet.beat("n2", model_memory_mib=1000, models=["tiny@2"])
    await until(lambda: _state_is(fleet, view["id"], "done"), "the rollout done")
    status, deployments = await fleet.call("GET", "/v1/admin/deployments")
    assert deployments["data"][0]["model"] == "tiny@2"
    assert await _models_of(fleet, "n1", ["tiny@2"])
    status, body = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "model", "deployment": "dep", "model": "tiny@2"},
    )  # fmt: skip
    assert (status, body["error"]["code"]) == (409, "rollout_conflict")


async def test_a_model_rollout_with_a_minimum_score_waits_for_it_and_halts_below_it(
    fleet: Fleet,
) -> None:
    store = open_store(fleet.settings)
    for version in ("1", "2"):
        store.deployments.add_model(ModelArtifact("tiny", version, version * 64, 10, "gguf", 100))
    store.deployments.add(DeploymentRecord("dep", "tiny@1", 2, "S1", "I1", {}))
    store.close()
    for name in ("n1", "n2"):
        await fleet.beat(name, model_memory_mib=1000)
    await until(lambda: _placed_on(fleet.settings) == ["n1", "n2"], "both replicas placed")
    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "model", "deployment": "dep", "model": "tiny@2",
              "strategy": {"soak_s": 0, "max_burn_rate": None, "min_score": 8}},
    )  # fmt: skip
    assert (status, view["strategy"]["min_score"]) == (201, 8), view
    await until(lambda: _models_of(fleet, "n1", ["tiny@2"]), "the canary moved to tiny@2")
    # Serving, not yet evaluated: the canary is not healthy, the next wave waits.
    await fleet.beat("n1", model_memory_mib=1000, models=["tiny@2"])
    await asyncio.sleep(0.5)
    assert fleet.node_state(await fleet.rollout(view["id"]), "n1") == "targeted"
    assert await _models_of(fleet, "n2", ["tiny@1"])
    # Its evaluation below the minimum halts the rollout, saying why.
    low = protocol.Evaluation(followed=3, on_topic=7, total=12, load_s=1.5, memory_mib=300)
    await fleet.beat("n1", model_memory_mib=1000, models=["tiny@2"], evaluations={"tiny@2": low})
    await until(lambda: _state_is(fleet, view["id"], "halted"), "the rollout halted")
    halted = await fleet.rollout(view["id"])
    assert "followed 3 of 12 instructions; the rollout requires 8" in halted["reason"], halted
    assert await _models_of(fleet, "n2", ["tiny@1"])  # the second node never moved


def _placed_on(settings: HubSettings) -> list[str]:
    store = open_store(settings)
    try:
        names = store.nodes.names()
        return sorted(names[n] for _, n, _ in store.deployments.placements())
    finally:
        store.close()


async def _models_of(fleet: Fleet, name: str, refs: list[str]) -> bool:
    state = await fleet.nodes[name].state(-1)
    assert state is not None
    return [f"{m.name}@{m.version}" for m in state.models] == refs


def test_releases_and_rollouts_from_the_command_line(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = _settings(tmp_path, hub_database)
    data = ["--data-dir", str(settings.data_dir)]
    bundle = tmp_path / "image-3.0.raucb"
    bundle.write_bytes(b"a bundle" * 100)
    added = kvl("hub", "releases", "add", str(bundle), "--version", "3.0", "--notes", "n", *data)
    assert "release 3.0" in added.stdout
    again = kvl("hub", "releases", "add", str(bundle), "--version", "3.0", *data, check=False)
    assert again.returncode == 1
    assert "exists already" in again.stderr
    store = open_store(settings)
    _enroll(store, "edge-1", "north")
    store.close()
    # No node speaks protocol 6 yet: nothing to roll out to.
    refused = kvl("hub", "rollouts", "start", "--release", "3.0", *data, check=False)
    assert (refused.returncode, "no node to roll out to" in refused.stderr) == (1, True)
    window = kvl("hub", "releases", "window", "north", "--from", "02:00", "--to", "05:00", *data)
    assert "02:00-05:00" in window.stdout
    bad = kvl("hub", "releases", "window", "north", "--from", "25:00", "--to", "05:00", *data,
              check=False)  # fmt: skip
    assert bad.returncode == 2
    listed = kvl("hub", "releases", "list", "--json", *data)
    assert json.loads(listed.stdout)["version"] == "3.0"
    assert kvl("hub", "rollouts", "list", *data).stdout == ""

    # The node heard at protocol 6: a rollout starts, and takes the operator's steps.
    store = open_store(settings)
    [node] = store.nodes.all()
    store.nodes.record_heartbeats([Heartbeat(node.id, 1.0, {"protocol": "6"}, protocol.Capacity())])
    store.close()
    started = kvl("hub", "rollouts", "start", "--release", "3.0", "--soak", "0",
                  "--no-burn-gate", *data)  # fmt: skip
    rollout_id = started.stdout.split()[1]
    assert "(release 3.0): pending" in started.stdout
    assert "canary: 0/1 updated" in started.stdout
    shown = json.loads(kvl("hub", "rollouts", "show", rollout_id, "--json", *data).stdout)
    assert (shown["state"], shown["strategy"]["soak_s"]) == ("pending", 0.0)
    assert "paused at canary" in kvl("hub", "rollouts", "pause", rollout_id, *data).stdout
    assert "resumed by cli" in kvl("hub", "rollouts", "resume", rollout_id, *data).stdout
    assert "aborted by cli" in kvl("hub", "rollouts", "abort", rollout_id, *data).stdout
    again = kvl("hub", "rollouts", "pause", rollout_id, *data, check=False)
    assert (again.returncode, "cannot be paused" in again.stderr) == (1, True)
    bad = kvl("hub", "rollouts", "start", "--release", "3.0", "--waves", "50,20", *data,
              check=False)  # fmt: skip
    assert bad.returncode == 2


def test_a_rollback_is_finished_from_the_command_line(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = _settings(tmp_path, hub_database)
    data = ["--data-dir", str(settings.data_dir)]
    store = open_store(settings)
    for version in ("3.0", "3.1"):
        store.rollouts.add_release(version, "", version[-1] * 64, 10)
    _enroll(store, "edge-1", "north")
    [node] = store.nodes.all()
    running = protocol.Capacity(image=_image("3.0"))
    store.nodes.record_heartbeats([Heartbeat(node.id, time.time(), {"protocol": "6"}, running)])
    rollout = begin(store, "release", {"release": "3.1"}, Strategy(max_burn_rate=None), "ops")
    evaluate(store, settings, time.time())  # the loop's round: the canary reached
    assert store.rollouts.release_target(node) is not None
    installed = protocol.Capacity(image=_image("3.1", "good", "3.1"))
    store.nodes.record_heartbeats([Heartbeat(node.id, time.time(), {"protocol": "6"}, installed)])
    store.close()
    refused = kvl("hub", "rollouts", "finish", rollout.id, *data, check=False)
    assert refused.returncode == 1
    assert "only a rolling-back rollout can be finished (abort it first)" in refused.stderr
    assert "rolling-back" in kvl("hub", "rollouts", "abort", rollout.id, *data).stdout

    # edge-1 (online) has not said it runs 3.0 again: finishing records it.
    finished = kvl("hub", "rollouts", "finish", rollout.id, *data).stdout
    assert "(release 3.1): aborted" in finished
    assert "rollback finished by cli; never confirmed: edge-1" in finished
    assert "edge-1  unconfirmed  online (never confirmed: the rollback was finished by cli)" in (
        finished
    )
    again = kvl("hub", "rollouts", "finish", rollout.id, *data, check=False)
    assert (again.returncode, "is aborted" in again.stderr) == (1, True)
    store = open_store(settings)
    try:
        target = store.rollouts.release_target(node)
        assert target is not None
        assert target.version == "3.0"
    finally:
        store.close()
    assert "pending" in kvl("hub", "rollouts", "start", "--release", "3.1", *data).stdout


def test_a_backup_carries_releases_windows_and_rollouts(
    tmp_path: Path, hub_database: HubDatabase, request: pytest.FixtureRequest
) -> None:
    settings = _settings(tmp_path, hub_database)
    bundle = tmp_path / "image-4.0.raucb"
    bundle.write_bytes(b"bundle 4.0" * 500)
    data = ["--data-dir", str(settings.data_dir)]
    kvl("hub", "releases", "add", str(bundle), "--version", "4.0", *data)
    kvl("hub", "releases", "window", "north", "--from", "22:30", "--to", "04:00", *data)
    store = open_store(settings)
    _enroll(store, "edge-1", "north")
    [node] = store.nodes.all()
    store.nodes.record_heartbeats(
        [Heartbeat(node.id, 1.0, {"protocol": "6"}, protocol.Capacity(), address=None)]
    )
    rollout = begin(store, "release", {"release": "4.0"}, Strategy(max_burn_rate=None), "ops")
    store.close()

    archive = tmp_path / "hub.tar.gz"
    hub_cli("backup", str(archive), *data, database=hub_database)
    target = fresh_database(request, hub_database)
    restored = _settings(tmp_path / "restored", target)
    hub_cli("restore", str(archive), "--data-dir", str(restored.data_dir), database=target)
    store = open_store(restored)
    try:
        [release] = store.rollouts.releases()
        assert (release.version, release.size_bytes) == ("4.0", 5000)
        held = restored.artifacts_dir / release.sha256
        assert held.read_bytes() == bundle.read_bytes()
        window = store.rollouts.update_windows()["north"]
        assert (window.start_min, window.end_min) == (22 * 60 + 30, 4 * 60)
        again = store.rollouts.get(rollout.id)
        assert (again.state, [m.member.name for m in again.members]) == ("pending", ["edge-1"])
    finally:
        store.close()


def test_a_nodes_burn_rate_is_read_from_the_live_objectives(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = _settings(tmp_path, hub_database)
    store = open_store(settings)
    try:
        for name in ("burning", "fine", "quiet"):
            _enroll(store, name, "north")
        ids = store.nodes.names()
        now = store.clock()

        def beat(name: str, requests: int, missed: int) -> Heartbeat:
            series = protocol.ObjectiveSeries(
                service_class="S1", account="(other)", requests=requests, admitted=requests,
                met={"first_token": requests - missed}, missed={"first_token": missed},
            )  # fmt: skip
            node_id = next(i for i, n in ids.items() if n == name)
            objectives = protocol.Objectives(epoch="e1", series=[series])
            return Heartbeat(node_id, now, {}, protocol.Capacity(), objectives=objectives)

        store.heartbeats([beat("burning", 100, 50), beat("fine", 1000, 5), beat("quiet", 5, 5)])
        rates = burn_rates(
            store, settings, {"burning", "fine", "quiet"}, since=now - 600, now=now + 1, least=20
        )
    finally:
        store.close()
    # S1's first-token target is 0.99: half missed burns 50 times the budget's pace, 0.5 %
    # half of it; five requests are too few to judge.
    assert rates["burning"] == pytest.approx(50.0)
    assert rates["fine"] == pytest.approx(0.5)
    assert "quiet" not in rates


def _all_heard(fleet: Fleet, *, old: str) -> bool:
    """Whether the hub has recorded n1 to n3 at today's protocol and n4 at `old`."""
    store = open_store(fleet.settings)
    try:
        heard = {n.name: n.versions.get("protocol", "") for n in store.nodes.all()}
    finally:
        store.close()
    today = str(protocol.PROTOCOL_VERSION)
    return heard == {**dict.fromkeys(("n1", "n2", "n3"), today), "n4": old}


async def test_a_node_of_protocol_5_is_left_out_and_never_sees_a_release(fleet: Fleet) -> None:
    """A node a version behind (protocol 5, as `tests/test_mixed_versions.py` runs one)
    cannot take a release: the rollout leaves it out, and its desired state, answered in
    its version, has no `release` field its models would refuse."""
    assert (await fleet.call("POST", "/v1/admin/releases?version=5.0", data=b"x" * 10))[0] == 201

    async def as_old_node(method: str, path: str, **kw: Any) -> tuple[int, Any]:
        return await fleet.as_old_node("n4", 5, method, path, **kw)

    status, _ = await as_old_node("POST", "/v1/node/heartbeat", json={"capacity": {}})
    assert status == 200
    for name in ("n1", "n2", "n3"):
        await fleet.beat(name)

    await until(lambda: _all_heard(fleet, old="5"), "all heard")
    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "release", "release": "5.0",
              "strategy": {"canary": 3, "max_unavailable": 3, "soak_s": 0,
                           "max_burn_rate": None}},
    )  # fmt: skip
    assert status == 201, view
    names = sorted(n["name"] for w in view["waves"] for n in w["nodes"])
    assert names == ["n1", "n2", "n3"]
    await until(lambda: _targets(fleet, "n3", "5.0"), "the protocol-6 nodes reached")
    status, state = await as_old_node("GET", "/v1/node/state")
    assert status == 200
    assert "release" not in state


async def test_a_node_of_protocol_7_gets_and_is_held_to_the_settings_it_takes(
    fleet: Fleet,
) -> None:
    """The content packages' settings came with protocol 8. A node of protocol 7 gets the
    hub's settings without them (its models would refuse the field), the hub expects the
    digest of what it gets, and a rollout of a packages setting leaves it out."""

    async def as_old_node(method: str, path: str, **kw: Any) -> tuple[int, Any]:
        return await fleet.as_old_node("n4", 7, method, path, **kw)

    assert (await as_old_node("POST", "/v1/node/heartbeat", json={"capacity": {}}))[0] == 200
    for name in ("n1", "n2", "n3"):
        await fleet.beat(name)
    await until(lambda: _all_heard(fleet, old="7"), "all heard")
    for key, value in (("chat_default", "m@1"), ("packages.max_attempts", "5"),
                       ("objectives.S1.first_token_per_token_s", "0.001")):  # fmt: skip
        status, body = await fleet.call("PUT", "/v1/admin/settings",
                                        json={"key": key, "value": value})  # fmt: skip
        assert status == 200, body
    status, state = await as_old_node("GET", "/v1/node/state")
    assert status == 200, state
    assert state["settings"]["chat_default"] == "m@1"
    assert "packages" not in state["settings"]
    assert state["settings"]["objectives"] == {
        "S1": {"admit_s": None, "first_token_s": None, "complete_s": None}
    }  # fmt: skip - its allowance is protocol 8's
    new = await fleet.nodes["n1"].state(-1)
    assert new is not None
    assert new.settings.packages.max_attempts == 5
    assert new.settings.objectives["S1"].first_token_per_token_s == 0.001
    shown = {}
    for name in ("n1", "n4"):
        status, shown[name] = await fleet.call("GET", f"/v1/admin/nodes/{name}/settings")
        assert status == 200, shown[name]
    assert (
        shown["n4"]["digest"]
        == protocol.NodeSettings(
            chat_default="m@1", objectives={"S1": protocol.ClassTargets()}
        ).digest()
    )
    assert (
        shown["n1"]["digest"]
        == protocol.NodeSettings(
            chat_default="m@1",
            objectives={"S1": protocol.ClassTargets(first_token_per_token_s=0.001)},
            packages=protocol.PackageOverrides(max_attempts=5),
        ).digest()
    )

    strategy = {"canary": 1, "max_unavailable": 3, "soak_s": 0, "max_burn_rate": None}
    status, view = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "settings", "setting": "packages.item_max_tokens", "value": "100",
              "strategy": strategy},
    )  # fmt: skip
    assert status == 201, view
    assert sorted(n["name"] for w in view["waves"] for n in w["nodes"]) == ["n1", "n2", "n3"]
    status, body = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "settings", "setting": "packages.model", "value": "m@1",
              "node": "n4", "strategy": strategy},
    )  # fmt: skip
    assert (status, body["error"]["code"]) == (409, "rollout_conflict"), body
    assert "protocol 8 on" in body["error"]["message"]


async def test_a_node_of_protocol_10_gets_the_packages_settings_but_not_the_checkers(
    fleet: Fleet,
) -> None:
    """The packages' answer verification settings came with protocol 11: a node of 10 gets
    the packages' other settings, and is held to the digest of those."""

    async def as_old_node(method: str, path: str, **kw: Any) -> tuple[int, Any]:
        return await fleet.as_old_node("n4", 10, method, path, **kw)

    assert (await as_old_node("POST", "/v1/node/heartbeat", json={"capacity": {}}))[0] == 200
    for name in ("n1", "n2", "n3"):
        await fleet.beat(name)
    await until(lambda: _all_heard(fleet, old="10"), "all heard")
    for key, value in (("packages.max_attempts", "5"), ("packages.check_model", "m@1"),
                       ("packages.verify_samples", "5")):  # fmt: skip
        status, body = await fleet.call("PUT", "/v1/admin/settings",
                                        json={"key": key, "value": value})  # fmt: skip
        assert status == 200, body
    status, state = await as_old_node("GET", "/v1/node/state")
    assert status == 200, state
    assert state["settings"]["packages"] == {
        "model": None, "max_attempts": 5, "item_max_tokens": None,
        "topic_min_similarity": None, "cache_max_mb": None,
    }  # fmt: skip
    new = await fleet.nodes["n1"].state(-1)
    assert new is not None
    assert (new.settings.packages.check_model, new.settings.packages.verify_samples) == ("m@1", 5)
    status, shown = await fleet.call("GET", "/v1/admin/nodes/n4/settings")
    assert status == 200, shown
    expected = protocol.NodeSettings(packages=protocol.PackageOverrides(max_attempts=5))
    assert shown["digest"] == expected.digest()
    status, body = await fleet.call(
        "POST", "/v1/admin/rollouts",
        json={"kind": "settings", "setting": "packages.check_model", "value": "m@1",
              "node": "n4", "strategy": {"canary": 1, "max_unavailable": 1, "soak_s": 0,
                                          "max_burn_rate": None}},
    )  # fmt: skip
    assert (status, body["error"]["code"]) == (409, "rollout_conflict"), body
    assert "protocol 11 on" in body["error"]["message"]
