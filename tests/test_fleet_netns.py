"""The fleet end to end: a hub and an appliance, each in its own network namespace joined
by a veth pair, the appliance enrolled over HTTPS and then talking to the hub only through
a real wireguard-go tunnel: heartbeats seen, desired state applied, a cut link that loses
nothing once it is back, and the trust chain changed under it (the CA rotated, the hub's
certificate issued again for new names) with no call lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from appliance.state.records import ModelRecord
from appliance.state.store import Store
from hub.certificates import Authority
from hub.identity import certificates
from hub.settings import HubSettings
from hub.state.nodes import Node
from hub.state.store import open_store
from shared import pki
from tests.conftest import SCRIPTED
from tests.netns import A_ADDR, REPO, Link, ip, linked_namespaces, spawn, stop
from tests.waiting import until_sync

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.netns


@pytest.fixture
def link() -> Iterator[Link]:
    with linked_namespaces() as made:
        yield made


def complete_in(link: Link, port: int, key: str) -> int:
    """One completion from inside the appliance's namespace (a LAN client there)."""
    code = (
        "import json, urllib.request, sys\n"
        f"r = urllib.request.Request('http://127.0.0.1:{port}/v1/completions', "
        "data=json.dumps({'model': 'scripted', 'prompt': 'Hi', 'max_tokens': 2}).encode(), "
        f"headers={{'Authorization': 'Bearer {key}', 'Content-Type': 'application/json'}})\n"
        "print(urllib.request.urlopen(r, timeout=60).status)\n"
    )
    out = subprocess.run(
        link.argv(link.b, sys.executable, "-c", code),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    return int(out.stdout.strip() or 0)


def test_enroll_over_a_wireguard_tunnel_heartbeat_apply_state_and_sync_after_a_cut(
    link: Link, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node"
    hub_env = {
        "KVL_HUB_SERVER__NAMES": json.dumps([A_ADDR]),
        "KVL_HUB_OVERLAY__ENDPOINT": f"{A_ADDR}:51820",
        "KVL_HUB_OVERLAY__INTERFACE": f"kvh{link.suffix}",
        "KVL_HUB_PKI__RELOAD_S": "0.5",
    }
    hub = HubSettings.model_validate(
        {
            "data_dir": hub_dir,
            "server": {"names": [A_ADDR]},
            "overlay": {"endpoint": f"{A_ADDR}:51820", "interface": f"kvh{link.suffix}"},
        }
    )
    fingerprint = certificates(hub)[0].fingerprint  # the CA: the hub process loads its files
    hub_store = open_store(hub)
    token = hub_store.tokens.create("school", uses=1, expires_in_s=600).plaintext
    hub_store.accounts.put("lan", "S1")  # the LAN key's account is the fleet's: usage syncs
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
    lan_key = store.create_key("lan").plaintext
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
    hub_process = spawn(
        link,
        link.a,
        ["hub", "serve", "--data-dir", str(hub_dir), "--host", A_ADDR],
        hub_env,
        tmp_path / "hub.log",
    )
    node_process = spawn(
        link,
        link.b,
        [
            "appliance",
            "serve",
            "--data-dir",
            str(node_dir),
            "--host",
            "127.0.0.1",
            "--port",
            "8080",
        ],
        node_env,
        tmp_path / "node.log",
    )

    def hub_nodes() -> list[Node]:
        s = open_store(hub)
        try:
            return s.nodes.all()
        finally:
            s.close()

    def ledger() -> int:
        s = open_store(hub)
        try:
            return s.ledger.count()
        finally:
            s.close()

    def local(query: str) -> int:
        s = Store(node_dir / "appliance.db")
        try:
            return int(s.db.execute(query).fetchone()[0])
        finally:
            s.close()

    try:
        # Heartbeats reach the hub only from the node's overlay address (the hub refuses
        # node calls from anywhere else): seen means through the tunnel.
        until_sync(
            lambda: any(n.capacity.models for n in hub_nodes()),
            "a heartbeat through the tunnel, once the model is loaded",
        )
        nodes = hub_nodes()
        assert len(nodes) == 1
        assert nodes[0].capacity.models == [scripted_model.ref]

        status = subprocess.run(
            link.argv(
                link.b,
                sys.executable,
                "-m",
                "shared.cli",
                "appliance",
                "status",
                "--json",
                "--data-dir",
                str(node_dir),
            ),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            cwd=REPO,
            env={**os.environ, **node_env},
        )
        report = json.loads(status.stdout)
        assert report["enrolled"] is True
        assert report["overlay_address"] == "100.64.0.2"
        assert report["tunnel"] == f"up (kvn{link.suffix})"
        assert report["last_heartbeat"] is not None

        # Desired state: a key made on the hub is applied on the node.
        s = open_store(hub)
        s.accounts.put("school", "S1")
        fleet_key = s.accounts.create_key("school").plaintext
        s.close()
        prefix = fleet_key.split("_")[1]
        assert prefix.isalnum()
        until_sync(
            lambda: local(f"SELECT COUNT(*) FROM api_keys WHERE prefix = '{prefix}'") == 1,  # noqa: S608 - alphanumeric
            "the desired state on the node",
        )

        assert complete_in(link, 8080, lan_key) == 200
        until_sync(lambda: ledger() == 1, "the first event at the hub")

        # The link is cut: LAN clients are still served, events wait in the outbox.
        ip("-n", link.b, "link", "set", link.veth_b, "down")
        for _ in range(3):
            assert complete_in(link, 8080, lan_key) == 200
        assert local("SELECT COUNT(*) FROM usage_events") == 4
        time.sleep(2)
        assert ledger() == 1
        # Back: every event arrives, once.
        ip("-n", link.b, "link", "set", link.veth_b, "up")
        until_sync(lambda: ledger() == 4, "the outbox to drain after the cut")
        time.sleep(1.5)
        assert ledger() == 4

        # The CA rotated under a running fleet: staged, switched (the hub's certificate
        # issued again under the new CA, the node's renewed), retired. Not one call of
        # the node fails meanwhile.
        mark = (tmp_path / "node.log").stat().st_size
        hub_args = ["--data-dir", str(hub_dir)]
        env = {**os.environ, **hub_env}

        def rotate() -> None:
            subprocess.run(
                [sys.executable, "-m", "shared.cli", "hub", "ca", "rotate", *hub_args],
                check=True, cwd=REPO, env=env, capture_output=True, timeout=60,
            )  # fmt: skip

        def trust_reported() -> str | None:
            return hub_nodes()[0].capacity.trust_digest

        rotate()  # staged
        staged = Authority(hub).phase().digest
        until_sync(lambda: trust_reported() == staged, "the node to hold the staged CA")
        rotate()  # switched: the node renews under the new CA
        new_ca = Authority(hub).phase().signing
        node_cert = node_dir / "fleet" / "node.crt"
        until_sync(
            lambda: (
                pki.load_certificate(node_cert.read_bytes()).issuer == new_ca.certificate.subject
            ),
            "the node's certificate renewed under the new CA",
        )
        subprocess.run(
            [sys.executable, "-m", "shared.cli", "hub", "ca", "rotate", "--force", *hub_args],
            check=True, cwd=REPO, env=env, capture_output=True, timeout=60,
        )  # fmt: skip
        retired = Authority(hub).phase().digest
        until_sync(lambda: trust_reported() == retired, "the node to drop the old CA")
        assert complete_in(link, 8080, lan_key) == 200
        until_sync(lambda: ledger() == 5, "an event after the rotation")
        log = (tmp_path / "node.log").read_bytes()[mark:].decode(errors="replace")
        assert "heartbeat failed" not in log, log
        assert "sync stopped" not in log, log

        # New names for the hub (a restart with new settings): its certificate is issued
        # again, with a new key; the node trusts the CA, so it keeps its hub.
        def served() -> bytes:  # read, never issued again by this process's settings
            issued = pki.read_issued(hub.pki_dir, "server")
            assert issued is not None
            return issued.cert_pem

        before = served()
        stop(hub_process)
        renamed = {**hub_env, "KVL_HUB_SERVER__NAMES": json.dumps([A_ADDR, "hub.example"])}
        hub_process = spawn(
            link, link.a, ["hub", "serve", "--data-dir", str(hub_dir), "--host", A_ADDR],
            renamed, tmp_path / "hub.log",
        )  # fmt: skip
        assert complete_in(link, 8080, lan_key) == 200
        until_sync(lambda: ledger() == 6, "an event after the hub's new certificate")
        assert served() != before
        assert "hub.example" in pki.names_of(served())
        log = (tmp_path / "node.log").read_bytes()[mark:].decode(errors="replace")
        assert "certificate_untrusted" not in log, log
        assert "fingerprint_mismatch" not in log, log
    finally:
        stop(node_process)
        stop(hub_process)
