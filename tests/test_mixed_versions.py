"""A fleet mid-rollout (upgraded hub first, then node by node): today's hub with two real
appliance processes enrolled side by side on loopback, one running today's code and one
the code of the previous protocol version (that commit's files from `git archive`, run
by this interpreter with the folder first on PYTHONPATH, as the benchmarks run a
baseline). Both enroll and heartbeat (the hub lists each with the protocol it speaks; the
old one's capacity, without the fields today's version added, reads as their defaults),
take the desired state (an account with a fleet budget and its key, made on the hub),
hold quota leases, serve a LAN request with that key whose usage reaches the hub's ledger
once, and renew their certificates through a CA rotation. And the wrong order, a node
upgraded before its hub: today's node is refused by a hub of the previous version, which
says to upgrade the hub.

The previous version's commit comes from git history: the newest commit on HEAD's
first-parent line whose protocol is the version before today's. A shallow clone fetches
its history first; one that cannot fails here, saying so, rather than skipping: the test
would otherwise prove nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, TypeVar

import aiohttp
import pytest

from appliance.fleet.client import HubRefusedError
from appliance.fleet.identity import FleetFiles
from appliance.fleet.link import enroll
from hub.app import create_app as create_hub
from hub.appkeys import TLS
from hub.certificates import Authority
from hub.identity import certificates
from hub.planning.quota import Budget
from hub.settings import HubSettings
from hub.state.store import HubStore, open_store
from shared import protocol
from shared.provisioning import Provisioning
from tests.conftest import REPO, free_port
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from appliance.state.records import ModelRecord
    from hub.state.nodes import Node

T = TypeVar("T")
PROTOCOL_FILE = "shared/protocol.py"
PREVIOUS = protocol.PROTOCOL_VERSION - 1
HOST = "127.0.0.1"
# What an appliance logs when a call to the hub fails (appliance/fleet/link.py), or a
# background round raises.
FAILED_CALLS = (
    "enrollment refused", "heartbeat failed", "sync stopped", "quota leases (", "Traceback",
)  # fmt: skip
ACCOUNT = "rollout"


# -- the previous version's code, from git ---------------------------------------------------


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def version_at(commit: str) -> int | None:
    """PROTOCOL_VERSION in the commit's shared/protocol.py (None: no such file or line)."""
    try:
        text = git("show", f"{commit}:{PROTOCOL_FILE}")
    except subprocess.CalledProcessError:
        return None
    found = re.search(r"^PROTOCOL_VERSION = (\d+)$", text, re.MULTILINE)
    return int(found[1]) if found else None


def previous_protocol_commit() -> str:
    """The newest commit on HEAD's first-parent line (the main line: a merged branch's own
    commits are not releases) whose protocol is PROTOCOL_VERSION - 1: HEAD itself while
    the working tree moves the version on, else the parent of the newest commit that
    moved it to today's."""
    try:
        shallow = git("rev-parse", "--is-shallow-repository")
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.fail(
            "the previous protocol version's code comes from git history, and the tests do "
            f"not run from a git clone with git on PATH ({err}): run them from a clone"
        )
    if shallow == "true":
        # A shallow clone has its origin still: the history is fetched once, here.
        try:
            git("fetch", "--quiet", "--unshallow")
        except (OSError, subprocess.CalledProcessError) as err:
            pytest.fail(
                "the previous protocol version's code comes from git history, and this clone "
                f"is shallow and could not fetch it ({err}): clone without --depth"
            )
    if version_at("HEAD") == PREVIOUS:
        return git("rev-parse", "HEAD")
    # First-parent commits whose change (against their first parent) touches the line.
    moves = git(
        "log", "--first-parent", "--format=%H", "-G", "^PROTOCOL_VERSION = ", "--", PROTOCOL_FILE
    ).split()
    for move in moves:
        if version_at(f"{move}^1") == PREVIOUS:
            return git("rev-parse", f"{move}^1")
    pytest.fail(
        f"no commit on HEAD's first-parent line has PROTOCOL_VERSION = {PREVIOUS} in "
        f"{PROTOCOL_FILE} (commits that moved it: {moves}): is the clone's history complete?"
    )


@dataclass(frozen=True)
class Code:
    """A tree of the project's code that processes run: this checkout, or a commit's."""

    label: str
    root: Path

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        # The tree first on the path, for the process and the model workers it starts
        # alike (an editable install's finder comes after the path, so the installed
        # project provides only its metadata and dependencies).
        return {**os.environ, "PYTHONPATH": str(self.root), **extra}

    def kvl(self, *args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "shared.cli", *args],
            cwd=self.root,
            env=self.env({}),
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        assert done.returncode == 0, f"kvl {' '.join(args)} ({self.label}):\n{done.stderr}"


TODAY = Code(f"protocol {protocol.PROTOCOL_VERSION}, this tree", REPO)


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Code:
    """The files of the previous protocol version's commit."""
    sha = previous_protocol_commit()
    root = tmp_path_factory.mktemp("previous-protocol")
    archive = subprocess.run(["git", "archive", sha], cwd=REPO, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    assert version_at(sha) == PREVIOUS
    return Code(f"protocol {PREVIOUS}, {sha[:12]}", root)


# -- processes -------------------------------------------------------------------------------


@dataclass
class Process:
    """`kvl … serve` of some code on a loopback port, its output in a log file."""

    name: str
    code: Code
    url: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path

    def check(self) -> None:
        """Alive, and none of its calls to the hub failed: a node that cannot read an
        answer, or is refused, fails the test at once, with the reason from its log."""
        exited = self.popen.poll()
        log = self.log_path.read_text(errors="replace")
        assert exited is None, f"{self.name} ({self.code.label}) exited ({exited}):\n{log[-4000:]}"
        failed = [line for line in log.splitlines() if any(f in line for f in FAILED_CALLS)]
        assert not failed, (
            f"{self.name} ({self.code.label}): {failed}; its log ends:\n{log[-4000:]}"
        )

    async def answers(self, path: str) -> bool:
        """`check`ed, and 200 at `path`."""
        self.check()
        try:
            status, _ = await call("GET", self.url + path)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        return status == 200

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.log.close()


def spawn(
    name: str, code: Code, args: list[str], *, env: dict[str, str], log_path: Path, scheme: str
) -> Process:
    port = int(args[-1])
    log = log_path.open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", *args],
        cwd=code.root,
        env=code.env(env),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return Process(name, code, f"{scheme}://{HOST}:{port}", popen, log, log_path)


async def start(
    stack: contextlib.ExitStack,
    name: str,
    code: Code,
    args: Callable[[int], list[str]],
    *,
    env: dict[str, str],
    log_path: Path,
    scheme: str = "http",
) -> Process:
    """`kvl ARGS(port)` on a free port (the last argument), once it answers `/healthz`;
    stopped with `stack`. A port free when chosen can be taken before the process binds
    it, seconds later (as the local end of any connection on the host): then it starts
    again on another."""
    for attempt in range(3):
        process = spawn(name, code, args(free_port()), env=env, log_path=log_path, scheme=scheme)
        stack.callback(process.stop)
        try:
            up = functools.partial(process.answers, "/healthz")
            await until(up, f"{name} up", timeout_s=120)
        except AssertionError as failed:
            if attempt == 2 or "address already in use" not in str(failed):
                raise
            continue
        return process
    raise AssertionError("unreachable")  # pragma: no cover


def serve_args(side: str, data_dir: Path, *more: str) -> Callable[[int], list[str]]:
    """`kvl SIDE serve`'s arguments on loopback, for a port."""
    serve = [side, "serve", "--data-dir", str(data_dir), *more, "--host", HOST]
    return lambda port: [*serve, "--port", str(port)]


async def call(
    method: str, url: str, *, headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
        session.request(method, url, headers=headers, json=body, ssl=False) as response,
    ):
        return response.status, await response.json(content_type=None)


# -- the hub's side --------------------------------------------------------------------------


def hub_settings(tmp_path: Path) -> HubSettings:
    return settings_for(tmp_path, pki={"reload_s": 0.5})  # it follows a CA rotation at once


def read(hub: HubSettings, what: Callable[[HubStore], T]) -> T:
    store = open_store(hub)
    try:
        return what(store)
    finally:
        store.close()


def nodes_of(hub: HubSettings) -> dict[str, Node]:
    return read(hub, lambda s: {n.name: n for n in s.nodes.all()})


def added_now(message: type[protocol.Message]) -> list[str]:
    """The fields of `message` that today's protocol version added."""
    added = protocol.ADDED_IN.get(message, {})
    return [f for f, v in added.items() if v == protocol.PROTOCOL_VERSION]


# -- the tests -------------------------------------------------------------------------------


@dataclass
class Appliance:
    code: Code
    protocol: int
    process: Process | None = None

    @property
    def lan(self) -> Process:
        assert self.process is not None
        return self.process


def prepare(code: Code, data_dir: Path, model: ModelRecord) -> None:
    """The appliance's store, made by its own code, with the default model registered by
    path (the session's copy: no assembly of its own)."""
    code.kvl(
        "appliance", "models", "add", model.path, "--name", model.name,
        "--version", model.version, "--data-dir", str(data_dir),
    )  # fmt: skip


@pytest.mark.model
async def test_a_hub_serves_nodes_of_its_protocol_and_the_previous_one_side_by_side(
    aiohttp_server: AiohttpServer, tmp_path: Path, default_model: ModelRecord, previous: Code
) -> None:
    hub = hub_settings(tmp_path)
    hub_port = free_port()
    app = create_hub(hub)
    await aiohttp_server(app, host=HOST, port=hub_port, ssl=app[TLS].server.outer)
    token = read(hub, lambda s: s.tokens.create("school", uses=2, expires_in_s=600).plaintext)
    fingerprint = certificates(hub)[0].fingerprint
    appliances = {
        "new-node": Appliance(TODAY, protocol.PROTOCOL_VERSION),
        "old-node": Appliance(previous, PREVIOUS),
    }
    await asyncio.gather(
        *(
            asyncio.to_thread(prepare, a.code, tmp_path / name, default_model)
            for name, a in appliances.items()
        )
    )

    with contextlib.ExitStack() as stack:
        for name, a in appliances.items():
            provisioning = tmp_path / f"{name}.json"
            provisioning.write_text(json.dumps({
                "hub_url": f"https://{HOST}:{hub_port}", "token": token,
                "hub_fingerprint": fingerprint, "name": name,
            }))  # fmt: skip
            env = {
                "KVL_DISCOVERY__ENABLED": "false",
                "KVL_EMBEDDINGS__ENABLED": "false",
                # The key is tried until the node has it: unknown until then, and not a
                # client to throttle.
                "KVL_CLASSES__AUTH_FAILURES_PER_MINUTE": "1000000",
                "KVL_MODEL__N_CTX": "512",
                "KVL_MODEL__N_THREADS": "1",
                "KVL_FLEET__PROVISIONING_FILE": str(provisioning),
                "KVL_FLEET__TUNNEL": "false",
                "KVL_FLEET__LAN_TLS": "false",  # plain HTTP on loopback: TLS has its tests
                "KVL_FLEET__HEARTBEAT_S": "1",
                "KVL_FLEET__SYNC_INTERVAL_S": "0.5",
            }
            a.process = await start(
                stack, name, a.code, serve_args("appliance", tmp_path / name),
                env=env, log_path=tmp_path / f"{name}.log",
            )  # fmt: skip
        for name, a in appliances.items():
            ready = functools.partial(a.lan.answers, "/readyz")
            await until(ready, f"{name} ready", timeout_s=180)

        # Both enrolled and heartbeat, each listed with the protocol version it speaks and
        # its model; the old node never sends the fields today's version added to its
        # capacity, and the hub reads their defaults.
        def heard() -> dict[str, Node] | None:
            for a in appliances.values():
                a.lan.check()
            found = nodes_of(hub)
            done = set(found) == set(appliances) and all(n.capacity.models for n in found.values())
            return found if done else None

        nodes = await until(heard, "both nodes heard with their models")
        for name, a in appliances.items():
            assert nodes[name].versions["protocol"] == str(a.protocol), nodes[name].versions
            assert nodes[name].capacity.models == [default_model.ref]
        old = nodes["old-node"].capacity
        defaults = {
            f: protocol.Capacity.model_fields[f].get_default(call_default_factory=True)
            for f in added_now(protocol.Capacity)
        }
        assert {f: getattr(old, f) for f in defaults} == defaults

        # The desired state: an account with a budget across the fleet (spent through
        # quota leases) and its key, made on the hub, reach both nodes.
        read(hub, lambda s: s.accounts.put(ACCOUNT, "S1", budget=Budget(1_000_000, 86_400)))
        key = read(hub, lambda s: s.accounts.create_key(ACCOUNT).plaintext)
        headers = {"Authorization": f"Bearer {key}"}

        async def serves(a: Appliance) -> str | None:
            """A completion with the hub's key: its id, or None while the node has no
            lease of the account yet (429: the first request asked the hub for one)."""
            a.lan.check()
            status, body = await call(
                "POST", f"{a.lan.url}/v1/completions", headers=headers,
                body={"model": default_model.name, "prompt": "Hi", "max_tokens": 2},
            )  # fmt: skip
            if status in (401, 429) and body["error"]["code"] in {
                "invalid_api_key",  # the key is not there yet
                "rate_limit_exceeded",  # waiting for a lease
            }:
                return None
            assert status == 200, body
            return str(body["id"]).removeprefix("cmpl-")

        served: dict[str, str] = {}
        for name, a in appliances.items():
            served[name] = await until(functools.partial(serves, a), f"{name} serves", every_s=0.5)

        # Its usage reaches the hub's ledger once, charged to the node's own lease.
        def ledger() -> list[dict[str, Any]]:
            return read(hub, lambda s: list(s.db.query("SELECT node_id, body FROM ledger")))

        await until(lambda: len(ledger()) >= len(served), "both nodes' usage in the ledger")
        rows = ledger()
        bodies = {r["node_id"]: json.loads(r["body"]) for r in rows}
        owners = read(hub, lambda s: s.leases.owners(b["lease_id"] for b in bodies.values()))
        assert len(rows) == len(bodies) == len(served), rows
        for name, node in nodes.items():
            body = bodies[node.id]
            assert (body["id"], body["account"]) == (served[name], ACCOUNT), body
            assert owners[body["lease_id"]] == (node.id, ACCOUNT)

        # A CA rotation (as `kvl hub ca rotate` steps it): both nodes fetch the staged
        # bundle, renew their certificates under the new CA when the hub says so, and go
        # on calling with them.
        async def rotate(expect: str) -> None:
            assert await asyncio.to_thread(Authority(hub).rotate) == expect
            await until(lambda: app[TLS].phase.name == expect, f"the hub's CA {expect}")

        await rotate("staged")
        staged = Authority(hub).phase().digest

        def hold_staged() -> bool:
            return all(n.capacity.trust_digest == staged for n in nodes_of(hub).values())

        await until(hold_staged, "both nodes hold the staged CA")
        await rotate("switched")
        signing = Authority(hub).phase().signing.fingerprint

        def renewed() -> bool:
            newest = read(hub, lambda s: s.certificates.newest())
            return all(newest[n.id].ca == signing for n in nodes.values())

        await until(renewed, "both nodes renewed under the new CA")
        since = time.time()

        def heard_since() -> bool:
            now = nodes_of(hub).values()
            return all(n.last_seen is not None and n.last_seen > since for n in now)

        await until(heard_since, "both nodes heard after renewing")
        for a in appliances.values():
            a.lan.check()
        assert all(n.capacity.outbox_lag == 0 for n in nodes_of(hub).values())
        assert len(ledger()) == len(served)  # nothing came twice


async def test_a_node_newer_than_its_hub_is_refused_saying_to_upgrade_the_hub(
    tmp_path: Path, previous: Code
) -> None:
    """The wrong order, a node upgraded before its hub: the node's first call (its
    enrollment) is refused whole, and the message names the fix."""
    config = tmp_path / "hub.yaml"
    config.write_text("overlay:\n  interface: null\nserver:\n  require_overlay_source: false\n")
    provisioning = tmp_path / "kovenlab.json"
    files = FleetFiles(tmp_path / "node")
    with contextlib.ExitStack() as stack:
        hub = await start(
            stack, "hub", previous, serve_args("hub", tmp_path / "hub", "--config", str(config)),
            env={}, log_path=tmp_path / "hub.log", scheme="https",
        )  # fmt: skip
        _, health = await call("GET", f"{hub.url}/healthz")
        assert health["protocol"] == PREVIOUS
        await asyncio.to_thread(
            previous.kvl, "hub", "provision", "--config", str(config),
            "--data-dir", str(tmp_path / "hub"), "--site", "school", "--name", "newer",
            "--url", hub.url, "--output", str(provisioning),
        )  # fmt: skip
        with pytest.raises(HubRefusedError) as refused:
            await enroll(files, Provisioning.load(provisioning))
    assert (refused.value.status, refused.value.code) == (400, "protocol_unsupported")
    assert "upgrade the hub" in str(refused.value), refused.value
    assert files.identity() is None
