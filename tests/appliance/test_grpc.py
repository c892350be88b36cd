"""The gRPC API (kovenlab.edge.v1.Inference) of a real appliance process on loopback,
driven by grpcio's own client: streamed generations from the real model, embeddings, the
model list, its errors as status codes with their trailing metadata, a client that
cancels, and TLS with the LAN API's certificate (renewed while it runs, and mutual)."""

from __future__ import annotations

import contextlib
import json
import socket
import sqlite3
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from appliance.grpc.errors import status_code
from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2 as pb
from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2_grpc as pb_grpc
from appliance.grpc.server import client_address
from shared.errors import ErrorCode
from tests.appliance.tls import make_certificate
from tests.conftest import (
    REAL_MODEL_ENV,
    ApplianceProcess,
    free_port,
    kvl,
    running_appliance,
    spawn_appliance,
)
from tests.waiting import until_sync

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

MODEL = "gemma-3-270m"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
GENERATE = "/kovenlab.edge.v1.Inference/Generate"
TIMEOUT_S = 60.0
Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass
class GrpcAppliance:
    process: ApplianceProcess
    port: int
    key: str
    s0_key: str  # an S0 account, allowed one request a minute

    def stub(self) -> pb_grpc.InferenceStub:
        return pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))

    def auth(self, key: str | None = None) -> Metadata:
        return (("authorization", f"Bearer {key or self.key}"),)

    def usage(self, route: str) -> list[tuple[int, int, int, str]]:
        db = sqlite3.connect(self.process.data_dir / "appliance.db")
        try:
            rows: list[tuple[int, int, int, str]] = db.execute(
                "SELECT tokens_in, tokens_out, status, finish_reason FROM usage_events "
                "WHERE route = ? ORDER BY created_at",
                (route,),
            ).fetchall()
        finally:
            db.close()
        return rows


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcAppliance]:
    data_dir = tmp_path_factory.mktemp("grpc-appliance")

    def key(*args: str) -> str:
        return kvl("appliance", "keys", "create", *args, "--data-dir", str(data_dir)).stdout.strip()

    main, s0 = key("--account", "service"), key("--account", "slow", "--class", "S0")
    port = free_port()
    env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_MODEL__N_CTX": "2048",
        "KVL_GRPC__ENABLED": "true",
        "KVL_GRPC__PORT": str(port),
        **REAL_MODEL_ENV,
        "KVL_CLASSES__S0__REQUESTS_PER_MINUTE": "1",
        # A client that asks again at once is held after two refusals a second, briefly.
        "KVL_CLASSES__REFUSALS_PER_SECOND": "2",
        "KVL_CLASSES__REFUSAL_HOLD_S": "0.1",
    }
    with running_appliance(data_dir, main, env) as process:
        yield GrpcAppliance(process, port, main, s0)


def _rest(appliance: GrpcAppliance, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        f"{appliance.process.base_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {appliance.key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        answer: dict[str, object] = json.loads(response.read())
    return answer


def _failed(err: grpc.RpcError) -> tuple[grpc.StatusCode, dict[str, str | bytes], str]:
    """A failed call's status code, trailing metadata and details (grpc's failures are
    both the RpcError raised and the Call it ended)."""
    call = cast("grpc.Call", err)
    return call.code(), dict(call.trailing_metadata() or ()), call.details() or ""


@pytest.mark.model
def test_generate_streams_the_models_text_and_records_its_usage(
    appliance: GrpcAppliance,
) -> None:
    call = appliance.stub().Generate(
        pb.GenerateRequest(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
        ),
        metadata=appliance.auth(),
        timeout=TIMEOUT_S,
    )
    replies = list(call)
    *deltas, last = replies
    text = "".join(reply.text for reply in deltas)
    assert text.strip()
    assert all(reply.text and not reply.HasField("usage") for reply in deltas)
    assert last.text == ""
    assert last.finish_reason in {"stop", "length"}
    assert 0 < last.usage.completion_tokens <= 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    initial = dict(call.initial_metadata() or ())
    assert str(initial["kvl-model"]).startswith(f"{MODEL}@")
    assert initial["x-request-id"]
    # The same drive as REST: greedy decoding gives the same text either way.
    rest = _rest(
        appliance,
        "/v1/completions",
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    )
    choices = rest["choices"]
    assert isinstance(choices, list)
    assert choices[0]["text"] == text
    usage = last.usage
    assert (usage.prompt_tokens, usage.completion_tokens, 200, last.finish_reason) in (
        appliance.usage(GENERATE)
    )


@pytest.mark.model
def test_chat_with_a_json_schema_gives_valid_json(appliance: GrpcAppliance) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    replies = list(
        appliance.stub().Chat(
            pb.ChatRequest(
                model=MODEL,
                messages=[pb.ChatMessage(role="user", content="Describe Paris as JSON.")],
                max_tokens=60,
                temperature=0,
                response_format=pb.ResponseFormat(
                    type="json_schema", json_schema_name="city", json_schema=json.dumps(schema)
                ),
            ),
            metadata=appliance.auth(),
            timeout=TIMEOUT_S,
        )
    )
    value = json.loads("".join(reply.text for reply in replies))
    assert set(value) == {"city", "country"}
    assert replies[-1].usage.completion_tokens > 0
    assert appliance.usage("/kovenlab.edge.v1.Inference/Chat")


@pytest.mark.model
def test_embed_and_list_models(appliance: GrpcAppliance) -> None:
    stub = appliance.stub()
    reply = stub.Embed(
        pb.EmbedRequest(model=EMBEDDING_MODEL, input=["Hello, world!", "Hi there!"]),
        metadata=appliance.auth(),
        timeout=TIMEOUT_S,
    )
    assert [len(item.values) for item in reply.data] == [384, 384]
    assert sum(v * v for v in reply.data[0].values) == pytest.approx(1.0, abs=1e-4)
    assert reply.model.startswith(f"{EMBEDDING_MODEL}@")
    assert reply.usage.prompt_tokens > 0
    [(tokens_in, tokens_out, status, _)] = appliance.usage("/kovenlab.edge.v1.Inference/Embed")
    assert (tokens_in, tokens_out, status) == (reply.usage.prompt_tokens, 0, 200)
    models = stub.ListModels(pb.ListModelsRequest(), metadata=appliance.auth(), timeout=TIMEOUT_S)
    assert [m.id for m in models.models] == [MODEL, EMBEDDING_MODEL]
    assert models.models[0].context_length == 2048
    assert models.models[1].dimension == 384


@pytest.mark.model
def test_a_missing_or_wrong_key_is_unauthenticated(appliance: GrpcAppliance) -> None:
    stub = appliance.stub()
    cases: list[tuple[Metadata, str]] = [
        ((), "missing_api_key"),
        (appliance.auth("kvl_wrong_key"), "invalid_api_key"),
    ]
    for metadata, code in cases:
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=TIMEOUT_S)
        status, trailers, _ = _failed(refused.value)
        assert status == grpc.StatusCode.UNAUTHENTICATED
        assert trailers["kvl-error-code"] == code


@pytest.mark.model
def test_a_bad_argument_is_invalid_argument_with_its_code_and_param(
    appliance: GrpcAppliance,
) -> None:
    stub = appliance.stub()
    with pytest.raises(grpc.RpcError) as bad:
        list(
            stub.Generate(
                pb.GenerateRequest(model=MODEL, prompt="x", temperature=5),
                metadata=appliance.auth(),
                timeout=TIMEOUT_S,
            )
        )
    status, trailers, message = _failed(bad.value)
    assert status == grpc.StatusCode.INVALID_ARGUMENT
    assert trailers["kvl-error-code"] == "invalid_value"
    assert trailers["kvl-error-param"] == "temperature"
    assert "temperature" in message
    # The rich error model: google.rpc.Status with an ErrorInfo naming the code.
    details = trailers["grpc-status-details-bin"]
    assert isinstance(details, bytes)
    info = error_details_pb2.ErrorInfo()
    assert status_pb2.Status.FromString(details).details[0].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "invalid_value",
        "kovenlab.edge",
        {"param": "temperature"},
    )
    with pytest.raises(grpc.RpcError) as schema:
        list(
            stub.Chat(
                pb.ChatRequest(
                    model=MODEL,
                    messages=[pb.ChatMessage(role="user", content="x")],
                    response_format=pb.ResponseFormat(
                        type="json_schema", json_schema_name="s", json_schema="{not json"
                    ),
                ),
                metadata=appliance.auth(),
                timeout=TIMEOUT_S,
            )
        )
    status, trailers, _ = _failed(schema.value)
    assert (status, trailers["kvl-error-code"]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "invalid_schema",
    )
    with pytest.raises(grpc.RpcError) as unknown:
        list(
            stub.Generate(
                pb.GenerateRequest(model="no-such-model", prompt="x"),
                metadata=appliance.auth(),
                timeout=TIMEOUT_S,
            )
        )
    status, trailers, _ = _failed(unknown.value)
    assert (status, trailers["kvl-error-code"]) == (grpc.StatusCode.NOT_FOUND, "model_not_found")


@pytest.mark.model
def test_over_quota_is_resource_exhausted_with_retry_info(appliance: GrpcAppliance) -> None:
    stub = appliance.stub()
    request = pb.GenerateRequest(model=MODEL, prompt="One", max_tokens=1)
    list(stub.Generate(request, metadata=appliance.auth(appliance.s0_key), timeout=TIMEOUT_S))
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, metadata=appliance.auth(appliance.s0_key), timeout=TIMEOUT_S))
    status, trailers, _ = _failed(refused.value)
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailers["kvl-error-code"] == "rate_limit_exceeded"
    seconds = int(trailers["retry-after"])
    assert 1 <= seconds <= 60
    details = trailers["grpc-status-details-bin"]
    assert isinstance(details, bytes)
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in status_pb2.Status.FromString(details).details)
    assert retry.retry_delay.seconds == seconds


def _held(appliance: GrpcAppliance) -> float:
    with urllib.request.urlopen(f"{appliance.process.base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    [line] = [x for x in text.splitlines() if x.startswith("kvl_refusals_held_total ")]
    return float(line.split()[1])


@pytest.mark.model
def test_a_key_that_calls_again_without_waiting_is_held_as_on_http(
    appliance: GrpcAppliance,
) -> None:
    stub = appliance.stub()
    request = pb.GenerateRequest(model=MODEL, prompt="One", max_tokens=1)
    with contextlib.suppress(grpc.RpcError):  # the S0 account's one call a minute, if left
        list(stub.Generate(request, metadata=appliance.auth(appliance.s0_key), timeout=TIMEOUT_S))
    before = _held(appliance)
    for _ in range(12):
        with pytest.raises(grpc.RpcError) as refused:
            list(
                stub.Generate(request, metadata=appliance.auth(appliance.s0_key), timeout=TIMEOUT_S)
            )
        status, trailers, _ = _failed(refused.value)
        assert (status, trailers["kvl-error-code"]) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "rate_limit_exceeded",
        )
    # Two a second pass at once; the rest of a loop this fast waits its hold first.
    assert 8 <= _held(appliance) - before <= 12
    # Other keys are not held: the main account is served.
    replies = list(stub.Generate(request, metadata=appliance.auth(), timeout=TIMEOUT_S))
    assert replies[-1].finish_reason in {"stop", "length"}


@pytest.mark.model
def test_a_client_that_cancels_stops_the_sequence_and_its_tokens_are_recorded(
    appliance: GrpcAppliance,
) -> None:
    before = len(appliance.usage(GENERATE))
    call = appliance.stub().Generate(
        pb.GenerateRequest(model=MODEL, prompt="Once upon a time", max_tokens=400, seed=7),
        metadata=appliance.auth(),
        timeout=TIMEOUT_S,
    )
    first = next(call)
    assert first.text
    call.cancel()
    until_sync(lambda: len(appliance.usage(GENERATE)) > before, "the cancelled call's usage")
    _, tokens_out, status, finish_reason = appliance.usage(GENERATE)[-1]
    assert (status, finish_reason) == (499, "cancelled")
    assert 1 <= tokens_out < 400  # stopped, not run to max_tokens
    with urllib.request.urlopen(f"{appliance.process.base_url}/metrics") as response:
        metrics = response.read().decode()
    assert 'kvl_grpc_calls_total{method="Generate",status="CANCELLED"}' in metrics
    assert 'kvl_grpc_calls_total{method="Generate",status="OK"}' in metrics


# -- TLS: the LAN API's certificate, renewed while the appliance runs -----------------------


def _certificate(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True)
    return make_certificate(folder)


def _alive(port: int, context: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/healthz", context=context, timeout=2
        ) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError):
        return False


def _secure_stub(
    port: int, trust: Path, client: tuple[Path, Path] | None = None
) -> pb_grpc.InferenceStub:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=trust.read_bytes(),
        private_key=client[1].read_bytes() if client else None,
        certificate_chain=client[0].read_bytes() if client else None,
    )
    # A connection of its own (grpc shares them between alike channels): a new handshake.
    options = [("grpc.use_local_subchannel_pool", 1)]
    return pb_grpc.InferenceStub(
        grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options)
    )


@contextlib.contextmanager
def _tls_appliance(tmp_path: Path, **grpc_env: str) -> Iterator[tuple[int, str, Path, Path]]:
    """An appliance over TLS with the operator's certificate, gRPC on, no model (the calls
    here need none): its gRPC port, an API key, the certificate and its key."""
    cert, key = _certificate(tmp_path / "server")
    data_dir = tmp_path / "data"
    api_key = kvl(
        "appliance", "keys", "create", "--account", "tls", "--data-dir", str(data_dir)
    ).stdout.strip()
    port, grpc_port = free_port(), free_port()
    env = {
        "KVL_SERVER__TLS_CERT_FILE": str(cert),
        "KVL_SERVER__TLS_KEY_FILE": str(key),
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_MODEL__DEFAULT": "absent-model",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_GRPC__ENABLED": "true",
        "KVL_GRPC__PORT": str(grpc_port),
        **{f"KVL_GRPC__{name.upper()}": value for name, value in grpc_env.items()},
    }
    with (data_dir / "serve.log").open("wb") as log:
        process = spawn_appliance(data_dir, port, env, log)
        try:
            verifying = ssl.create_default_context(cafile=str(cert))
            until_sync(
                lambda: process.poll() is None and _alive(port, verifying), "the appliance is up"
            )
            yield grpc_port, api_key, cert, key
        finally:
            process.terminate()
            process.wait(timeout=30)


def _models(stub: pb_grpc.InferenceStub, key: str) -> pb.ListModelsReply:
    reply: pb.ListModelsReply = stub.ListModels(
        pb.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),), timeout=10
    )
    return reply


def test_tls_serves_the_lan_certificate_and_follows_its_renewal(tmp_path: Path) -> None:
    with _tls_appliance(tmp_path) as (port, key, cert, cert_key):
        assert list(_models(_secure_stub(port, cert), key).models) == []  # no model here
        plain = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        with pytest.raises(grpc.RpcError) as refused:
            _models(plain, key)
        assert _failed(refused.value)[0] == grpc.StatusCode.UNAVAILABLE
        first = tmp_path / "first.pem"
        first.write_bytes(cert.read_bytes())
        # Renewed as the node renews its own: the new key, then the new certificate, each
        # renamed over the old file.
        new_cert, new_key = _certificate(tmp_path / "renewed")
        renewed = new_cert.read_bytes()
        new_key.replace(cert_key)
        new_cert.replace(cert)
        (tmp_path / "renewed.pem").write_bytes(renewed)
        # The next connection has the new certificate; one that trusts only the first fails.
        assert list(_models(_secure_stub(port, tmp_path / "renewed.pem"), key).models) == []
        with pytest.raises(grpc.RpcError) as untrusted:
            _models(_secure_stub(port, first), key)
        assert _failed(untrusted.value)[0] == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_of_the_ca(tmp_path: Path) -> None:
    client = _certificate(tmp_path / "client")  # self-signed: its own CA
    with _tls_appliance(tmp_path, client_ca_file=str(client[0])) as (port, key, cert, _):
        with pytest.raises(grpc.RpcError) as refused:
            _models(_secure_stub(port, cert), key)
        assert _failed(refused.value)[0] == grpc.StatusCode.UNAVAILABLE
        assert list(_models(_secure_stub(port, cert, client), key).models) == []


def test_a_taken_port_stops_the_start_at_once(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {
            "KVL_DISCOVERY__ENABLED": "false",
            "KVL_GRPC__ENABLED": "true",
            "KVL_GRPC__PORT": str(taken.getsockname()[1]),
        }
        process = spawn_appliance(tmp_path / "data", free_port(), env, subprocess.PIPE)
        output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert b"the gRPC API cannot listen on 127.0.0.1:" in output
    assert b"assembling" not in output  # before any model was touched


# -- without a process -------------------------------------------------------------------


def test_every_error_code_has_a_grpc_status() -> None:
    for code in ErrorCode:
        assert status_code(code) not in {grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK}, code
    assert status_code(ErrorCode.queue_full) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code(ErrorCode.model_not_ready) == grpc.StatusCode.UNAVAILABLE
    assert status_code(ErrorCode.permission_denied) == grpc.StatusCode.PERMISSION_DENIED


def test_the_client_address_is_read_from_the_peer() -> None:
    assert client_address("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert client_address("ipv6:%5B::1%5D:51234") == "::1"
    assert client_address("ipv6:[fe80::1]:443") == "fe80::1"
    assert client_address("unix:/run/kvl.sock") == "unix:/run/kvl.sock"
