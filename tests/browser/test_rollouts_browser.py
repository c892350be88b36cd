"""The console's rollouts page in a real browser (Debian's chromium, headless, driven by
Playwright) against a real hub on loopback: a release rollout started after the page loaded
appears in it, its canary is shown, and as
the canary's heartbeats report the new version good the page follows it into wave 1 with
no reload; then the operator pauses it from the page. The nodes are the test's own
protocol-6 clients (what the page shows comes from their heartbeats alone)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import aiohttp
import pytest
from playwright.async_api import expect
from wireguard_tools import WireguardKey

from appliance.fleet.client import HubClient
from hub.app import create_app
from hub.identity import certificates, ssl_context
from hub.planning.rollout import Strategy
from hub.rollouts import begin
from hub.settings import HubSettings
from hub.state.store import open_store
from shared import pki, protocol
from tests.browser.chromium import (
    ARTIFACTS,
    CHROMIUM,
    PASSWORD,
    Shots,
    create_admin,
    open_browser,
)
from tests.hubs import settings_for
from tests.releases import speak_releases
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None, reason="needs Debian's chromium: run `.venv/bin/just setup-system`"
    ),
]


def _wave(hub: HubSettings, rollout_id: str) -> int:
    store = open_store(hub)
    try:
        return store.rollouts.get(rollout_id).wave
    finally:
        store.close()


async def test_the_rollouts_page_follows_a_rollout_live_in_chromium(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    hub = settings_for(tmp_path, fleet={"rollout_every_s": 0.1}, console={"stream_every_s": 0.3})
    create_admin(str(hub.data_dir))
    store = open_store(hub)
    tokens = {}
    for name in ("edge-a", "edge-b"):
        token = store.tokens.create("lab", uses=1, expires_in_s=60).plaintext
        tokens[name] = store.nodes.enroll(
            token, name=name, wg_public_key=str(WireguardKey.generate().public_key()),
            overlay_prefix="100.64.0.0/10", labels={}, versions={},
        ).node_token  # fmt: skip
    store.rollouts.add_release("2.0", "", "b" * 64, 10)
    store.close()
    server = await aiohttp_server(create_app(hub), ssl=ssl_context(hub))
    base = f"https://127.0.0.1:{server.port}"
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    clients = {name: HubClient(base, pin, token) for name, token in tokens.items()}
    old = protocol.ImageStatus(version="1.0", slot="rootfs.0", state="good")
    shots = Shots(ARTIFACTS / "rollouts")
    try:
        for client in clients.values():
            await client.heartbeat({}, protocol.Capacity(image=old))
        await until(lambda: speak_releases(hub), "both nodes heard")

        async with open_browser(tmp_path / "chromium-profile") as context:
            page = await context.new_page()
            await page.goto(f"{base}/console/rollouts")
            await page.get_by_label("Name", exact=True).fill("ops")
            await page.get_by_label("Password", exact=True).fill(PASSWORD)
            await page.get_by_role("button", name="Log in").click()
            await expect(page).to_have_url(f"{base}/console/rollouts")
            await expect(page.get_by_text("No rollout yet.")).to_be_visible()

            # A rollout started after the page loaded appears in it, with no reload.
            await page.evaluate("window.kvlMarker = 'still here'")
            store = open_store(hub)
            rollout = begin(store, "release", {"release": "2.0"},
                            Strategy(soak_s=0.0, max_burn_rate=None), "ops")  # fmt: skip
            store.close()
            section = page.locator(f'section[data-rollout="{rollout.id}"]')
            phase = section.locator('[data-field="phase"]')
            await expect(phase).to_have_text("canary", timeout=20_000)
            await shots.take(page, "canary")

            assert await page.evaluate("window.kvlMarker") == "still here"

            # The canary reports 2.0 good: the page moves on with no reload.
            new = old.model_copy(update={"version": "2.0", "target": "2.0"})
            await clients["edge-a"].heartbeat({}, protocol.Capacity(image=new))
            await until(lambda: _wave(hub, rollout.id) == 1, "the hub moves the rollout on")
            await expect(phase).to_have_text("wave 1", timeout=20_000)
            row = section.locator(
                f'tr[data-node="{rollout.id}/{rollout.members[0].member.node_id}"]'
            )
            await expect(row.locator('[data-field="state"]')).to_have_text("updated")
            await expect(row.locator('[data-field="running"]')).to_have_text("2.0")
            assert await page.evaluate("window.kvlMarker") == "still here"
            await shots.take(page, "wave-1")

            await section.get_by_role("button", name=f"Pause rollout {rollout.id}").click()
            await expect(page.get_by_text("The rollout is paused")).to_be_visible()
            await expect(phase).to_have_text(re.compile(r"^paused at wave 1$"))
            await shots.take(page, "paused")
    finally:
        for client in clients.values():
            await client.close()
