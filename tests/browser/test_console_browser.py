"""The hub's console in a real browser: Debian's chromium, headless, driven by Playwright,
against a real hub on loopback (HTTPS) with two real appliances enrolled. Log in (after a
wrong password), watch nodes appear live, create and revoke an enrollment token, deploy a
model and watch it converge, see a node that went away shown offline, and have a
cross-site form post refused. Screenshots go to tests/browser/artifacts/ (printed)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web
from playwright.async_api import expect

from hub.app import create_app
from hub.identity import ssl_context
from hub.settings import HubSettings
from hub.state.nodes import Heartbeat
from hub.state.store import open_store
from shared import __version__, protocol
from tests.appliance.fleet_nodes import join
from tests.browser.chromium import (
    ARTIFACTS,
    CHROMIUM,
    PASSWORD,
    Shots,
    create_admin,
    open_browser,
)
from tests.conftest import kvl
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pytest_aiohttp import AiohttpServer

    from appliance.state.records import ModelRecord

WAIT_MS = 90_000  # model loads and downloads on a small machine

pytestmark = [
    pytest.mark.browser,
    pytest.mark.model,  # the appliances serve the real default model
    pytest.mark.skipif(
        CHROMIUM is None, reason="needs Debian's chromium: run `.venv/bin/just setup-system`"
    ),
]


def _hub(tmp_path: Path) -> HubSettings:
    return settings_for(
        tmp_path,
        fleet={"stale_after_s": 3, "offline_after_s": 5, "offline_grace_s": 600,
               "placement_every_s": 0.3},
        console={"stream_every_s": 0.5, "sample_every_s": 1},
    )  # fmt: skip


def _objectives_counted(hub: HubSettings, node: str) -> None:
    """Counters of a node's objectives, as a heartbeat of another epoch carries them: S1,
    950 of 1000 first tokens in time, for an account the hub does not know."""
    series = {
        "service_class": "S1", "account": "browser", "requests": 1000, "admitted": 1000,
        "met": {"admit": 1000, "first_token": 950, "complete": 990},
        "missed": {"first_token": 50, "complete": 10},
    }  # fmt: skip
    store = open_store(hub)
    try:
        found = store.nodes.get(node)
        body = protocol.Objectives.model_validate({"epoch": "browser", "series": [series]})
        store.heartbeats(
            [Heartbeat(found.id, time.time(), found.versions, found.capacity,
                       address=found.address, objectives=body)]
        )  # fmt: skip
    finally:
        store.close()


def _tokens(hub: HubSettings) -> list[Any]:
    store = open_store(hub)
    try:
        return store.tokens.all()
    finally:
        store.close()


@pytest.mark.timeout(900)
async def test_the_console_in_chromium(
    aiohttp_server: AiohttpServer, tmp_path: Path, default_model: ModelRecord
) -> None:
    hub = _hub(tmp_path)
    data = str(hub.data_dir)
    create_admin(data)
    kvl("hub", "models", "add", default_model.path, "--name", "placed", "--version", "1",
        "--data-dir", data)  # fmt: skip
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    assert server.port is not None
    base = f"https://127.0.0.1:{server.port}"
    shots = Shots(ARTIFACTS / "console")

    async with open_browser(tmp_path / "chromium-profile") as context:
        page = await context.new_page()

        # Unauthenticated: to the login page, whose form the keyboard alone fills in.
        await page.goto(f"{base}/console/nodes")
        await expect(page).to_have_url(re.compile(r"/console/login\?next="))
        await expect(page.get_by_label("Name", exact=True)).to_be_focused()
        await page.keyboard.type("ops")
        await page.keyboard.press("Tab")
        await page.keyboard.type("not the password")
        await page.keyboard.press("Enter")
        await expect(page.get_by_role("alert")).to_have_text("Wrong name or password.")
        await shots.take(page, "wrong-password")
        await page.get_by_label("Name", exact=True).fill("ops")
        await page.get_by_label("Password", exact=True).fill(PASSWORD)
        await page.get_by_role("button", name="Log in").click()
        await expect(page).to_have_url(f"{base}/console/nodes")
        await expect(page.get_by_role("heading", name="Fleet")).to_be_visible()
        await page.keyboard.press("Tab")  # the first stop: past the navigation
        await expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
        await shots.take(page, "fleet-empty")
        nav = page.get_by_role("navigation", name="Console")

        # Nodes appear live, without a reload (the marker would be gone after one).
        await page.evaluate("window.kvlMarker = 'still here'")
        nodes = {}
        for name in ("node-a", "node-b"):
            nodes[name] = await join(aiohttp_server, tmp_path, default_model, hub, server.port,
                                     name=name, model={"n_ctx": 512, "n_threads": 1,
                                                       "n_slots": 1})  # fmt: skip
        for name in nodes:
            row = page.locator(f'#fleet-rows tr[data-node="{name}"]')
            await expect(row).to_have_attribute("data-status", "online", timeout=WAIT_MS)
            await expect(row).to_contain_text(__version__)
        assert await page.evaluate("window.kvlMarker") == "still here"
        await shots.take(page, "fleet-live")

        # An enrollment token: created, shown once, revoked.
        await nav.get_by_role("link", name="Enrollment tokens").click()
        await page.get_by_label("Site", exact=True).fill("east")
        await page.get_by_label("Lifetime", exact=True).select_option("1h")
        await page.get_by_role("button", name="Create token").click()
        token = await page.get_by_label("Token", exact=True).input_value()
        assert re.fullmatch(r"kvle_[A-Za-z0-9]{8}_[A-Za-z0-9]{32}", token)
        await shots.take(page, "token-created")
        await page.goto(f"{base}/console/tokens")
        assert token not in await page.content()
        prefix = token.split("_")[1]
        row = page.locator(f'tr[data-token="{prefix}"]')
        await expect(row).to_contain_text("active")
        await row.get_by_role("button", name=f"Revoke token {prefix}").click()
        await expect(page.locator(f'tr[data-token="{prefix}"]')).to_contain_text("revoked")
        assert [t.state(time.time()) for t in _tokens(hub) if t.prefix == prefix] == ["revoked"]
        await shots.take(page, "token-revoked")

        # Deploy a model and watch it converge: placed, downloaded, loaded, reported.
        await nav.get_by_role("link", name="Placements").click()
        await page.get_by_label("Model", exact=True).select_option("placed@1")
        await page.get_by_label("Replicas", exact=True).fill("1")
        await page.get_by_role("button", name="Deploy").click()
        await expect(page.get_by_role("status")).to_contain_text("Deployed")
        running = page.locator('.replica[data-state="running"]')
        deadline = time.monotonic() + WAIT_MS / 1000
        while await running.count() == 0:
            assert time.monotonic() < deadline, await page.content()
            await asyncio.sleep(1)
            await page.reload()
        host = await running.first.get_attribute("data-node")
        assert host in nodes
        await shots.take(page, "deployment-converged")

        # The node page: its charts, drawn on the server, and the model it runs.
        await running.first.get_by_role("link", name=host).click()
        await expect(page.get_by_role("heading", name=host)).to_be_visible()
        await expect(page.locator("svg.chart")).to_have_count(3)
        await expect(page.get_by_text("placed@1 loaded")).to_be_visible()
        await shots.take(page, "node")

        # The fleet's objectives: a heartbeat's worth counted as a flush counts it (another
        # replica's, say), then its tables per window and its charts; grouped by node.
        _objectives_counted(hub, host)
        await nav.get_by_role("link", name="Objectives").click()
        await expect(page.get_by_role("heading", name="Objectives", exact=True)).to_be_visible()
        await expect(page.locator("section.objectives")).to_have_count(3)
        await expect(page.locator("svg.chart")).to_have_count(2)
        await expect(page.locator('section[data-window="1h"]')).to_contain_text("first_token")
        await page.get_by_label("Group by").select_option("node")
        await page.get_by_role("button", name="Show").click()
        await expect(page.locator('section[data-window="1h"]')).to_contain_text(host)
        await shots.take(page, "objectives")

        # The other node goes away: the fleet page shows it offline, live.
        other = next(name for name in nodes if name != host)
        await nav.get_by_role("link", name="Fleet", exact=True).click()
        await page.evaluate("window.kvlMarker = 'still here'")
        await nodes[other].server.close()
        row = page.locator(f'#fleet-rows tr[data-node="{other}"]')
        await expect(row).to_have_attribute("data-status", "offline", timeout=WAIT_MS)
        await expect(page.locator(f'#fleet-rows tr[data-node="{host}"]')).to_have_attribute(
            "data-status", "online"
        )
        assert await page.evaluate("window.kvlMarker") == "still here"
        await shots.take(page, "node-offline")

        # A page of another origin (same site, so the cookie goes along) posts a form to
        # the console: refused, nothing made.
        attacker = web.Application()

        async def evil(request: web.Request) -> web.Response:
            return web.Response(
                content_type="text/html",
                text=f"""<!doctype html>
<form id="f" method="post" action="{base}/console/tokens">
<input name="site" value="evil"><input name="uses" value="9"><input name="expires" value="30d">
</form><script>document.getElementById("f").submit()</script>""",
            )

        attacker.add_routes([web.get("/", evil)])
        evil_server = await aiohttp_server(attacker, ssl=ssl_context(hub))
        async with page.expect_response(f"{base}/console/tokens") as answer:
            await page.goto(f"https://127.0.0.1:{evil_server.port}/")
        assert (await answer.value).status == 403
        await expect(page.get_by_role("heading", name="Refused")).to_be_visible()
        assert "evil" not in {t.site for t in _tokens(hub)}
        await shots.take(page, "cross-site-refused")

        # Logging out ends the session: the console is closed again.
        await page.goto(f"{base}/console/nodes")
        await page.get_by_role("button", name="Log out").click()
        await expect(page).to_have_url(f"{base}/console/login")
        await page.goto(f"{base}/console/placements")
        await expect(page).to_have_url(re.compile(r"/console/login\?next="))
        assert shots.count == 10
