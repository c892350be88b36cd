"""The fleet's objectives as operators read them: the operator API (the report and the
series, bad query values refused in the error shape), `kvl hub objectives`, the console's
objectives page and the node page, over a real hub (SQLite and PostgreSQL) whose store
holds two nodes' heartbeats, checked against hand-computed numbers."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from hub.identity import certificates
from hub.state.nodes import Heartbeat
from hub.state.store import open_store
from shared import pki, protocol
from tests.conftest import kvl
from tests.console import add_user, console_settings, open_console, start
from tests.hub.nodes import assert_refused, enroll_node
from tests.hub.objective_series import objectives, series

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings
    from tests.hub.conftest import HubDatabase


def _fleet(hub: HubSettings) -> tuple[str, dict[str, str]]:
    """Two nodes of two sites, S1 account acme: n1 missed 20 of 1000 first tokens, n2
    none of 1000. The target is 99 %: n1 burns its budget at twice the rate allowed and has
    overspent it (-100 %); the class as a whole burns at exactly 1 and has none left."""
    store = open_store(hub)
    try:
        store.accounts.put("acme", "S1")
        operator = store.operators.create("ops").plaintext
        token = store.tokens.create("depot", uses=1, expires_in_s=60).plaintext
        n1, _ = enroll_node(store, "n1")  # site "site"
        from tests.hubs import PREFIX, new_key  # noqa: PLC0415

        n2 = store.nodes.enroll(
            token, name="n2", wg_public_key=new_key(), overlay_prefix=PREFIX, labels={},
            versions={},
        ).node.id  # fmt: skip
        now = time.time()
        beats = [
            (n1, series(requests=1000, met=980, missed=20, ttft={3: 800, 5: 180})),
            (n2, series(requests=1000, met=1000, ttft={3: 1000})),
        ]
        store.heartbeats(
            [
                Heartbeat(
                    node, now, {}, protocol.Capacity(),
                    objectives=protocol.Objectives.model_validate(objectives("e", body)),
                )
                for node, body in beats
            ]
        )  # fmt: skip
    finally:
        store.close()
    return operator, {"n1": n1, "n2": n2}


def _rows(report: dict[str, Any], objective: str = "first_token") -> dict[str, dict[str, Any]]:
    return {r["group"]: r for r in report["data"] if r["objective"] == objective}


async def test_the_operator_api_reports_and_refuses_bad_queries(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = console_settings(tmp_path, hub_database)
    operator, _ = _fleet(hub)
    server = await start(aiohttp_server, hub)
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    base = f"https://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=pin),
        headers={"Authorization": f"Bearer {operator}"},
    ) as session:

        async def get(path: str) -> tuple[int, Any]:
            async with session.get(base + path) as response:
                return response.status, await response.json()

        status, report = await get("/v1/admin/objectives")
        assert status == 200, report
        assert (report["window"], report["by"], report["budget_period"]) == ("1h", "class", "30d")
        s1 = _rows(report)[""]
        assert (s1["service_class"], s1["good"], s1["bad"], s1["target"]) == ("S1", 1980, 20, 0.99)
        assert s1["attainment"] == pytest.approx(0.99)
        assert s1["burn_rate"] == pytest.approx(1.0)
        assert s1["budget_left"] == pytest.approx(0.0)
        admit = _rows(report, "admit")[""]
        assert (admit["good"], admit["bad"], admit["burn_rate"], admit["budget_left"]) == (
            2000, 0, 0.0, 1.0,
        )  # fmt: skip
        assert report["requests"] == [
            {"service_class": "S1", "group": "", "requests": 2000, "admitted": 2000,
             "refused": dict.fromkeys(protocol.REFUSALS, 0)}
        ]  # fmt: skip

        status, report = await get("/v1/admin/objectives?window=1d&by=node")
        by_node = _rows(report)
        assert by_node["n1"]["burn_rate"] == pytest.approx(2.0)
        assert by_node["n1"]["budget_left"] == pytest.approx(-1.0)
        assert by_node["n2"]["burn_rate"] == 0.0
        status, report = await get("/v1/admin/objectives?by=site&site=depot")
        assert set(_rows(report)) == {"depot"}
        status, report = await get("/v1/admin/objectives?by=account&class=S2")
        assert (status, report["data"]) == (200, [])

        status, points = await get("/v1/admin/objectives/series?window=1h&step=5m")
        assert status == 200, points
        assert points["step_s"] == 300
        [point] = points["data"]
        assert point["service_class"] == "S1"
        assert point["requests"] == 2000
        assert point["attainment"]["first_token"] == pytest.approx(0.99)
        assert point["burn_rate"]["first_token"] == pytest.approx(1.0)
        # 1800 TTFTs in (0.25, 0.5], 180 in (1, 2]: the median in the first, the 95th in the second.
        assert 0.25 < point["ttft_p50_s"] <= 0.5
        assert 1.0 < point["ttft_p95_s"] <= 2.0

        for bad in ("window=2y", "window=40d", "window=0h", "by=planet", "class=S9",
                    "step=soon", "window="):  # fmt: skip
            for path in ("/v1/admin/objectives", "/v1/admin/objectives/series"):
                status, answer = await get(f"{path}?{bad}")
                assert_refused(status, answer, f"{path}?{bad}")
                assert answer["error"]["code"] == "invalid_value"
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pin)) as anonymous,
        anonymous.get(base + "/v1/admin/objectives") as response,
    ):
        assert response.status == 401


def test_the_cli_reports_the_objectives(tmp_path: Path, hub_database: HubDatabase) -> None:
    hub = console_settings(tmp_path, hub_database)
    _fleet(hub)
    data_dir = str(hub.data_dir)
    out = kvl("hub", "objectives", "--data-dir", data_dir, "--by", "node").stdout
    lines = {line.split()[2]: line for line in out.splitlines() if "first_token" in line}
    assert "98.000 %" in lines["n1"]
    assert "-100.0 %" in lines["n1"]
    assert lines["n1"].split()[-1] == "2.00"
    assert "100.000 %" in lines["n2"]
    report = json.loads(kvl("hub", "objectives", "--data-dir", data_dir, "--json").stdout)
    assert _rows(report)[""]["burn_rate"] == pytest.approx(1.0)
    empty = kvl("hub", "objectives", "--data-dir", data_dir, "--class", "S2").stdout
    assert "nothing counted" in empty
    refused = kvl("hub", "objectives", "--data-dir", data_dir, "--window", "2y", check=False)
    assert refused.returncode == 2
    assert "--window" in refused.stderr


async def test_the_console_shows_the_objectives(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = console_settings(tmp_path, hub_database)
    _, ids = _fleet(hub)
    add_user(hub)
    server = await start(aiohttp_server, hub)
    async with open_console(server, hub) as console:
        assert await console.login() == 303
        status, page, _ = await console.get("/console/objectives")
        assert status == 200, page
        assert 'href="/console/objectives" aria-current="page"' in page
        for window in ("1h", "1d", "30d"):
            assert f'data-window="{window}"' in page
        assert "99.000 %" in page  # S1 first token, the class as a whole
        assert 'id="slo-attainment"' in page
        assert 'id="slo-burn"' in page
        assert "S1: latest 99" in page  # the attainment chart's description
        status, page, _ = await console.get("/console/objectives?by=node")
        assert "98.000 %" in page
        assert "(overspent)" in page
        status, page, _ = await console.get("/console/objectives?by=site&class=&account=&node=")
        # An empty field is no filter: n1's site overspent, in each of the three windows.
        assert (status, page.count("(overspent)")) == (200, 3)
        status, page, _ = await console.get("/console/objectives?by=planet")
        assert status == 400
        status, page, _ = await console.get(f"/console/nodes/{ids['n1']}")
        assert status == 200
        assert "Objectives, the last 1h" in page
        assert "98.000 %" in page
