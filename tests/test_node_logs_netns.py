"""A node's logs read through a real WireGuard tunnel: a hub and an appliance, each in its
own network namespace (tests/netns.py, as tests/test_fleet_netns.py has them), the
operator reading the appliance's log records through the hub's operator API and the CLI
on the hub's machine, the hub asking the node's fleet listener on its overlay address
with the hub's certificate. The lines looked for are ones this test causes: the node's
enrollment, and the desired state it applies after a key is made on the hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from appliance.state.records import ModelRecord
from appliance.state.store import Store
from hub.identity import certificates
from hub.settings import HubSettings
from hub.state.store import open_store
from tests.conftest import SCRIPTED
from tests.netns import A_ADDR, REPO, Link, linked_namespaces, spawn, stop
from tests.waiting import until_sync

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.netns

# An operator's call of the hub's API from the hub's namespace: the status, then the
# body, each line as it comes (a follow is read until the process is stopped).
OPERATOR_GET = """
import ssl, sys, urllib.error, urllib.request
context = ssl.create_default_context(cafile=sys.argv[1])
request = urllib.request.Request(sys.argv[2], headers={"Authorization": "Bearer " + sys.argv[3]})
try:
    answer = urllib.request.urlopen(request, timeout=60, context=context)
except urllib.error.HTTPError as err:
    answer = err
print(answer.status, flush=True)
for line in answer:
    sys.stdout.write(line.decode())
    sys.stdout.flush()
"""


@pytest.fixture
def link() -> Iterator[Link]:
    with linked_namespaces() as made:
        yield made


def test_an_operator_reads_and_follows_a_nodes_logs_through_the_tunnel(
    link: Link, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node"
    hub_env = {
        "KVL_HUB_SERVER__NAMES": json.dumps([A_ADDR]),
        "KVL_HUB_OVERLAY__ENDPOINT": f"{A_ADDR}:51820",
        "KVL_HUB_OVERLAY__INTERFACE": f"kvh{link.suffix}",
    }
    hub = HubSettings.model_validate(
        {
            "data_dir": hub_dir,
            "server": {"names": [A_ADDR]},
            "overlay": {"endpoint": f"{A_ADDR}:51820", "interface": f"kvh{link.suffix}"},
        }
    )
    fingerprint = certificates(hub)[0].fingerprint
    hub_store = open_store(hub)
    token = hub_store.tokens.create("school", uses=1, expires_in_s=600).plaintext
    operator = hub_store.operators.create("ops").plaintext
    hub_store.accounts.put("school", "S1")
    hub_store.close()
    provisioning = tmp_path / "kovenlab.json"
    provisioning.write_text(
        json.dumps(
            {
                "hub_url": f"https://{A_ADDR}:8443",
                "token": token,
                "hub_fingerprint": fingerprint,
                "name": "lab-server",
            }
        )
    )
    store = Store(node_dir / "appliance.db")
    store.add_model(scripted_model)
    store.close()
    node_env = {
        "KVL_DISCOVERY__ENABLED": "false",
        "KVL_EMBEDDINGS__ENABLED": "false",
        "KVL_MODEL__DEFAULT": SCRIPTED,
        "KVL_MODEL__CHAT_DEFAULT": SCRIPTED,
        "KVL_MODEL__N_CTX": "512",
        "KVL_FLEET__PROVISIONING_FILE": str(provisioning),
        "KVL_FLEET__INTERFACE": f"kvn{link.suffix}",
        "KVL_FLEET__HEARTBEAT_S": "1",
        "KVL_FLEET__SYNC_INTERVAL_S": "0.5",
    }
    hub_args = ["hub", "serve", "--data-dir", str(hub_dir), "--host", A_ADDR]
    hub_process = spawn(link, link.a, hub_args, hub_env, tmp_path / "hub.log")
    node_args = ["appliance", "serve", "--data-dir", str(node_dir), "--host", "127.0.0.1",
                 "--port", "8080"]  # fmt: skip
    node_process = spawn(link, link.b, node_args, node_env, tmp_path / "node.log")
    ca = str(hub.pki_dir / "ca.crt")
    logs_url = f"https://{A_ADDR}:8443/v1/admin/nodes/lab-server/logs"
    followers: list[subprocess.Popen[bytes]] = []

    def operator_get(query: str) -> tuple[int, str]:
        """(0, what it said) while the hub does not answer yet."""
        out = subprocess.run(
            link.argv(link.a, sys.executable, "-c", OPERATOR_GET, ca, f"{logs_url}?{query}",
                      operator),
            capture_output=True, text=True, timeout=90, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            return 0, out.stderr
        status, _, body = out.stdout.partition("\n")
        return int(status), body

    def follow(argv: list[str], out: Path) -> None:
        """A reader that goes on (a follow), its output into ``out``."""
        with out.open("wb") as sink:
            followers.append(
                subprocess.Popen(
                    link.argv(link.a, sys.executable, *argv),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env={**os.environ, **hub_env},
                )
            )

    def key_applied() -> str:
        """A key made on the hub: the node applies the desired state, and says so."""
        s = open_store(hub)
        try:
            s.accounts.create_key("school")
            serial = s.serials.desired()
        finally:
            s.close()
        return f"applied the hub's desired state {serial}"

    def read(query: str) -> list[dict[str, object]]:
        status, body = operator_get(query)
        assert status == 200, body
        return list(json.loads(body)["records"])

    try:
        # Through the tunnel only: the node's fleet listener is on its overlay address.
        until_sync(
            lambda: operator_get("limit=1")[0] == 200,
            "the node's logs through the hub, once the node has its fleet listener",
            timeout_s=120,
        )
        records = read("limit=1000&level=info")
        enrolled = "enrolled with the hub as lab-server (100.64.0.2)"
        assert any(r["message"] == enrolled for r in records), records[-20:]
        assert all(r["level"] != "DEBUG" for r in records)
        seqs = [int(str(r["seq"])) for r in records]
        assert seqs == sorted(seqs)

        # Follow: the stream shows a line that comes after it began.
        last = seqs[-1]
        streamed = tmp_path / "follow.out"
        follow(["-c", OPERATOR_GET, ca, f"{logs_url}?follow=1&after={last}", operator], streamed)
        until_sync(lambda: streamed.read_text().startswith("200\n"), "the follow to begin")
        line = key_applied()
        until_sync(lambda: line in streamed.read_text(), f"{line!r} in the followed stream")
        for raw in streamed.read_text().splitlines()[1:]:
            assert int(json.loads(raw)["seq"]) > last

        # The CLI on the hub's machine: the last lines, then a follow.
        cli = [sys.executable, "-m", "shared.cli", "hub", "nodes", "logs", "lab-server",
               "--data-dir", str(hub_dir)]  # fmt: skip
        printed = subprocess.run(
            link.argv(link.a, *cli, "--lines", "1000", "--level", "info"),
            capture_output=True, text=True, timeout=90, check=False, cwd=REPO,
            env={**os.environ, **hub_env},
        )  # fmt: skip
        assert printed.returncode == 0, printed.stderr
        assert enrolled in printed.stdout
        assert line in printed.stdout
        cli_out = tmp_path / "cli.out"
        follow([*cli[1:], "--follow", "--lines", "1"], cli_out)
        until_sync(lambda: cli_out.read_text().strip() != "", "the CLI's first line")
        second = key_applied()
        until_sync(lambda: second in cli_out.read_text(), f"{second!r} from kvl hub nodes logs -f")
        # A node unknown to the hub, through the CLI: said, exit status 1.
        unknown = subprocess.run(
            link.argv(link.a, *cli[:6], "nobody", *cli[7:]),
            capture_output=True, text=True, timeout=90, check=False, cwd=REPO,
            env={**os.environ, **hub_env},
        )  # fmt: skip
        assert unknown.returncode == 1
        assert "nobody" in unknown.stderr
    finally:
        for process in followers:
            stop(process)
        stop(node_process)
        stop(hub_process)
