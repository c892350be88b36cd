"""Fuzzing the LAN API against its own OpenAPI document, on a real `kvl appliance serve`.

Schemathesis reads the document the live server serves at `/openapi.json` and generates
request bodies for every operation in it: schema-valid ones (positive) and schema-violating
ones (negative), a bounded and derandomized number of each, sent with a valid bearer key.
Every response must hold the API's contract, whatever the input:

- no 5xx;
- every non-2xx is `application/json` in the one error shape, with a documented `code`;
- nothing is a traceback: a 2xx is JSON, or server-sent events whose every event is JSON.

Schemathesis' own pytest integration (`schemathesis.pytest.from_fixture`, which a schema
loaded from a live server needs) fails on pytest 9.2 (`Function` has no `_nodeid` there), so
each operation's strategy (`APIOperation.as_strategy`, public API) drives a plain Hypothesis
test instead. The test collects every bad response rather than stopping (and shrinking) at
the first, so one run reports them all, each with the exact request that reproduces it.

Hand-written Hypothesis properties cover what a schema-driven generator never sends: bodies
that are not JSON at all (arbitrary bytes, non-UTF-8, over the size limit), JSON that is not
an object, and arbitrary `Authorization` header values.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from appliance.gateway.routes import ROUTES
from shared.errors import ErrorCode
from tests.conftest import REPO, ApplianceProcess, free_port, kvl, wait_ready

pytestmark = pytest.mark.model

# Small enough that a schema-valid request which reaches the model answers in well under a
# second on a 2-core CI machine; a larger `max_tokens` is a 400, which is fine to fuzz.
MAX_TOKENS_LIMIT = 8
# Small, so that the hand-written body property reaches the limit (413) cheaply.
MAX_BODY_BYTES = 16 * 1024
# Cases per operation and generation mode; a bodiless GET has only one possible case.
EXAMPLES = 50
TIMEOUT_S = 120.0

ERROR_CODES = frozenset(code.value for code in ErrorCode)
TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Fuzzed:
    appliance: ApplianceProcess
    schema: Any  # schemathesis' BaseSchema (its OpenAPI subclass is not re-exported)
    model: str  # the name the appliance serves, for requests that should reach the model

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.appliance.key}"}


@pytest.fixture(scope="module")
def fuzz_appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApplianceProcess]:
    """`kvl appliance serve` with a small `max_tokens` limit and body limit."""
    data_dir = tmp_path_factory.mktemp("fuzz-appliance")
    key = kvl(
        "appliance", "keys", "create", "--account", "fuzz", "--data-dir", str(data_dir)
    ).stdout.strip()
    port = free_port()
    env = {
        **os.environ,
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_MODEL__N_CTX": "2048",
        "KVL_MODEL__N_THREADS": "2",
        "KVL_MODEL__MAX_TOKENS_LIMIT": str(MAX_TOKENS_LIMIT),
        "KVL_MODEL__MAX_QUEUE": "4",
        "KVL_SERVER__MAX_BODY_BYTES": str(MAX_BODY_BYTES),
    }
    with (data_dir / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shared.cli",
                "appliance",
                "serve",
                "--data-dir",
                str(data_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base_url, process)
            yield ApplianceProcess(base_url, key, data_dir, process)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def fuzzed(fuzz_appliance: ApplianceProcess) -> Fuzzed:
    """The OpenAPI document as the live server serves it, loaded by schemathesis."""
    # An explicit config, so a stray schemathesis.toml cannot change what runs here.
    config = schemathesis.Config()
    schema = schemathesis.openapi.from_url(
        f"{fuzz_appliance.base_url}/openapi.json", config=config, timeout=30
    )
    # The valid key goes into every case below; generated credentials would only ever be 401.
    schema.config.generation.update(with_security_parameters=False)
    models = send(fuzz_appliance.base_url, "GET", "/v1/models", headers=_bearer(fuzz_appliance.key))
    assert models.status == 200, models
    served = [m["id"] for m in models.json()["data"]]
    assert served, models
    return Fuzzed(fuzz_appliance, schema, served[0])


# -- the contract every response holds ---------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def __str__(self) -> str:
        return f"{self.status} {self.content_type!r} {_clip(self.body)}"


def _clip(data: bytes | str | None, limit: int = 600) -> str:
    text = repr(data)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def error_shape_problems(payload: Any, status: int) -> list[str]:
    """Why `payload` is not the error shape of a response with `status` (empty when it is)."""
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return [f"not {{'error': {{...}}}}: {_clip(json.dumps(payload))}"]
    error = payload["error"]
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return [f"`error` is not {{message, type, param, code}}: {_clip(json.dumps(error))}"]
    found = []
    if not isinstance(error["message"], str) or not error["message"]:
        found.append(f"`error.message` is not a non-empty string: {error['message']!r}")
    if not isinstance(error["type"], str):
        found.append(f"`error.type` is not a string: {error['type']!r}")
    if error["param"] is not None and not isinstance(error["param"], str):
        found.append(f"`error.param` is neither a string nor null: {error['param']!r}")
    code = error["code"]
    if not isinstance(code, str) or code not in ERROR_CODES:
        found.append(f"`error.code` is not a documented code: {code!r}")
    else:
        kind = ErrorCode(code)
        if kind.status != status:
            found.append(f"`error.code` {code} belongs with {kind.status}, not {status}")
        if kind.type != error["type"]:
            found.append(f"`error.type` {error['type']!r} is not {code}'s {kind.type!r}")
    return found


def contract_problems(path: str, reply: Reply) -> list[str]:
    """Why `reply` breaks the API's contract (empty when it holds)."""
    text = reply.body.decode("utf-8", "replace")
    media_type = reply.content_type.split(";")[0].strip().lower()
    found = []
    if reply.status >= 500:
        found.append(f"server error {reply.status}")
    if TRACEBACK in text:
        found.append("the body is a Python traceback")
    if reply.status >= 300:
        if media_type != "application/json":
            return [*found, f"an error response of type {reply.content_type!r}, not JSON"]
        try:
            payload = json.loads(text)
        except ValueError:
            return [*found, "an error response whose body is not JSON"]
        return found + error_shape_problems(payload, reply.status)
    if path == "/metrics":  # the one route that answers neither JSON nor events
        if media_type not in {"text/plain", "application/openmetrics-text"}:
            found.append(f"metrics as {reply.content_type!r}")
        return found
    if media_type == "application/json":
        try:
            json.loads(text)
        except ValueError:
            found.append("a 2xx JSON response whose body is not JSON")
    elif media_type == "text/event-stream":
        found.extend(_event_stream_problems(text, reply.status))
    else:
        found.append(f"a 2xx response of type {reply.content_type!r}")
    return found


def _event_stream_problems(text: str, status: int) -> list[str]:
    found = []
    events = [
        line[len("data:") :].strip() for line in text.splitlines() if line.startswith("data:")
    ]
    if not events:
        return ["an event stream without events"]
    for data in events:
        if data == "[DONE]":
            continue
        try:
            event = json.loads(data)
        except ValueError:
            found.append(f"an event that is not JSON: {_clip(data)}")
            continue
        if isinstance(event, dict) and "error" in event:
            # An error after the 200 went out (output_validation_failed): still the shape.
            found.extend(
                p for p in error_shape_problems(event, ErrorCode.output_validation_failed.status)
            )
        elif not isinstance(event, dict) or "choices" not in event:
            found.append(f"an event that is neither a chunk nor an error: {_clip(data)}")
    return found


# -- schemathesis: every operation of the served document, positive and negative ---------------


@dataclass
class Tally:
    """What a fuzz run sent and got back."""

    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)  # one reproduction per distinct problem


def _fuzz_settings() -> Callable[[Any], Any]:
    return settings(
        max_examples=EXAMPLES,
        derandomize=True,  # the same cases on every run and machine
        database=None,
        deadline=None,  # a case that reaches the model takes its time
        # Collect-don't-shrink: the test reports every failure at the end.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        print_blob=False,
    )


OPERATIONS = [(route.method, route.path) for route in ROUTES]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzz_operation(fuzzed: Fuzzed, method: str, path: str, mode: GenerationMode) -> None:
    """Generated requests for one operation never get a 5xx, a traceback or a wrong shape."""
    operation = fuzzed.schema[path][method]  # KeyError: the document lacks a route
    has_body = any(
        route.body is not None for route in ROUTES if (route.method, route.path) == (method, path)
    )
    if mode is GenerationMode.NEGATIVE and not has_body:
        pytest.skip("an operation without parameters or a body has no schema to violate")
    cases = operation.as_strategy(generation_mode=mode, headers=fuzzed.auth)
    tally = Tally()

    # Half of the schema-valid bodies name the served model, so generation runs too (a random
    # name is only ever model_not_found).
    @_fuzz_settings()
    @given(case=cases, real_model=st.sampled_from([True, True, True, False]))
    def run(case: Any, real_model: bool) -> None:
        if real_model and mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = fuzzed.model
        response = case.call(headers=fuzzed.auth, timeout=TIMEOUT_S)
        reply = Reply(
            response.status_code,
            ",".join(response.headers.get("content-type", [])),
            response.content,
        )
        tally.cases += 1
        tally.statuses[reply.status] += 1
        if reply.status >= 300 and "application/json" in reply.content_type:
            payload = reply.json()
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                tally.codes[str(payload["error"].get("code"))] += 1
        for problem in contract_problems(path, reply):
            tally.failures.setdefault(
                problem,
                f"{problem}\n  request: {method} {path} media type {case.media_type!r}\n"
                f"  body sent: {_clip(response.request.body, 3000)}\n  response: {reply}",
            )

    run()
    print(
        "TALLY",
        method,
        path,
        mode,
        tally.cases,
        dict(tally.statuses),
        dict(tally.codes),
        file=sys.stderr,
    )
    assert not tally.failures, (
        f"{len(tally.failures)} distinct problems in {tally.cases} cases "
        f"(statuses {dict(tally.statuses)}):\n\n" + "\n\n".join(tally.failures.values())
    )
    assert tally.cases >= (EXAMPLES // 2 if has_body else 1), tally
    if mode is GenerationMode.POSITIVE and has_body:
        # The fuzzing reached the model, not only the validation in front of it.
        assert tally.statuses[200] > 0, tally


# -- hand-written properties: what a schema-driven generator does not send ---------------------


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def send(
    base_url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    """One request with exactly these bytes and headers (no client-side encoding or checks)."""
    url = urllib.parse.urlsplit(base_url)
    assert url.hostname is not None
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT_S)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return Reply(response.status, response.getheader("Content-Type", ""), response.read())
    finally:
        connection.close()


BODY_ROUTES = [route.path for route in ROUTES if route.body is not None]
AUTH_ROUTES = [(route.method, route.path) for route in ROUTES if route.auth]
PROPERTY_SETTINGS = settings(
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=5)


@st.composite
def broken_json(draw: st.DrawFn) -> bytes:
    """A JSON object's bytes, truncated or with a byte that is not UTF-8 spliced in."""
    raw = json.dumps(draw(json_objects), ensure_ascii=draw(st.booleans())).encode()
    at = draw(st.integers(0, len(raw)))
    if draw(st.booleans()):
        return raw[:at] if at < len(raw) else raw[:-1]
    return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"])) + raw[at:]


raw_bodies = st.one_of(
    st.binary(max_size=1024),
    st.text(max_size=200).map(str.encode),
    broken_json(),
    # Around the limit: 413 above it, and the same invalid_json up to it.
    st.integers(MAX_BODY_BYTES - 2, MAX_BODY_BYTES + 2).map(lambda n: b"\xff" * n),
)


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)  # as lenient as the server: UTF-16/32, BOM
    except ValueError:
        return False


def test_arbitrary_bytes_are_invalid_json(fuzzed: Fuzzed) -> None:
    """A body that is not a JSON object (not JSON, not UTF-8) is a 400 invalid_json."""
    base_url = fuzzed.appliance.base_url

    @PROPERTY_SETTINGS
    @given(
        path=st.sampled_from(BODY_ROUTES), raw=raw_bodies.filter(lambda b: not _is_json_object(b))
    )
    def run(path: str, raw: bytes) -> None:
        reply = send(
            base_url, "POST", path, raw, {**fuzzed.auth, "Content-Type": "application/json"}
        )
        assert not contract_problems(path, reply), (contract_problems(path, reply), raw, reply)
        expected = (
            ErrorCode.request_too_large if len(raw) > MAX_BODY_BYTES else ErrorCode.invalid_json
        )
        assert (reply.status, reply.json()["error"]["code"]) == (expected.status, expected.value), (
            raw,
            reply,
        )

    run()


def test_json_that_is_not_an_object_is_a_400(fuzzed: Fuzzed) -> None:
    """An array, string, number, boolean or null body is a 400 invalid_json, whatever it holds."""
    base_url = fuzzed.appliance.base_url

    @PROPERTY_SETTINGS
    @given(
        path=st.sampled_from(BODY_ROUTES),
        value=json_values.filter(lambda v: not isinstance(v, dict)),
        ascii_only=st.booleans(),
    )
    def run(path: str, value: object, ascii_only: bool) -> None:
        raw = json.dumps(value, ensure_ascii=ascii_only).encode()
        reply = send(
            base_url, "POST", path, raw, {**fuzzed.auth, "Content-Type": "application/json"}
        )
        assert not contract_problems(path, reply), (contract_problems(path, reply), raw, reply)
        error = reply.json()["error"]
        assert (reply.status, error["code"]) == (400, ErrorCode.invalid_json.value), (raw, reply)

    run()


# RFC 9110 field values: visible ASCII, obs-text, and spaces and tabs between them.
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f")
    | st.just("\t"),
    max_size=80,
)
authorizations = st.one_of(
    header_text,
    st.tuples(
        st.sampled_from(["Bearer", "bearer", "BEARER", "Basic", "Token", "Bearer\t", "Bearer "]),
        st.sampled_from([" ", "  ", "\t"]),
        header_text,
    ).map("".join),
)


def test_any_other_authorization_is_a_401(fuzzed: Fuzzed) -> None:
    """Any `Authorization` value but the key's is a 401 in the error shape, before the body."""
    base_url = fuzzed.appliance.base_url
    body = json.dumps({"model": fuzzed.model, "prompt": "hi", "max_tokens": 1}).encode()

    @PROPERTY_SETTINGS
    @given(route=st.sampled_from(AUTH_ROUTES), authorization=authorizations)
    def run(route: tuple[str, str], authorization: str) -> None:
        method, path = route
        reply = send(
            base_url,
            method,
            path,
            body if method == "POST" else None,
            {"Authorization": authorization, "Content-Type": "application/json"},
        )
        assert not contract_problems(path, reply), (
            contract_problems(path, reply),
            authorization,
            reply,
        )
        code = reply.json()["error"]["code"]
        assert reply.status == 401, (authorization, reply)
        assert code in {ErrorCode.missing_api_key.value, ErrorCode.invalid_api_key.value}, reply

    run()


def test_no_authorization_is_missing_api_key(fuzzed: Fuzzed) -> None:
    for method, path in AUTH_ROUTES:
        reply = send(fuzzed.appliance.base_url, method, path, b"{}" if method == "POST" else None)
        assert not contract_problems(path, reply), reply
        assert reply.status == 401, reply
        assert reply.json()["error"]["code"] == ErrorCode.missing_api_key.value, reply
