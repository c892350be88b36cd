"""Fuzzing the hub against its own OpenAPI document (hub/api/openapi.py), as
tests/appliance/test_fuzz.py fuzzes the appliance: a real hub (its aiohttp application on
a real socket, SQLite in a temporary data directory; under the `postgres` mark, a
database of its own on the session's PostgreSQL cluster) on an event loop of its own
thread, and schemathesis loading the document it serves at `/openapi.json`.

Every operation gets schema-valid requests (positive) and, where it takes a body or
parameters, schema-violating ones (negative): a bounded, derandomized number of each,
sent with a valid node token (node routes) or operator token (operator routes). No
response may be a 5xx (schemathesis' `not_a_server_error`), and every error is in the one
error shape. Each run collects every failure rather than stopping at the first, with the
request that makes it and the exception the hub logged.

Schema-valid requests mostly name what the hub holds (a node, an account, a deployment,
a seeded package, the client's key, the protocol version the hub speaks), so that they
reach the handlers' work and not only the 404 or the refusal in front of it.

Text no database can keep (NUL, lone surrogates), which the generator sends only now and
then, has hand-written cases for every place a client's text goes.

The suite's longest module: `just test` runs it on SQLite and on PostgreSQL in two workers
at once (tests/scheduling.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
import requests
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup

from appliance.packages.cache import PackageCache
from hub.api.requests import DeploymentRequest, KeyRequest
from hub.api.route_kinds import Auth, Route
from hub.api.route_table import ROUTES
from hub.app import create_app
from hub.packages import add_bundle
from hub.planning.quota import Budget
from hub.state.deployments import DeploymentRecord, ModelArtifact
from hub.state.store import open_store
from shared import protocol
from shared.errors import ErrorCode
from tests.budget import tries
from tests.hubs import PREFIX, new_key, settings_for
from tests.packages import package
from tests.shared.oci_shapes import INDEX, SHAPES, rewrap

if TYPE_CHECKING:
    from collections.abc import Iterator

    from hub.settings import HubSettings
    from hub.state.nodes import Enrolled
    from hub.state.store import HubStore
    from tests.postgres import Cluster

# Generated cases per operation and mode; KVL_FUZZ_EXAMPLES sets more, for a longer hunt.
EXAMPLES = int(os.environ.get("KVL_FUZZ_EXAMPLES", tries(150)))
TIMEOUT_S = 30.0
START_S = 30.0

ERROR_CODES = frozenset(code.value for code in ErrorCode)
REQUEST_ID = re.compile(r"request id ([0-9a-f]+)")


# -- the hub, on a thread of its own ---------------------------------------------------------


class Exceptions(logging.Handler):
    """What the hub logged with a traceback, by the request id its 500 names."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.by_request: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        found = REQUEST_ID.search(record.getMessage().replace("(request ", "request id "))
        if found is not None and record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            self.by_request[found.group(1)] = f"{type(error).__name__}: {error}"


class HubThread:
    """The hub's application served on 127.0.0.1 by an event loop on another thread,
    so that schemathesis' blocking client and the test can drive it from this one; beside
    it, on the same loop, `upstream`: the LAN API of a node that takes offloaded requests."""

    def __init__(self, settings: HubSettings, upstream: web.Application) -> None:
        self._apps = (create_app(settings), upstream)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fuzzed-hub")
        self._runners: list[web.AppRunner] = []
        self.base_url = ""
        self.upstream_port = 0

    def __enter__(self) -> HubThread:
        self._thread.start()
        ports = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(START_S)
        self.base_url = f"http://127.0.0.1:{ports[0]}"
        self.upstream_port = ports[1]
        return self

    async def _start(self) -> list[int]:
        ports = []
        for app in self._apps:
            runner = web.AppRunner(app)
            await runner.setup()
            self._runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            ports.append(int(runner.addresses[0][1]))
        return ports

    async def _stop(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(START_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_S)
        self._loop.close()


def upstream_node() -> web.Application:
    """A node's LAN API as the hub's forwarder calls it: every offloaded request served."""

    async def offloaded(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"object": "text_completion", "choices": []})

    app = web.Application()
    app.add_routes([web.post("/v1/offloaded/{route:.+}", offloaded)])
    return app


@dataclass(frozen=True)
class Fuzzed:
    backend: str  # "sqlite" or "postgres"
    base_url: str
    schema: Any  # schemathesis' OpenApiSchema, loaded from the live hub
    node_token: str
    operator_token: str
    # What the hub holds: by path, the values of its parameters; by header, its value.
    # Schema-valid cases mostly name these, to reach the handlers' work past the 404.
    paths: dict[str, dict[str, str]]
    headers: dict[str, str]
    enrollment_token: str
    archive: bytes  # a package archive, as `POST /v1/admin/packages` takes
    exceptions: Exceptions

    def auth(self, route: Route) -> dict[str, str]:
        token = {Auth.node: self.node_token, Auth.operator: self.operator_token}.get(route.auth)
        return {"Authorization": f"Bearer {token}"} if token else {}


def _enroll(store: HubStore, token: str, name: str) -> Enrolled:
    return store.nodes.enroll(
        token, name=name, wg_public_key=new_key(), overlay_prefix=PREFIX, labels={}, versions={}
    )


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def fuzzed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fuzzed]:
    """A hub on SQLite in a temporary data directory, or on a database of its own on the
    session's PostgreSQL cluster (whose text refuses what SQLite's takes: NUL)."""
    tmp_path = tmp_path_factory.mktemp("fuzz-hub")
    database = {}
    if request.param == "postgres":
        cluster: Cluster = request.getfixturevalue("postgres")
        database = {"database_url": cluster.create()}
    # Model pulls the fuzzing queues resolve against a port nothing listens on, on loopback.
    hub_settings = settings_for(tmp_path, database, models={"hf_endpoint": "http://127.0.0.1:9"})
    store = open_store(hub_settings)
    try:
        token = store.tokens.create("lab", uses=3, expires_in_s=3600).plaintext
        node = _enroll(store, token, "fuzz-node")  # the node the node calls are made as
        server = _enroll(store, token, "server")  # the one offloaded requests go to
        # The operator routes name this one: draining or revoking it leaves the two
        # above as they were.
        _enroll(store, token, "victim")
        # Enrollments the fuzzing may make (schema-valid ones name this token).
        enrollment = store.tokens.create("lab", uses=100_000, expires_in_s=3600).plaintext
        spare_token = store.tokens.create("lab", uses=1, expires_in_s=3600)  # to revoke
        operator = store.operators.create("fuzz").plaintext
        silence = store.alerts.create_silence({"rule": "node_offline"}, 4e9, "fuzz", "")  # to end
        store.accounts.put("acme", "S1", budget=Budget(1_000_000, 86_400))
        client_key = store.accounts.create_key("acme").plaintext
        spare_key = store.accounts.create_key("acme")  # to revoke
        store.deployments.add_model(ModelArtifact("m", "1", "ab" * 32, 10, "gguf", 600))
        store.deployments.add(DeploymentRecord("d1", "m@1", 1, "S1", "I1", {}))
        cache = PackageCache(tmp_path / "cache", max_bytes=1 << 30)
        manifest, files = package(3)
        cache.put(manifest, files, "key-3")
        archive = cache.bundle(manifest.id)
        held = add_bundle(store, hub_settings.artifacts_dir, archive)
        store.packages.seed(held.id, None, None)
        (seeded,) = store.desired.of(node.node).packages
    finally:
        store.close()
    exceptions = Exceptions()
    logging.getLogger("hub").addHandler(exceptions)
    try:
        with HubThread(hub_settings, upstream_node()) as hub:
            # The server node says it serves m@1 and takes offloaded requests at its API.
            capacity = protocol.Capacity(
                models=["m@1"], offload=True, memory_total_mib=8000, memory_available_mib=8000,
                api=protocol.LanApi(port=hub.upstream_port),
            )  # fmt: skip
            said = requests.post(
                f"{hub.base_url}/v1/node/heartbeat",
                data=protocol.HeartbeatRequest(capacity=capacity).model_dump_json(),
                headers={
                    "Authorization": f"Bearer {server.node_token}",
                    "Content-Type": "application/json",
                    **protocol.HEADERS,
                },
                timeout=TIMEOUT_S,
            )
            assert said.status_code == 200, said.text
            schema = schemathesis.openapi.from_url(
                f"{hub.base_url}/openapi.json", config=schemathesis.Config(), timeout=30
            )
            # The valid tokens go into every case; generated credentials are only a 401.
            schema.config.generation.update(with_security_parameters=False)
            paths = {
                "/v1/admin/nodes/{node}/drain": {"node": "victim"},
                "/v1/admin/nodes/{node}/revoke": {"node": "victim"},
                "/v1/admin/accounts/{name}/quota": {"name": "acme"},
                "/v1/admin/deployments/{id}": {"id": "d1"},
                "/v1/admin/tokens/{prefix}/revoke": {"prefix": spare_token.prefix},
                "/v1/admin/keys/{prefix}/revoke": {"prefix": spare_key.prefix},
                "/v1/admin/packages/{id}/seed": {"id": held.id},
                "/v1/node/artifacts/{sha256}": {"sha256": seeded.sha256},
                "/v1/admin/silences/{id}": {"id": silence.id},
            }
            headers = {**protocol.HEADERS, protocol.CLIENT_KEY_HEADER: client_key}
            yield Fuzzed(
                request.param, hub.base_url, schema, node.node_token, operator, paths, headers,
                enrollment, archive, exceptions,
            )  # fmt: skip
    finally:
        logging.getLogger("hub").removeHandler(exceptions)


# -- the contract every response holds -------------------------------------------------------


def error_shape_problems(payload: object, status: int) -> list[str]:
    """Why `payload` is not the error shape of a response with `status` (none: it is)."""
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return [f"not {{'error': {{...}}}}: {payload!r:.300}"]
    error = payload["error"]
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return [f"`error` is not {{message, type, param, code}}: {error!r:.300}"]
    code = error["code"]
    if code not in ERROR_CODES:
        return [f"`error.code` is not a documented code: {code!r}"]
    if ErrorCode(code).status != status:
        return [f"`error.code` {code} belongs with {ErrorCode(code).status}, not {status}"]
    return []


@dataclass
class Tally:
    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)  # one reproduction per problem

    def report(self) -> str:
        return (
            f"{len(self.failures)} distinct problems in {self.cases} cases "
            f"(statuses {dict(self.statuses)}):\n\n" + "\n\n".join(self.failures.values())
        )


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same cases on every run and every machine
    database=None,
    deadline=None,
    # Collect, don't shrink: the test reports every distinct failure at the end.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=False,
)


def _mutable(route: Route) -> bool:
    """Whether the operation has anything a negative case can violate: a JSON body, a
    constrained parameter (a plain string in a path or query has no wrong value)."""
    constrained = any(p.schema.get("type") != "string" for p in route.params)
    versioned = route.auth in {Auth.node, Auth.enrollment}  # the Kvl-Protocol pattern
    return route.request is not None or bool(route.path_schemas) or constrained or versioned


FUZZ_RUNS = [
    (route, mode)
    for route in ROUTES
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or _mutable(route)
]


def name_known(case: Any, route: Route, fuzzed: Fuzzed) -> None:
    """A schema-valid case, still schema-valid, made to name what the hub holds."""
    case.path_parameters = {**(case.path_parameters or {}), **fuzzed.paths.get(route.path, {})}
    wanted = {p.name for p in route.params if p.where == "header"}
    if route.auth in {Auth.node, Auth.enrollment}:
        wanted.add(protocol.PROTOCOL_HEADER)
    case.headers = {**(case.headers or {}), **{n: fuzzed.headers[n] for n in wanted}}
    if route.path == "/v1/admin/packages/{id}/seed" and route.method == "DELETE":
        case.query = {}  # every version: the one held
    if route.body_type is not None:  # the package archive route
        case.body = fuzzed.archive
    if not isinstance(case.body, dict):
        return
    if route.request is protocol.EnrollRequest:
        case.body["token"] = fuzzed.enrollment_token
        case.body.pop("lan_csr", None)  # a generated one is only ever refused
    elif route.request is DeploymentRequest:
        case.body["model"] = "m@1"
        case.body["replicas"] = min(case.body.get("replicas", 1), 3)
    elif route.request is KeyRequest:
        case.body["account"] = "acme"
    elif "offload" in route.path:
        case.body["model"] = "m@1"


@pytest.mark.parametrize(
    ("route", "mode"),
    FUZZ_RUNS,
    ids=[f"{r.method} {r.path} {mode.value}" for r, mode in FUZZ_RUNS],
)
def test_fuzz_operation(fuzzed: Fuzzed, route: Route, mode: GenerationMode) -> None:
    """Generated requests for one operation: no 5xx, every error in the one shape."""
    operation = fuzzed.schema[route.path][route.method]
    tally = Tally()
    auth = fuzzed.auth(route)

    @FUZZ_SETTINGS
    @given(
        case=operation.as_strategy(generation_mode=mode),
        named=st.sampled_from([True, True, True, False]),
    )
    def run(case: Any, named: bool) -> None:
        if mode is GenerationMode.POSITIVE and named:
            name_known(case, route, fuzzed)
        try:
            response = case.call(headers=auth, timeout=TIMEOUT_S)
        except requests.RequestException as exc:  # no answer at all is the finding
            tally.failures.setdefault(
                f"no response: {type(exc).__name__}",
                f"no response: {exc}\n  request: {route.method} {case.formatted_path}\n"
                f"  body: {case.body!r:.2000}",
            )
            return
        tally.cases += 1
        tally.statuses[response.status_code] += 1
        problems: list[str] = []
        try:
            case.validate_response(response, checks=[not_a_server_error], headers=auth)
        except FailureGroup as group:
            problems.extend(f"schemathesis: {failure.title}" for failure in group.exceptions)
        if response.status_code >= 300:
            try:
                payload = response.json()
            except ValueError:
                problems.append(f"an error that is not JSON: {response.content!r:.300}")
            else:
                problems.extend(error_shape_problems(payload, response.status_code))
        for problem in problems:
            cause = None
            if response.status_code >= 500:
                found = REQUEST_ID.search(response.text)
                cause = found and fuzzed.exceptions.by_request.get(found.group(1))
            key = f"{problem} ({cause})" if cause else problem
            sent = response.request
            headers = {k: v for k, v in sent.headers.items() if k != "Authorization"}
            tally.failures.setdefault(
                key,
                f"{key}\n  request: {sent.method} {sent.url}\n  headers: {headers}\n"
                f"  body: {sent.body!r:.2000}\n"
                f"  response: {response.status_code} {response.content!r:.600}",
            )

    run()
    assert not tally.failures, tally.report()
    assert tally.cases >= 1, tally.report()


# -- text no database can keep, which the generator sends only now and then ---------------

# PostgreSQL's text holds neither NUL nor a lone UTF-16 surrogate, SQLite's does: such a
# string that reached the database was a 500 on one store only. One request for each
# place a client's text goes, with one of them in it (a lone surrogate percent-encoded in
# a path or query arrives as U+FFFD: not UTF-8, so aiohttp replaces it).
NUL = "a\u0000b"
LONE = "a\ud800b"
NUL_CASES: list[tuple[str, str, Auth, Any]] = [
    ("POST", "/v1/enroll", Auth.enrollment, {"token": NUL, "name": "n", "wg_public_key": ""}),
    ("POST", "/v1/enroll", Auth.enrollment, "enroll-labels"),
    ("POST", "/v1/node/heartbeat", Auth.node, {"versions": {NUL: NUL}}),
    ("POST", "/v1/node/heartbeat", Auth.node, {"capacity": {"models": [LONE]}}),
    ("POST", "/v1/node/events", Auth.node,
     {"events": [{"id": NUL, "kind": "usage", "body": {"account": "acme"}}]}),
    ("POST", "/v1/node/events", Auth.node,
     {"events": [{"id": "e", "kind": "usage", "body": {"account": LONE}}]}),
    ("POST", "/v1/node/events", Auth.node,
     {"events": [{"id": "e", "kind": "package_removed", "body": {"id": NUL, "version": "1"}}]}),
    ("POST", "/v1/node/leases", Auth.node, {"accounts": [LONE]}),
    ("POST", "/v1/node/leases", Auth.node, {"finals": {NUL: 1}}),
    ("GET", "/v1/node/state?after=%00", Auth.node, None),
    ("POST", "/v1/node/offload/completions", Auth.node, {"model": NUL}),
    ("GET", "/v1/admin/packages?q=%00", Auth.operator, None),
    ("GET", "/v1/admin/packages?q=%ED%A0%80", Auth.operator, None),
    ("POST", "/v1/admin/nodes/a%00b/drain", Auth.operator, {}),
    ("POST", "/v1/admin/nodes/%ED%A0%80/drain", Auth.operator, {}),
    ("POST", "/v1/admin/nodes/a%00b/revoke", Auth.operator, None),
    ("GET", "/v1/admin/accounts/a%00b/quota", Auth.operator, None),
    ("DELETE", "/v1/admin/deployments/a%00b", Auth.operator, None),
    ("POST", "/v1/admin/deployments", Auth.operator, {"model": "m@1", "sites": [NUL]}),
    ("POST", "/v1/admin/deployments", Auth.operator, {"model": "m@1", "labels": {LONE: NUL}}),
    ("POST", "/v1/admin/deployments", Auth.operator, {"model": "m@1", "tenant": NUL}),
    ("POST", "/v1/admin/deployments", Auth.operator, {"model": f"{LONE}@1"}),
    ("POST", "/v1/admin/tokens", Auth.operator, {"site": NUL}),
    ("POST", "/v1/admin/tokens", Auth.operator, {"site": LONE}),
    ("POST", "/v1/admin/tokens/a%00b/revoke", Auth.operator, None),
    ("POST", "/v1/admin/keys", Auth.operator, {"account": NUL}),
    ("POST", "/v1/admin/keys/a%00b/revoke", Auth.operator, None),
    ("POST", "/v1/admin/packages?seed=%00", Auth.operator, "archive"),
    ("POST", "/v1/admin/packages/a%00b/seed", Auth.operator, {"site": NUL}),
    ("POST", "/v1/admin/packages/x/seed", Auth.operator, {"version": LONE}),
    ("DELETE", "/v1/admin/packages/a%00b/seed?version=%00", Auth.operator, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "auth", "body"),
    NUL_CASES,
    ids=[f"{m} {p} {json.dumps(b) if isinstance(b, dict) else b}" for m, p, _, b in NUL_CASES],
)
def test_text_no_database_keeps_is_never_a_5xx(
    fuzzed: Fuzzed, method: str, path: str, auth: Auth, body: Any
) -> None:
    headers = {**fuzzed.headers, "Content-Type": "application/json"}
    token = {Auth.node: fuzzed.node_token, Auth.operator: fuzzed.operator_token}.get(auth)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if body == "archive":
        data: bytes | None = fuzzed.archive
    elif body == "enroll-labels":
        data = json.dumps({"token": fuzzed.enrollment_token, "name": "nul", "labels": {NUL: NUL},
                           "wg_public_key": new_key()}).encode()  # fmt: skip
    else:
        data = None if body is None else json.dumps(body).encode()
    sent = requests.request(
        method, fuzzed.base_url + path, data=data, headers=headers, timeout=TIMEOUT_S
    )
    # Refused (a 4xx in the shape), or, in a query, decoded to U+FFFD by the HTTP layer.
    assert sent.status_code < 500, (sent.status_code, sent.text)
    if sent.status_code >= 300:
        assert not error_shape_problems(sent.json(), sent.status_code), sent.text


# -- package archives whose JSON is of the wrong shape ---------------------------------------

# The generator sends the package route the archive the hub holds, or bytes that are no
# archive: never an intact archive whose JSON is of the wrong shape (tests/shared/
# oci_shapes.py), each a 500 once. One request for each.


def _upload(fuzzed: Fuzzed, archive: bytes) -> requests.Response:
    return requests.post(
        f"{fuzzed.base_url}/v1/admin/packages?seed=all",
        data=archive,
        headers={
            "Authorization": f"Bearer {fuzzed.operator_token}",
            "Content-Type": "application/octet-stream",
        },
        timeout=TIMEOUT_S,
    )


def test_the_archive_the_shapes_change_is_taken(fuzzed: Fuzzed) -> None:
    """Unchanged, the archive rewrapped is the held one, taken again: the refusals below
    are the shapes'."""
    sent = _upload(fuzzed, rewrap(fuzzed.archive, INDEX, lambda index: index))
    assert sent.status_code == 201, sent.text


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_a_package_archive_of_the_wrong_shape_is_a_4xx(fuzzed: Fuzzed, case: str) -> None:
    target, change = SHAPES[case]
    sent = _upload(fuzzed, rewrap(fuzzed.archive, target, change))
    assert sent.status_code < 500, (sent.status_code, sent.text)
    assert not error_shape_problems(sent.json(), sent.status_code), sent.text
    assert sent.json()["error"]["code"] == ErrorCode.invalid_value, sent.text
