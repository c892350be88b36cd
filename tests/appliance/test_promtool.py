"""The appliance's /metrics, as a running appliance serves it after a generation, passes
Prometheus's own linter (`promtool check metrics`, Debian's `prometheus` package, which
`just setup-system` installs)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from typing import TYPE_CHECKING

from appliance.app import create_app
from appliance.gateway.appkeys import REGISTRY
from appliance.state.records import ModelRecord
from appliance.state.store import Store
from tests.conftest import SCRIPTED, make_settings

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient


async def test_metrics_pass_promtool_check_metrics(
    aiohttp_client: AiohttpClient, tmp_path: Path, scripted_model: ModelRecord
) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: run `just setup-system`"
    settings = make_settings(tmp_path / "data", embeddings={"enabled": False})
    store = Store(settings.db_path)
    try:
        store.add_model(scripted_model)
        key = store.create_key("tester").plaintext
    finally:
        store.close()
    app = create_app(settings)
    client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": SCRIPTED, "prompt": "Hello", "max_tokens": 4, "stream": True}
    served = await client.post("/v1/completions", headers=headers, json=body)
    assert served.status == 200
    await served.read()
    missing = await client.post(
        "/v1/completions", headers=headers, json={"prompt": "x", "model": "x"}
    )
    assert missing.status == 404  # an error response: its families have samples too
    # The classic text format (what promtool reads), as a Prometheus that asks for it gets.
    response = await client.get("/metrics", headers={"Accept": "text/plain"})
    assert response.content_type == "text/plain"
    exposition = await response.read()
    assert b"kvl_requests_by_outcome_total" in exposition
    assert b"kvl_slo_events_total" in exposition
    lint = await asyncio.to_thread(
        subprocess.run,
        [promtool, "check", "metrics"],
        input=exposition,
        capture_output=True,
        check=False,
    )
    assert (lint.returncode, (lint.stdout + lint.stderr).decode()) == (0, "")
