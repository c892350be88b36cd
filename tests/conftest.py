"""Shared fixtures: real SQLite files in tmp dirs, the real default model, real servers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pytest
from aiohttp import web, web_app
from aiohttp.test_utils import TestClient
from pytest_aiohttp import AiohttpClient

from appliance.app import create_app
from appliance.gateway.appkeys import EMBEDDINGS, REGISTRY
from appliance.serving.catalog import (
    CHAT_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    ensure_default_model,
    register_file,
)
from appliance.settings import ApplianceSettings
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from shared.chat import GEMMA_TEMPLATE
from shared.classes import IsolationLevel
from shared.progress import ProgressBar
from tests.postgres import MISSING, Cluster, cluster, server_bin
from tests.scheduling import HeaviestFirst, heaviest_first

if TYPE_CHECKING:
    from collections.abc import Iterator

    from xdist.remote import Producer

REPO = Path(__file__).resolve().parents[1]
Client = TestClient[web.Request, web.Application]


@pytest.fixture(autouse=True)
def _forget_built_middlewares() -> Iterator[None]:
    """aiohttp keeps each handler's middleware chain in a process-wide cache of 1,024
    entries keyed by its applications (`aiohttp.web_app._cached_build_middleware`): built
    once in a server's life, but here it kept every test's app alive, with its model
    registry, its ONNX session and its event loop, about 100 MiB a test (the test process
    reached 14 GiB). Emptied after each test; a later request of an app that lives on only
    builds its chain again."""
    yield
    cache = getattr(web_app, "_cached_build_middleware", None)
    if cache is not None:
        cache.cache_clear()


def _quiet_progress(label: str, total: int) -> ProgressBar:
    return ProgressBar(label, total, stream=io.StringIO())


# The scripted model (appliance/serving/scripted.py) that the `settings` and `client` fixtures
# serve: the whole appliance (gateway, scheduler, a worker process) with no weights, for
# every test whose subject is not the model.
SCRIPTED = "scripted"
SCRIPT = {
    "kvl_script": 1,
    "reply": "Hello from the scripted model.",
    "rules": [
        {"contains": "ping", "reply": "pong"},
        {"contains": "JSON", "reply": '{"ok": true}'},
        {"contains": "1, 2, 3, 4,", "reply": " 5, 6, 7, 8,"},
    ],
    # Gemma's: it refuses a conversation whose roles do not alternate, as the real one does.
    "chat_template": GEMMA_TEMPLATE,
}
# The appliance's own defaults: Gemma 3 270M, and SmolLM2 135M Instruct for chat.
REAL_MODELS: dict[str, object] = {"default": DEFAULT_MODEL_NAME, "chat_default": CHAT_MODEL_NAME}
# A scripted model that takes its time: a step every 20 ms, as a real model on a small
# machine might (for tests of what happens while a generation runs).
SLOW = "scripted-slow"
# S1 (an API key's default class) for tests where the real model serves and admission is not
# the subject: a first token past 10 s on two cores busy with three other test workers is
# the host, not the code, and the 429 that sheds it would fail a test of something else.
PATIENT_S1: dict[str, object] = {"admit_s": 300, "first_token_s": 600, "complete_s": 3600}
# The environment of an appliance process that serves the real model in a test: the patient
# S1, and one llama.cpp thread (as make_settings gives).
REAL_MODEL_ENV = {
    "KVL_MODEL__N_THREADS": "1",
    **{f"KVL_CLASSES__S1__{name.upper()}": str(v) for name, v in PATIENT_S1.items()},
}
SLOW_SCRIPT = {"step_s": 0.02, "reply": "tick " * 400, "rules": []}


def write_script(path: Path, **changes: object) -> Path:
    path.write_text(json.dumps({**SCRIPT, **changes}))
    return path


@pytest.fixture(scope="session")
def scripted_models(tmp_path_factory: pytest.TempPathFactory) -> list[ModelRecord]:
    """The scripted models' records, SCRIPTED then SLOW (their files in a session folder)."""
    base = tmp_path_factory.mktemp("scripted-model")
    store = Store(base / "catalog.db")
    try:
        return [
            register_file(store, write_script(base / "scripted.json"), SCRIPTED, "1"),
            register_file(store, write_script(base / "slow.json", **SLOW_SCRIPT), SLOW, "1"),
        ]
    finally:
        store.close()


@pytest.fixture(scope="session")
def scripted_model(scripted_models: list[ModelRecord]) -> ModelRecord:
    return scripted_models[0]


@pytest.fixture(scope="session")
def slow_model(scripted_models: list[ModelRecord]) -> ModelRecord:
    return scripted_models[1]


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> ModelRecord:
    """The embedded default model, assembled once per test session."""
    base = tmp_path_factory.mktemp("default-model")
    store = Store(base / "catalog.db")
    try:
        return ensure_default_model(store, base / "models", progress=_quiet_progress)
    finally:
        store.close()


def make_settings(data_dir: Path, **sections: dict[str, object]) -> ApplianceSettings:
    # The scripted model unless a test names the real ones (REAL_MODELS); one llama.cpp
    # thread: two spin on each other on two cores busy with anything else.
    model: dict[str, object] = {
        "default": SCRIPTED,
        "chat_default": SCRIPTED,
        "n_ctx": 2048,
        "max_queue": 4,
        "n_threads": 1,
    }
    model.update(sections.pop("model", {}))
    discovery: dict[str, object] = {"enabled": False}
    discovery.update(sections.pop("discovery", {}))
    # Tests send many unauthenticated requests from one address; the throttle has its own.
    classes: dict[str, object] = {"auth_failures_per_minute": 1_000_000}
    if model["default"] != SCRIPTED:
        classes["s1"] = PATIENT_S1
    classes.update(sections.pop("classes", {}))
    return ApplianceSettings.model_validate(
        {
            "data_dir": data_dir,
            "model": model,
            "discovery": discovery,
            "classes": classes,
            **sections,
        }
    )


@pytest.fixture
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> ApplianceSettings:
    """Settings for an in-process appliance whose store already knows its model: the
    scripted ones (SCRIPTED by default and for chat, SLOW when named), or, for a test marked
    `model`, the real default model."""
    if request.node.get_closest_marker("model") is not None:
        records: list[ModelRecord] = [request.getfixturevalue("default_model")]
        s = make_settings(tmp_path / "data", model=REAL_MODELS)
    else:
        records = request.getfixturevalue("scripted_models")
        s = make_settings(tmp_path / "data")
    store = Store(s.db_path)
    for record in records:
        store.add_model(record)
    store.close()
    return s


@pytest.fixture
def api_key(settings: ApplianceSettings) -> str:
    store = Store(settings.db_path)
    try:
        return store.create_key("tester").plaintext
    finally:
        store.close()


@pytest.fixture
async def client(aiohttp_client: AiohttpClient, settings: ApplianceSettings) -> Client:
    """An in-process appliance (real aiohttp server on loopback) with its model (`settings`)
    and the embedding model loaded."""
    app = create_app(settings)
    test_client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    assert app[REGISTRY].ready, app[REGISTRY].load_error
    await app[EMBEDDINGS].wait_loaded()
    assert app[EMBEDDINGS].ready, app[EMBEDDINGS].load_error
    return test_client


def free_port() -> int:
    """A port on 127.0.0.1 free now, for a process that binds it a moment later: drawn below
    the kernel's ephemeral range, from which bind(0) and every outgoing connection take
    theirs. One from that range, released and bound again by a starting appliance, was taken
    in between by another test's server (EADDRINUSE, once in a clean-clone run with the
    image's QEMU beside the suite); below it only another free_port draw can collide."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORTS.randrange(FREE_PORTS_FROM, low) if low > FREE_PORTS_FROM + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise AssertionError(f"no free port in {FREE_PORTS_FROM}-{low} on 127.0.0.1")


FREE_PORTS_FROM = 10000
_PORTS = random.Random()  # its own: a test that seeds the module's random must not pin ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


@dataclass
class ApplianceProcess:
    base_url: str
    key: str
    data_dir: Path
    process: subprocess.Popen[bytes]


def kvl(
    *args: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run the real `kvl` command."""
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args],
        capture_output=True,
        text=True,
        check=check,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        timeout=300,
    )


def spawn_appliance(
    data_dir: Path, port: int, env: dict[str, str], log: IO[bytes] | int = subprocess.DEVNULL
) -> subprocess.Popen[bytes]:
    """`kvl appliance serve` on loopback as a real process, with extra environment."""
    return subprocess.Popen(
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
        env={**os.environ, **env},
    )


@contextlib.contextmanager
def running_appliance(data_dir: Path, key: str, env: dict[str, str]) -> Iterator[ApplianceProcess]:
    """A real appliance on a free loopback port, ready; stopped (and its log closed) after."""
    port = free_port()
    with (data_dir / "serve.log").open("wb") as log:
        process = spawn_appliance(data_dir, port, env, log)
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


def wait_ready(base_url: str, process: subprocess.Popen[bytes], timeout_s: float = 180.0) -> None:
    """Wait on the condition (readiness), polling; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"appliance exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    raise AssertionError("appliance did not become ready")


@pytest.fixture(scope="module")
def appliance_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApplianceProcess]:
    """`kvl appliance serve` as a real process on loopback, assembling the model itself."""
    data_dir = tmp_path_factory.mktemp("appliance")
    key = kvl(
        "appliance", "keys", "create", "--account", "sdk", "--data-dir", str(data_dir)
    ).stdout.strip()
    env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_MODEL__N_CTX": "2048",
        **REAL_MODEL_ENV,
    }
    with running_appliance(data_dir, key, env) as appliance:
        yield appliance


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    """A throwaway PostgreSQL cluster for the whole session (tests/postgres.py); each test
    makes its own database in it. Skipped only where Debian's server is not installed."""
    if server_bin() is None:
        pytest.skip(MISSING)
    with cluster() as running:
        yield running


# The fixtures that start the real default model (or assemble it for a process that will):
# a test that takes one, however indirectly, is a `model` test whether its module says so or
# not, so the tiers that leave the model out (`just test-fast`) leave it out too.
MODEL_FIXTURES = frozenset({"default_model", "appliance_process"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & MODEL_FIXTURES and item.get_closest_marker("model") is None:
            item.add_marker(pytest.mark.model)
    heaviest_first(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> HeaviestFirst | None:
    """`--dist loadfile` as tests/scheduling.py orders it; other modes as xdist's own."""
    return HeaviestFirst(config, log) if config.getoption("dist") == "loadfile" else None


def pytest_sessionfinish() -> None:
    # llama-cpp-python opens /dev/null twice at import and never closes it; close it here so
    # the interpreter's exit does not print two ResourceWarnings after every run.
    import llama_cpp._utils as llama_utils  # noqa: PLC0415

    llama_utils.outnull_file.close()
    llama_utils.errnull_file.close()


class NoModels:
    """What a fleet link reports of the models when none are served (links tested alone)."""

    def served(self) -> list[Any]:
        return []

    def loaded_models(self) -> list[Any]:
        return []

    def replicas(self) -> list[Any]:
        return []

    @property
    def isolation_max(self) -> IsolationLevel:
        return IsolationLevel.I1

    def isolation_levels(self) -> dict[str, IsolationLevel]:
        return {}
