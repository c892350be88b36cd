"""Fuzzing the LAN API against its own OpenAPI document, on a real `kvl appliance serve`.

Schemathesis loads the document the live server serves at `/openapi.json` and generates
requests for every operation in it: schema-valid bodies (positive) and schema-violating ones
(negative), a bounded, derandomized number of each, sent with a valid bearer key. Every
response must hold the API's contract, whatever the input:

- no 5xx;
- every non-2xx is `application/json` in the one error shape, with a documented `code` that
  belongs with the status;
- nothing is a traceback: a 2xx is JSON, or server-sent events whose every event is JSON;
- schemathesis' own response checks against the document (documented status, content type,
  the `Error` schema) pass.

Schemathesis' pytest integration for a schema that only exists at run time
(`schemathesis.pytest.from_fixture`) fails on pytest 9.2 (`Function` has no `_nodeid` there),
so each operation's public strategy (`APIOperation.as_strategy`) drives a plain Hypothesis test.
That test collects every bad response instead of stopping (and shrinking) at the first, so one
run reports them all, each with the exact body that reproduces it and, for a 500, the
exception from the server's log.

Hand-written Hypothesis properties cover what a schema-driven generator never sends: bodies
that are not JSON (arbitrary bytes, non-UTF-8, around the size limit), JSON that is not an
object, arbitrary `Authorization` values, lone surrogates in strings, `Content-Encoding`s,
wrong methods and paths, and requests that HTTP parsing refuses before the app sees them.

Runs in about 20-45 s on a 2-core machine (a minute or so when it is busy with other work).
"""

from __future__ import annotations

import gzip
import http.client
import io
import json
import re
import socket
import tarfile
import time
import urllib.parse
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
import yarl
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from appliance.gateway.routes import ROUTES
from shared.errors import ErrorCode
from shared.sealing import IDENTITY_MEMBER, PAYLOAD_MEMBER
from tests.budget import tries
from tests.conftest import SCRIPTED, ApplianceProcess, kvl, running_appliance, write_script
from tests.network_agent import Agent
from tests.rawhttp import dechunk

# Small, so that a schema-valid request that reaches the model answers in well under a second
# on a 2-core machine; a larger `max_tokens` is a 400, which is as good a case to fuzz.
MAX_TOKENS_LIMIT = 8
# Small, so that the raw-body property reaches the limit (413) cheaply.
MAX_BODY_BYTES = 16 * 1024
# Generated cases per operation and mode (a bodiless GET has only one possible case).
EXAMPLES = tries(50)
PROPERTY_EXAMPLES = tries(60)
TIMEOUT_S = 120.0

ERROR_CODES = frozenset(code.value for code in ErrorCode)
TRACEBACK = "Traceback (most recent call last)"
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
SSE_LINE_END = re.compile(r"\r\n|\r|\n")
REQUEST_ID = re.compile(r"request id ([0-9A-Za-z_-]+)")
# The account of the fuzzing's admin key; the keys the fuzzing makes are of it. Disabling it,
# or revoking that key, is refused while it holds the only admin keys (last_admin_key).
FUZZ_ACCOUNT = "fuzz"


@dataclass(frozen=True)
class Fuzzed:
    appliance: ApplianceProcess
    schema: Any  # schemathesis' OpenApiSchema, loaded from the live server
    model: str  # a name the appliance serves, for requests that should reach the model
    embedding_model: str  # the same for /v1/embeddings
    package_id: str  # a package in the cache, for the routes that name one

    def model_for(self, path: str) -> str:
        if path == "/v1/audio/speech":
            return "espeak-ng"  # a voice the appliance always has, and the quick one
        return self.embedding_model if path == "/v1/embeddings" else self.model

    @property
    def auth(self) -> dict[str, str]:
        return _bearer(self.appliance.key)

    def network_trial(self) -> str:
        """The id of the network change on trial: one asked for (its bound an hour) when
        none is, as an operator would, and seen taken by the agent."""
        base, auth = self.appliance.base_url, {**self.auth, **JSON}
        for _ in range(200):
            state = send(base, "GET", "/v1/admin/network", headers=self.auth).json()
            last = state.get("last") or {}
            if last.get("outcome") == "trying":
                return str(last["id"])
            body = json.dumps({"addresses": ["198.18.7.20/24"], "confirm_within_s": 3600})
            send(base, "PUT", "/v1/admin/network", body.encode(), auth)  # 409 while one waits
            time.sleep(0.05)
        raise AssertionError(f"the agent never took a network change: {state}")

    def server_exception(self, reply: Reply) -> str | None:
        """The exception the server logged for the request that got `reply` (a 500)."""
        found = REQUEST_ID.search(reply.body.decode("utf-8", "replace"))
        if found is None:
            return None
        lines = (self.appliance.data_dir / "serve.log").read_text("utf-8", "replace").splitlines()
        marker = f"(request {found.group(1)})"
        start = next((i for i, line in enumerate(lines) if marker in line), None)
        if start is None:
            return None
        last = None
        for line in lines[start + 1 :]:
            if LOG_RECORD.match(line):
                break
            if (
                line
                and not line[0].isspace()
                and not line.startswith(("Traceback", "The above", "During"))
            ):
                last = line
        return last


@pytest.fixture(scope="module")
def fuzz_appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApplianceProcess]:
    """`kvl appliance serve`, as in conftest, with small `max_tokens` and body limits."""
    # The image's network agent beside it, on temporary folders (tests/network_agent.py), so
    # that the network routes reach the agent rather than stop at `network_not_managed`.
    agent = Agent(tmp_path_factory.mktemp("fuzz-system")).boot()
    data_dir = agent.appliance_data
    data_dir.mkdir()
    # An admin key: it reaches the admin routes too, and every other route as any key does.
    key = kvl(
        "appliance", "keys", "create", "--account", FUZZ_ACCOUNT, "--admin", "--data-dir",
        str(data_dir),
    ).stdout.strip()  # fmt: skip
    # The scripted model: the contract under test is the API's, not the model's. Its rules
    # answer the fuzzing's package (FUZZ_PACKAGE) with an item of the right shape, and
    # confirm its statement when it checks it.
    script = write_script(
        data_dir / "scripted.json",
        rules=[
            {"contains": "Is the statement true", "reply": '{"answer": "yes"}'},
            {"contains": "Is the statement false", "reply": '{"answer": "no"}'},
            {"contains": "fuzzing", "reply": FUZZ_ITEM},
        ],
    )
    kvl("appliance", "models", "add", str(script), "--name", SCRIPTED, "--version", "1",
        "--data-dir", str(data_dir))  # fmt: skip
    env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_MODEL__DEFAULT": SCRIPTED,
        "KVL_MODEL__CHAT_DEFAULT": SCRIPTED,
        "KVL_MODEL__N_CTX": "2048",
        "KVL_MODEL__MAX_TOKENS_LIMIT": str(MAX_TOKENS_LIMIT),
        "KVL_MODEL__MAX_QUEUE": "4",
        "KVL_SERVER__MAX_BODY_BYTES": str(MAX_BODY_BYTES),
        # The fuzzing sends thousands of requests, many without a valid key, from one
        # address: neither the quota nor the authentication throttle is under test here.
        "KVL_CLASSES__AUTH_FAILURES_PER_MINUTE": "1000000",
        "KVL_CLASSES__S1__REQUESTS_PER_MINUTE": "0",
        "KVL_NETWORK__AGENT_DIR": str(agent.folder),
    }
    agent.start()
    try:
        with running_appliance(data_dir, key, env) as appliance:
            yield appliance
    finally:
        agent.stop()


@pytest.fixture(scope="module")
def fuzzed(fuzz_appliance: ApplianceProcess) -> Fuzzed:
    """The OpenAPI document as the live server serves it, loaded by schemathesis."""
    # An explicit config, so that no schemathesis.toml changes what runs here.
    schema = schemathesis.openapi.from_url(
        f"{fuzz_appliance.base_url}/openapi.json", config=schemathesis.Config(), timeout=30
    )
    # The valid key goes into every case; generated credentials would only ever be a 401.
    schema.config.generation.update(with_security_parameters=False)
    models = send(fuzz_appliance.base_url, "GET", "/v1/models", headers=_bearer(fuzz_appliance.key))
    assert models.status == 200, models
    # The embedding model is the one that states its vectors' dimension.
    served = [
        model["id"]
        for model in models.json()["data"]
        if "dimension" not in model and model.get("state") == "ready"
    ]
    embedding = [model["id"] for model in models.json()["data"] if "dimension" in model]
    assert served, models
    assert embedding, models
    # One small package, made once: the package routes then have one to find, and every
    # package request the fuzzing sends (the same one, FUZZ_PACKAGE) is a cache hit.
    made = send(fuzz_appliance.base_url, "POST", "/v1/packages",
                json.dumps({**FUZZ_PACKAGE, "wait": True}).encode(),
                {**_bearer(fuzz_appliance.key), **JSON})  # fmt: skip
    assert made.status == 200, made
    return Fuzzed(fuzz_appliance, schema, served[0], embedding[0], made.json()["id"])


# -- the contract every response holds ---------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes
    complete: bool = True  # False: the client stopped reading an event stream early

    def json(self) -> Any:
        return json.loads(self.body)

    def __str__(self) -> str:
        return f"{self.status} {self.content_type!r} {_clip(self.body)}"


def _clip(data: object, limit: int = 600) -> str:
    text = repr(data)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def error_shape_problems(payload: object, status: int) -> list[str]:
    """Why `payload` is not the error shape of a response with `status` (empty when it is)."""
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return [f"not {{'error': {{...}}}}: {_clip(payload)}"]
    error = payload["error"]
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return [f"`error` is not {{message, type, param, code}}: {_clip(error)}"]
    found = []
    if not isinstance(error["message"], str) or not error["message"]:
        found.append(f"`error.message` is not a non-empty string: {error['message']!r}")
    if error["param"] is not None and not isinstance(error["param"], str):
        found.append(f"`error.param` is neither a string nor null: {error['param']!r}")
    code = error["code"]
    if not isinstance(code, str) or code not in ERROR_CODES:
        found.append(f"`error.code` is not a documented code: {code!r}")
        return found
    kind = ErrorCode(code)
    if kind.status != status:
        found.append(f"`error.code` {code} belongs with {kind.status}, not {status}")
    if error["type"] != kind.type:
        found.append(f"`error.type` {error['type']!r} is not {code}'s {kind.type!r}")
    return found


def contract_problems(path: str, reply: Reply) -> list[str]:
    """Why `reply` breaks the API's contract (empty when it holds)."""
    text = reply.body.decode("utf-8", "replace")
    media_type = reply.content_type.partition(";")[0].strip().lower()
    found = []
    if reply.status >= 500:
        found.append(f"server error {reply.status}")
    if TRACEBACK in text:
        found.append("a Python traceback in the body")
    if reply.status >= 300:
        if media_type != "application/json":
            return [*found, f"an error response of type {reply.content_type!r}, not JSON"]
        try:
            payload = json.loads(text)
        except ValueError:
            return [*found, "an error response whose body is not JSON"]
        return found + error_shape_problems(payload, reply.status)
    return found + _success_problems(path, media_type, reply, text)


def _success_problems(path: str, media_type: str, reply: Reply, text: str) -> list[str]:
    """Why a 2xx `reply` is not what its route answers."""
    found: list[str] = []
    if path == "/metrics":  # the one route that answers neither JSON nor events
        if media_type not in {"text/plain", "application/openmetrics-text"}:
            found.append(f"metrics as {reply.content_type!r}")
    elif media_type == "application/json":
        try:
            json.loads(text)
        except ValueError:
            found.append("a 2xx JSON response whose body is not JSON")
    elif media_type == "text/event-stream":
        found.extend(_event_stream_problems(text, complete=reply.complete))
    elif path == "/v1/audio/speech" and media_type.startswith("audio/"):
        found.extend([] if reply.body else [f"an empty {media_type} response"])
    elif path == "/v1/admin/backup" and media_type == "application/x-tar":
        found.extend(_backup_problems(reply.body))
    else:
        found.append(f"a 2xx response of type {reply.content_type!r}")
    return found


RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _error_event_problems(event: dict[str, Any]) -> list[str]:
    """Why a Responses stream's `error` event is not OpenAI's shape with a documented code."""
    if set(event) != {"type", "sequence_number", "code", "message", "param"}:
        shape = "{type, sequence_number, code, message, param}"
        return [f"an error event that is not {shape}: {_clip(event)}"]
    found = []
    if event["code"] not in ERROR_CODES:
        found.append(f"an error event's `code` is not a documented code: {event['code']!r}")
    if not isinstance(event["message"], str) or not event["message"]:
        found.append(f"an error event's `message` is not a non-empty string: {_clip(event)}")
    if event["param"] is not None and not isinstance(event["param"], str):
        found.append(f"an error event's `param` is neither a string nor null: {_clip(event)}")
    return found


def _backup_problems(body: bytes) -> list[str]:
    """The admin API's backup: a whole tar archive, its manifest first; or, sealed with a
    passphrase (shared/sealing.py), the tar of its sealed identity and the sealed archive."""
    try:
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            names = tar.getnames()
    except tarfile.TarError as err:
        return [f"a backup that is not a tar archive: {err}"]
    if names == [IDENTITY_MEMBER, PAYLOAD_MEMBER]:
        return []
    return [] if names[:1] == ["manifest.json"] else ["a backup without its manifest first"]


def _event_stream_problems(text: str, *, complete: bool) -> list[str]:
    # Event streams end lines with CR, LF or CRLF only (not str.splitlines' U+2028 and kin).
    lines = SSE_LINE_END.split(text)
    events = [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]
    if not events:
        return ["an event stream without events"]
    found = []
    last = "chunk"
    for data in events:
        if data == "[DONE]":
            last = "done"
            continue
        try:
            event = json.loads(data)
        except ValueError:
            found.append(f"an event that is not JSON: {_clip(data)}")
            continue
        if isinstance(event, dict) and "error" in event:
            # A failure after the 200 went out (output_validation_failed) is still the shape.
            found.extend(error_shape_problems(event, ErrorCode.output_validation_failed.status))
            last = "error"
        elif isinstance(event, dict) and "choices" in event:
            last = "chunk"
        elif isinstance(event, dict) and event.get("type") == "speech.audio.delta":
            last = "chunk"  # speech's events (`stream_format: "sse"`), ended by their done
        elif isinstance(event, dict) and event.get("type") == "speech.audio.done":
            last = "done"
        elif isinstance(event, dict) and event.get("type") == "error":
            # The Responses API's failure after the 200 went out: OpenAI's error event.
            found.extend(_error_event_problems(event))
            last = "error"
        elif isinstance(event, dict) and str(event.get("type", "")).startswith("response."):
            # The Responses API's typed events, ended by the response's final state.
            last = "done" if event["type"] in RESPONSE_ENDS else "chunk"
        else:
            found.append(f"an event that is neither a chunk nor an error: {_clip(data)}")
    if complete and last == "chunk":
        # A stream cut off by a failure after the 200 went out ends without either.
        found.append(f"an event stream that ends without [DONE] or an error: {_clip(events[-1])}")
    return found


# -- schemathesis: every operation of the served document, positive and negative ---------------


@dataclass
class Tally:
    """What one fuzz run sent and got back."""

    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    # One reproduction per distinct problem.
    failures: dict[str, str] = field(default_factory=dict)

    def count(self, reply: Reply) -> None:
        self.cases += 1
        self.statuses[reply.status] += 1
        if reply.status >= 300:
            try:
                code = reply.json()["error"]["code"]
            except (ValueError, TypeError, KeyError):
                code = "(not the error shape)"
            self.codes[str(code)] += 1

    def report(self) -> str:
        return (
            f"{len(self.failures)} distinct problems in {self.cases} cases "
            f"(statuses {dict(self.statuses)}, codes {dict(self.codes)}):\n\n"
            + "\n\n".join(self.failures.values())
        )


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same cases on every run and every machine
    database=None,
    deadline=None,  # a case that reaches the model takes its time
    # Collect, don't shrink: the test reports every distinct failure at the end.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=False,
)
SCHEMATHESIS_CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Routes only the hub calls (burst offload, with the node's secret) are fuzzed as a LAN
# client sees them: every request is refused (the authentication tests below), none served.
CLIENT_ROUTES = [route for route in ROUTES if route.caller == "client"]
BODY_OPERATIONS = {(r.method, r.path) for r in CLIENT_ROUTES if r.body is not None}
SUCCESS = {(route.method, route.path): route.status for route in ROUTES}
# Every route with schema-valid requests; those with a body with schema-violating ones too (an
# operation without parameters or a body has nothing to violate).
FUZZ_RUNS = [
    (route.method, route.path, mode)
    for route in CLIENT_ROUTES
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or route.body is not None
]


# How a schema-valid body is adjusted before it goes out, still schema-valid: most name the
# served model, as a random name only ever reaches model_not_found; most of those keep the
# token counts within the server's limit, which the document cannot state, as more only ever
# reaches the 400 in front of the model.
ADJUSTMENTS = ["served model, within the limit"] * 2 + ["served model", "as generated"]


# Every package request the fuzzing sends asks for this one (a cache hit after the first):
# generated ones would each be a package made on the model, minutes for the lot.
FUZZ_ITEM = json.dumps(
    {"statement": "Fuzzing sends a server many odd requests.", "answer": True, "explanation": ""}
)
FUZZ_PACKAGE = {
    "topic": "fuzzing",
    "level": "beginner",
    "spec": {"items": 1, "item_types": ["true_false"], "narration": False, "language": "en",
             "choices": 4},
}  # fmt: skip


def adjust_valid_body(
    body: dict[str, Any], adjust: str, model: str, path: str, trial: str | None = None
) -> None:
    if adjust_modelless_body(body, adjust, path, trial) or adjust == "as generated":
        return
    if isinstance(body.get("requests"), list):
        adjust_job(body, model)
        return
    body["model"] = model
    if path == "/v1/audio/speech":
        # A voice it has (a random name is a 400) in a format it makes; the text as generated.
        body["voice"] = "alloy"
        if body.get("response_format") == "aac":
            body["response_format"] = "wav"
    if "replicas" in body:
        # The admin route: the served model keeps its one replica (more would start a
        # worker process per replica, up to eight, for nothing the fuzzing needs).
        body["replicas"] = 1
    if adjust == "served model, within the limit":
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int | float) and body[name] > MAX_TOKENS_LIMIT:
                body[name] = MAX_TOKENS_LIMIT


def adjust_modelless_body(body: dict[str, Any], adjust: str, path: str, trial: str | None) -> bool:
    """The bodies that name no model, adjusted; whether `path` is one of theirs."""
    if path in {"/v1/packages", "/v1/admin/backup"}:
        # A package: the one the fuzzing made. A backup: no passphrase, as its seal runs
        # scrypt (seconds and a GiB each; tests/appliance/test_sealed_backup.py seals with
        # one); the generated recipients are refused.
        kept = FUZZ_PACKAGE if path == "/v1/packages" else body.copy()
        body.clear()
        body.update({k: v for k, v in kept.items() if k != "passphrase"})
        return True
    if path.startswith("/v1/admin/packages/"):
        body.pop("version", None)  # the cached version
        return True
    if path in {"/v1/admin/network", "/v1/admin/network/confirm"}:
        # A confirmation names, as a rule, the change on trial (`trial`).
        if path.endswith("/confirm") and adjust != "as generated" and trial is not None:
            body["id"] = trial
        return True
    if path in {"/v1/admin/accounts", "/v1/admin/keys", "/v1/admin/bundles"}:
        # Any account name the schema allows can be made (or is taken: 409); a key is of an
        # account that exists, as a generated name only ever reaches account_not_found.
        if path == "/v1/admin/keys" and adjust != "as generated":
            body["account"] = FUZZ_ACCOUNT
        return True
    return False


def adjust_job(body: dict[str, Any], model: str) -> None:
    """A job's items, as generated, hold arbitrary bodies: give them ones their routes accept,
    two items at most (each runs on the model in the background), and no webhook (the
    generated URLs lead nowhere)."""
    body.pop("webhook_url", None)
    body["requests"] = body["requests"][:2]
    for item in body["requests"]:
        if not isinstance(item, dict):
            continue
        if item.get("url") == "/v1/chat/completions":
            prompt: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        else:
            prompt = {"prompt": "hi"}
        item["body"] = {"model": model, "max_tokens": 1, **prompt}


@pytest.mark.parametrize(
    ("method", "path", "mode"), FUZZ_RUNS, ids=[f"{m} {p} {mode.value}" for m, p, mode in FUZZ_RUNS]
)
def test_fuzz_operation(fuzzed: Fuzzed, method: str, path: str, mode: GenerationMode) -> None:
    """Generated requests for one operation: no 5xx, no traceback, no other error shape."""
    operation = fuzzed.schema[path][method]  # raises if the served document lacks the route
    has_body = (method, path) in BODY_OPERATIONS
    tally = Tally()

    @FUZZ_SETTINGS
    @given(
        case=operation.as_strategy(generation_mode=mode, headers=fuzzed.auth),
        adjust=st.sampled_from(ADJUSTMENTS),
    )
    def run(case: Any, adjust: str) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            trial = fuzzed.network_trial() if path == "/v1/admin/network/confirm" else None
            adjust_valid_body(case.body, adjust, fuzzed.model_for(path), path, trial)
        if mode is GenerationMode.POSITIVE and "packages/{id}" in path:
            case.path_parameters = {**(case.path_parameters or {}), "id": fuzzed.package_id}
        try:
            response = case.call(headers=fuzzed.auth, timeout=TIMEOUT_S)
        except Exception as exc:  # no response at all is the finding
            alive = fuzzed.appliance.process.poll() is None
            tally.failures.setdefault(
                f"no response: {type(exc).__name__}",
                f"no response ({'server alive' if alive else 'the server died'}): {exc}\n"
                f"  request: {method} {path}\n  body: {_clip(case.body, 3000)}",
            )
            if not alive:
                raise
            return
        reply = Reply(
            response.status_code,
            ",".join(response.headers.get("content-type", [])),
            response.content,
            complete=not response.stream_cut_short,
        )
        tally.count(reply)
        problems = contract_problems(path, reply)
        try:
            case.validate_response(response, checks=SCHEMATHESIS_CHECKS, headers=fuzzed.auth)
        except FailureGroup as group:
            problems.extend(f"schemathesis: {failure.title}" for failure in group.exceptions)
        for problem in problems:
            cause = fuzzed.server_exception(reply) if reply.status >= 500 else None
            key = f"{problem} ({cause})" if cause else problem
            tally.failures.setdefault(
                key,
                f"{key}\n  request: {method} {path}, Content-Type {case.media_type}\n"
                f"  body sent: {_clip(response.request.body, 3000)}\n  response: {reply}",
            )

    run()
    assert not tally.failures, tally.report()
    assert tally.cases >= (EXAMPLES // 2 if has_body else 1), tally.report()
    if mode is GenerationMode.POSITIVE and has_body:
        # The fuzzing reached the model, not only the validation in front of it.
        assert tally.statuses[SUCCESS[(method, path)]] > 0, tally.report()


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
    """One request with exactly these bytes and headers (no client-side encoding)."""
    url = urllib.parse.urlsplit(base_url)
    assert url.hostname is not None
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT_S)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return Reply(response.status, response.getheader("Content-Type", ""), response.read())
    finally:
        connection.close()


def assert_contract(fuzzed: Fuzzed, path: str, reply: Reply, sent: object) -> None:
    problems = contract_problems(path, reply)
    if reply.status >= 500:
        problems.append(f"server exception: {fuzzed.server_exception(reply)}")
    assert not problems, f"{problems}\n  sent: {_clip(sent, 2000)}\n  response: {reply}"


# No shrinking: each step is a request to a server that may be sharing two cores with a
# model, and shrinking one failure has taken minutes. The first failing input is reported
# as generated, and derandomized generation tries small inputs first.
PROPERTY_SETTINGS = settings(FUZZ_SETTINGS, max_examples=PROPERTY_EXAMPLES)
# Each with its own method (most are POST; a network change is a PUT), sent as they are.
BODY_ROUTES = sorted((method, path) for method, path in BODY_OPERATIONS if "{" not in path)
AUTH_OPERATIONS = [(route.method, route.path) for route in ROUTES if route.auth]
JSON = {"Content-Type": "application/json"}

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
    """A JSON object's bytes, cut short or with a byte spliced in that UTF-8 does not allow."""
    raw = json.dumps(draw(json_objects), ensure_ascii=draw(st.booleans())).encode()
    at = draw(st.integers(0, len(raw) - 1))
    if draw(st.booleans()):
        return raw[:at]
    return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"])) + raw[at:]


raw_bodies = st.one_of(
    st.binary(max_size=1024),
    st.text(max_size=200).map(str.encode),
    broken_json(),
    # Around the limit: 413 above it, invalid_json up to it.
    st.integers(MAX_BODY_BYTES - 2, MAX_BODY_BYTES + 2).map(lambda n: b"\xff" * n),
)


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)  # as lenient as the server: UTF-16/32, a BOM
    except ValueError:
        return False


def test_arbitrary_bytes_are_invalid_json(fuzzed: Fuzzed) -> None:
    """A body that is not a JSON object (not JSON, not UTF-8) is a 400 invalid_json; over the
    limit, a 413 request_too_large."""

    @PROPERTY_SETTINGS
    @given(
        route=st.sampled_from(BODY_ROUTES), raw=raw_bodies.filter(lambda b: not _is_json_object(b))
    )
    def run(route: tuple[str, str], raw: bytes) -> None:
        method, path = route
        reply = send(fuzzed.appliance.base_url, method, path, raw, {**fuzzed.auth, **JSON})
        assert_contract(fuzzed, path, reply, raw)
        too_large = len(raw) > MAX_BODY_BYTES
        expected = ErrorCode.request_too_large if too_large else ErrorCode.invalid_json
        code = reply.json()["error"]["code"]
        assert (reply.status, code) == (expected.status, expected.value), (raw, reply)

    run()


def test_json_that_is_not_an_object_is_a_400(fuzzed: Fuzzed) -> None:
    """An array, string, number, boolean or null body is a 400 invalid_json, whatever it holds."""

    @PROPERTY_SETTINGS
    @given(
        route=st.sampled_from(BODY_ROUTES),
        value=json_values.filter(lambda v: not isinstance(v, dict)),
        ascii_only=st.booleans(),
    )
    def run(route: tuple[str, str], value: object, ascii_only: bool) -> None:
        method, path = route
        raw = json.dumps(value, ensure_ascii=ascii_only).encode()
        reply = send(fuzzed.appliance.base_url, method, path, raw, {**fuzzed.auth, **JSON})
        assert_contract(fuzzed, path, reply, raw)
        code = reply.json()["error"]["code"]
        assert (reply.status, code) == (400, ErrorCode.invalid_json.value), (raw, reply)

    run()


# RFC 9110 field values: visible ASCII and obs-text, with spaces and tabs.
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f")
    | st.just("\t"),
    max_size=80,
)
authorizations = st.one_of(
    header_text,
    st.tuples(
        st.sampled_from(["Bearer", "bearer", "BEARER", "Basic", "Token", "Bearer\t"]),
        st.sampled_from([" ", "  ", "\t"]),
        header_text,
    ).map("".join),
)


def test_any_other_authorization_is_a_401(fuzzed: Fuzzed) -> None:
    """Any `Authorization` value but the key's is a 401 in the error shape."""
    body = json.dumps({"model": fuzzed.model, "prompt": "hi", "max_tokens": 1}).encode()

    @PROPERTY_SETTINGS
    @given(operation=st.sampled_from(AUTH_OPERATIONS), authorization=authorizations)
    def run(operation: tuple[str, str], authorization: str) -> None:
        method, path = operation
        headers = {"Authorization": authorization, **JSON}
        reply = send(
            fuzzed.appliance.base_url, method, path, body if method == "POST" else None, headers
        )
        assert_contract(fuzzed, path, reply, authorization)
        assert reply.status == 401, (authorization, reply)
        assert reply.json()["error"]["code"] in {
            ErrorCode.missing_api_key.value,
            ErrorCode.invalid_api_key.value,
        }, (authorization, reply)

    run()


def test_no_authorization_is_missing_api_key(fuzzed: Fuzzed) -> None:
    for method, path in AUTH_OPERATIONS:
        reply = send(fuzzed.appliance.base_url, method, path, b"{}" if method == "POST" else None)
        assert_contract(fuzzed, path, reply, None)
        assert (reply.status, reply.json()["error"]["code"]) == (401, "missing_api_key"), reply


# Where a request carries text: (path, a body with a "<S>" placeholder in one string).
TEXT_FIELDS = [
    ("/v1/completions", {"prompt": "<S>"}),
    ("/v1/completions", {"prompt": ["<S>"]}),
    ("/v1/completions", {"prompt": "hi", "stop": "<S>"}),
    ("/v1/completions", {"prompt": "hi", "user": "<S>"}),
    ("/v1/completions", {"prompt": "hi", "model": "<S>"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<S>"}]}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "<S>"}]}]},
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "<S>"}]}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "<S>"}, {"role": "user", "content": "hi"}]},
    ),
]


@pytest.mark.parametrize(
    ("path", "fields"), TEXT_FIELDS, ids=[json.dumps(fields) for _, fields in TEXT_FIELDS]
)
def test_lone_surrogates_hold_the_contract(
    fuzzed: Fuzzed, path: str, fields: dict[str, Any]
) -> None:
    """A lone UTF-16 surrogate, which no UTF-8 string holds, escaped (JSON allows `\\ud800`) or
    as its 3 UTF-8-like bytes (Python's JSON decoder lets them through): wherever one is, the
    answer is a 4xx in the error shape or a completion, never a 500."""

    @settings(PROPERTY_SETTINGS, max_examples=tries(16))
    @given(
        before=st.text(max_size=4),
        surrogate=st.integers(0xD800, 0xDFFF),
        after=st.text(max_size=4),
        escaped=st.booleans(),
    )
    def run(before: str, surrogate: int, after: str, escaped: bool) -> None:
        body = {"model": fuzzed.model, "max_tokens": 1, **fields}
        before_after = [json.dumps(text)[1:-1].encode() for text in (before, after)]
        lone = (
            f"\\u{surrogate:04x}".encode()
            if escaped
            else chr(surrogate).encode("utf-8", "surrogatepass")
        )
        raw = json.dumps(body).encode().replace(b"<S>", lone.join(before_after))
        reply = send(fuzzed.appliance.base_url, "POST", path, raw, {**fuzzed.auth, **JSON})
        assert_contract(fuzzed, path, reply, raw)

    run()


ENCODERS: dict[str, Callable[[bytes], bytes] | None] = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,
    # aiohttp decodes these only with optional packages installed; without, it refuses them.
    "br": None,
    "zstd": None,
    # Not codings aiohttp knows: the body arrives as sent.
    "identity": None,
    "compress": None,
    "bogus": None,
}


@pytest.mark.parametrize("encoding", list(ENCODERS))
def test_content_encodings_hold_the_contract(fuzzed: Fuzzed, encoding: str) -> None:
    """A body in any `Content-Encoding`, decodable or not, gets a 4xx in the error shape
    (the request names a model that does not exist), never a 500."""
    encoder = ENCODERS[encoding]

    @settings(PROPERTY_SETTINGS, max_examples=tries(20))
    @given(
        route=st.sampled_from(BODY_ROUTES),
        prompt=st.text(max_size=20),
        kind=st.sampled_from(["garbage", "plain", "encoded"]),
        garbage=st.binary(max_size=64),
    )
    def run(route: tuple[str, str], prompt: str, kind: str, garbage: bytes) -> None:
        method, path = route
        plain = json.dumps({"model": "no-such-model", "prompt": prompt}).encode()
        if kind == "garbage":
            raw = garbage
        else:
            raw = encoder(plain) if kind == "encoded" and encoder is not None else plain
        headers = {**fuzzed.auth, **JSON, "Content-Encoding": encoding}
        reply = send(fuzzed.appliance.base_url, method, path, raw, headers)
        assert_contract(fuzzed, path, reply, (encoding, raw))
        assert 400 <= reply.status < 500, (encoding, raw, reply)

    run()


def _pattern(template: str) -> re.Pattern[str]:
    # As aiohttp's router: a `{name}` matches one or more characters but `/`, `{` and `}`;
    # a `{name:regex}` matches its regex (which may hold braces of its own).
    out, i = [], 0
    while i < len(template):
        if template[i] != "{":
            out.append(re.escape(template[i]))
            i += 1
            continue
        depth, j = 1, i + 1
        while depth:
            depth += {"{": 1, "}": -1}.get(template[j], 0)
            j += 1
        inner = template[i + 1 : j - 1]
        out.append(inner.split(":", 1)[1] if ":" in inner else "[^{}/]+")
        i = j
    return re.compile("".join(out))


ROUTE_PATTERNS = [(route, _pattern(route.router_path or route.path)) for route in ROUTES]
# Templates with a value in place of each `{name}`, so their own routes are reached too.
KNOWN_PATHS = sorted({re.sub(r"\{[^}]+\}", "x", route.path) for route in ROUTES})
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"]


def routed(method: str, path: str) -> tuple[int, frozenset[str]]:
    """The status and codes a request that no route serves gets: a path no route has is a
    404 `not_found`, a method its route does not have a 405; a path a route's template
    matches reaches that route, whose handler finds no such object (its own 404)."""
    matching = [
        route for route, pattern in ROUTE_PATTERNS if pattern.fullmatch(yarl.URL(path).path_safe)
    ]
    if not matching:
        return 404, frozenset({ErrorCode.not_found.value})
    own = [route for route in matching if route.method == method]
    if not own:
        return 405, frozenset({ErrorCode.method_not_allowed.value})
    return 404, frozenset(code.value for r in own for code in r.errors if code.status == 404)


def test_other_methods_and_paths_hold_the_contract(fuzzed: Fuzzed) -> None:
    """A method a route does not have is a 405, a path no route has is a 404, both in the shape."""
    served = {(route.method, route.path) for route in ROUTES if "{" not in route.path}

    @PROPERTY_SETTINGS
    @given(
        method=st.sampled_from(METHODS),
        path=st.sampled_from(KNOWN_PATHS)
        | st.tuples(st.sampled_from(["/", "/v1/", *KNOWN_PATHS]), st.text(max_size=12)).map(
            lambda parts: parts[0] + urllib.parse.quote(parts[1], safe="/")
        ),
    )
    def run(method: str, path: str) -> None:
        if (method, path) in served:
            return
        reply = send(fuzzed.appliance.base_url, method, path, b"{}", {**fuzzed.auth, **JSON})
        assert_contract(fuzzed, path, reply, (method, path))
        status, codes = routed(method, path)
        assert reply.status == status, reply
        assert reply.json()["error"]["code"] in codes, reply

    run()


def send_raw(base_url: str, request: bytes) -> Reply:
    """Bytes no HTTP client library would send; the request must say `Connection: close`."""
    url = urllib.parse.urlsplit(base_url)
    assert url.hostname is not None
    assert url.port is not None
    with socket.create_connection((url.hostname, url.port), timeout=TIMEOUT_S) as sock:
        received = b""
        try:
            sock.sendall(request)
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:  # the server may answer and close before reading it all
            pass
    assert received, f"no response to {_clip(request, 300)}"
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in header_lines)
    }
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = dechunk(body)
    return Reply(int(status_line.split()[1]), headers.get("content-type", ""), body)


def test_malformed_http_gets_the_error_shape(fuzzed: Fuzzed) -> None:
    """What aiohttp's HTTP parser refuses, before any route or middleware runs, is a 400 like
    any other: the error shape, as JSON."""
    auth = f"Authorization: Bearer {fuzzed.appliance.key}\r\n".encode()
    body = json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()

    def get(target: bytes = b"/v1/models", extra: bytes = b"", method: bytes = b"GET") -> bytes:
        return b"%s %s HTTP/1.1\r\nHost: x\r\n%s%sConnection: close\r\n\r\n" % (
            method,
            target,
            auth,
            extra,
        )

    def post(extra: bytes, payload: bytes = body) -> bytes:
        return (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s%s"
            b"Connection: close\r\n\r\n%s" % (auth, extra, payload)
        )

    malformed = {
        "an unknown method token": get(method=b"FROB"),
        "a lowercase method": get(method=b"get"),
        "a request target over 8190 bytes": get(target=b"/v1/models?" + b"a" * 9000),
        "a header line over 8190 bytes": get(extra=b"X-Long: " + b"a" * 9000 + b"\r\n"),
        "a space in a header name": get(extra=b"X Bad: 1\r\n"),
        "a NUL in a header value": get(extra=b"X-Bad: a\x00b\r\n"),
        "an obsolete line folding": get(extra=b"X-Bad: a\r\n b\r\n"),
        "a Content-Length that is not a number": post(b"Content-Length: ten\r\n"),
        "both Content-Length and Transfer-Encoding": post(
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"
        ),
        "a chunk size that is not hex": post(
            b"Transfer-Encoding: chunked\r\n", b"zz\r\n" + body + b"\r\n0\r\n\r\n"
        ),
    }
    failures = []
    for name, request in malformed.items():
        reply = send_raw(fuzzed.appliance.base_url, request)
        problems = contract_problems("/v1/models", reply)
        if reply.status < 400:
            problems.append("accepted")
        if problems:
            failures.append(
                f"{name}: {problems}\n  sent: {_clip(request, 300)}\n  response: {reply}"
            )
    assert not failures, f"{len(failures)} of {len(malformed)}:\n" + "\n".join(failures)
