"""The hub's web console over real HTTPS on loopback: logins (argon2id, sessions stored
as hashes, throttled failures), CSRF refusals, every page for a logged-in admin, the
actions the API and the CLI also have, the fleet's live stream, and `kvl hub admin`.
The browser tier (tests/browser) drives the same pages in chromium."""

from __future__ import annotations

import asyncio
import hashlib
import html
import re
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from wireguard_tools import WireguardKey
from yarl import URL

from hub.console.auth import LOGIN_COOKIE, SESSION_COOKIE, LoginThrottle
from hub.console.charts import Series, line_chart, nice_ceiling
from hub.planning.quota import Budget
from hub.settings import HubSettings
from hub.state.deployments import ModelArtifact
from hub.state.store import open_store
from shared import protocol
from tests.conftest import REPO, kvl
from tests.console import (
    PASSWORD,
    Console,
    add_user,
    console_settings,
    csrf_of,
    enroll,
    heartbeat,
    open_console,
    start,
    stream_event,
)
from tests.waiting import until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from tests.hub.conftest import HubDatabase


@pytest.fixture
async def hub(tmp_path: Path, hub_database: HubDatabase) -> HubSettings:
    return console_settings(tmp_path, hub_database)


@pytest.fixture
async def console(aiohttp_server: AiohttpServer, hub: HubSettings) -> AsyncIterator[Console]:
    add_user(hub)
    server = await start(aiohttp_server, hub)
    async with open_console(server, hub) as c:
        yield c


def set_cookie(response: aiohttp.ClientResponse, name: str) -> str:
    headers = [h for h in response.headers.getall("Set-Cookie", []) if h.startswith(name + "=")]
    assert len(headers) == 1, response.headers
    return headers[0]


# -- logins -----------------------------------------------------------------------------


async def test_login_sets_a_strict_cookie_whose_session_is_stored_hashed(
    console: Console, hub: HubSettings
) -> None:
    status, _, response = await console.get("/console/nodes")
    assert status == 303
    assert response.headers["Location"] == "/console/login?next=%2Fconsole%2Fnodes"
    status, page, response = await console.get("/console/login")
    assert status == 200
    assert 'for="password"' in page
    login_cookie = set_cookie(response, LOGIN_COOKIE)
    for attribute in ("HttpOnly", "Secure", "SameSite=Strict", "Path=/"):
        assert attribute in login_cookie
    # Nothing from elsewhere: no external script, style, font or image.
    assert not re.search(r'(src|href|action)="(https?:)?//', page)
    assert "default-src 'self'" in response.headers["Content-Security-Policy"]

    console.csrf = csrf_of(page)
    status, page, response = await console.post(
        "/console/login",
        {"name": "ops", "password": PASSWORD, "next": "/console/tokens"},
    )
    assert (status, response.headers["Location"]) == (303, "/console/tokens")
    session_cookie = set_cookie(response, SESSION_COOKIE)
    for attribute in ("HttpOnly", "Secure", "SameSite=Strict", "Path=/"):
        assert attribute in session_cookie
    token = console.cookie(SESSION_COOKIE)
    assert token
    store = open_store(hub)
    try:
        stored = [tuple(r) for r in store.db.execute("SELECT * FROM console_sessions")]
        hashes = [r[0] for r in store.db.execute("SELECT hash FROM console_users")]
    finally:
        store.close()
    assert [s[0] for s in stored] == [hashlib.sha256(token.encode()).hexdigest()]
    assert token not in repr(stored)
    assert hashes[0].startswith("$argon2id$")
    status, page, _ = await console.get("/console/tokens")
    assert status == 200
    assert "ops" in page  # who is logged in
    console.csrf = csrf_of(page)

    # Only console pages are places to go after a login.
    _, _, response = await console.get("/console/login?next=//evil.example")
    assert response.headers["Location"] == "/console/nodes"
    await console.post("/console/logout", {})
    _, page, _ = await console.get("/console/login")
    console.csrf = csrf_of(page)
    _, _, response = await console.post(
        "/console/login", {"name": "ops", "password": PASSWORD, "next": "https://evil.example/"}
    )
    assert response.headers["Location"] == "/console/nodes"


async def test_a_wrong_password_or_name_is_refused_on_the_login_page(console: Console) -> None:
    assert await console.login(password="not the password") == 401
    assert await console.login(name="nobody") == 401
    status, page, _ = await console.get("/console/nodes")
    assert status == 303
    _, page, _ = await console.get("/console/login")
    console.csrf = csrf_of(page)
    status, page, _ = await console.post(
        "/console/login", {"name": "ops", "password": "nope", "next": "/console/tokens"}
    )
    assert status == 401
    assert "Wrong name or password." in page
    assert 'name="next" value="/console/tokens"' in page  # where to go once it is right
    assert console.cookie(SESSION_COOKIE) is None


async def test_failed_logins_are_throttled_per_address(
    aiohttp_server: AiohttpServer, tmp_path: Path, hub_database: HubDatabase
) -> None:
    hub = console_settings(tmp_path, hub_database, login_failures_allowed=2)
    add_user(hub)
    server = await start(aiohttp_server, hub)
    async with open_console(server, hub) as console:
        assert await console.login(password="wrong one") == 401
        assert await console.login(password="wrong two") == 401
        # Now even the right password waits: the address is blocked for a while.
        _, page, _ = await console.get("/console/login")
        console.csrf = csrf_of(page)
        status, page, response = await console.post(
            "/console/login", {"name": "ops", "password": PASSWORD}
        )
        assert status == 429
        assert int(response.headers["Retry-After"]) > 0
        assert "Too many failed logins" in page
        assert console.cookie(SESSION_COOKIE) is None


def test_the_throttle_doubles_the_wait_up_to_its_cap_and_forgets_a_success() -> None:
    throttle = LoginThrottle(3, first_wait_s=30, max_wait_s=100)
    for _ in range(2):
        throttle.failed("a", 0.0)
    assert throttle.wait_s("a", 0.0) == 0
    throttle.failed("a", 0.0)
    assert throttle.wait_s("a", 0.0) == 30
    throttle.failed("a", 10.0)
    assert throttle.wait_s("a", 10.0) == 60
    throttle.failed("a", 20.0)
    assert throttle.wait_s("a", 20.0) == 100  # capped
    assert throttle.wait_s("b", 20.0) == 0  # per address
    throttle.succeeded("a")
    assert throttle.wait_s("a", 20.0) == 0


async def test_logout_and_an_expired_session_end_the_login(
    console: Console, hub: HubSettings
) -> None:
    assert await console.login() == 303
    token = console.cookie(SESSION_COOKIE)
    status, _, response = await console.post("/console/logout", {})
    assert (status, response.headers["Location"]) == (303, "/console/login")
    assert (await console.get("/console/nodes"))[0] == 303
    # The old cookie, replayed, is worth nothing: the session is gone from the store.
    console.session.cookie_jar.update_cookies(
        {SESSION_COOKIE: token or ""}, response_url=URL(console.base)
    )
    assert console.cookie(SESSION_COOKIE) == token
    assert (await console.get("/console/nodes"))[0] == 303

    assert await console.login() == 303
    assert (await console.get("/console/nodes"))[0] == 200
    store = open_store(hub)
    store.db.execute("UPDATE console_sessions SET expires_at = ?", [time.time() - 1])
    store.close()
    assert (await console.get("/console/nodes"))[0] == 303


# -- CSRF -------------------------------------------------------------------------------


def token_count(hub: HubSettings) -> int:
    store = open_store(hub)
    try:
        return len(store.tokens.all())
    finally:
        store.close()


async def test_cross_site_posts_are_refused_and_change_nothing(
    console: Console, hub: HubSettings
) -> None:
    assert await console.login() == 303
    form = {"site": "lab", "uses": "1", "expires": "24h"}
    for origin in ("https://evil.example", "null", f"http://{console.base[8:]}"):
        status, page, _ = await console.post("/console/tokens", form, origin=origin)
        assert status == 403, origin
        assert "not sent from a page of this console" in page
    status, _, _ = await console.post("/console/tokens", form, with_csrf=False)
    assert status == 403
    status, _, _ = await console.post("/console/tokens", {**form, "csrf": "x" * 43})
    assert status == 403
    status, _, _ = await console.post("/console/tokens", form, origin=None)  # neither header
    assert status == 403
    assert token_count(hub) == 0
    # A Referer of this console stands in for a missing Origin.
    async with console.session.post(
        console.base + "/console/tokens",
        data={"csrf": console.csrf, **form},
        headers={"Referer": console.base + "/console/tokens"},
        allow_redirects=False,
    ) as response:
        assert response.status == 200
    assert token_count(hub) == 1
    # The login form has its own token too.
    await console.post("/console/logout", {})
    status, _, _ = await console.post(
        "/console/login", {"name": "ops", "password": PASSWORD}, with_csrf=False
    )
    assert status == 403
    # Without a login, a post from the right origin goes to the login page, doing nothing.
    status, _, response = await console.post("/console/tokens", form)
    assert (status, response.headers["Location"]) == (303, "/console/login")
    assert token_count(hub) == 1


# -- pages and actions ------------------------------------------------------------------


async def test_every_page_renders_and_every_action_works(
    console: Console, hub: HubSettings
) -> None:
    store = open_store(hub)
    store.accounts.put("acme", "S1", requests_per_minute=60, budget=Budget(50_000, 86_400))
    store.accounts.put("beta", "S2")
    store.deployments.add_model(ModelArtifact("m", "1", "ab" * 32, 10, "gguf", 600))
    store.tokens.create("<b>bold</b>", uses=1, expires_in_s=60)  # escaped, not markup
    with store.db.transaction():
        store.db.execute(
            "INSERT INTO packages (id, version, title, topic, level, items, size, digest,"
            " lineage, origin_node, created_at, received_at, bundle_sha256) VALUES"
            " ('fractions', '1', 'Fractions', 'maths', 'A1', 12, 123456, 'sha256:00', '{}',"
            " NULL, '2026-01-01T00:00:00Z', 1.0, NULL)"
        )
    store.close()
    node_a = await enroll(console, hub, "node-a", site="north")
    node_b = await enroll(console, hub, "node-b", site="south")
    await heartbeat(console, node_a)
    await heartbeat(console, node_b, cpu_percent=5.0)
    events = [{"id": f"e{i}", "kind": "usage", "body": {"account": "acme", "tokens_in": 7}}
              for i in range(3)]  # fmt: skip
    async with console.session.post(
        console.base + "/v1/node/events",
        json={"events": events},
        headers={"Authorization": f"Bearer {node_a}", **protocol.HEADERS},
    ) as response:
        assert response.status == 200
    assert await console.login() == 303

    async def page(path: str) -> str:
        status, text, _ = await console.get(path)
        assert status == 200, (path, text)
        return text

    fleet = await until(
        lambda: _when(page("/console/nodes"), lambda t: "9.9.9" in t), "the heartbeats"
    )
    assert 'data-node="node-a"' in fleet
    assert "37 %" in fleet
    filtered = await page("/console/nodes?site=south")
    assert 'data-node="node-b"' in filtered
    assert 'data-node="node-a"' not in filtered
    assert 'data-node="node-a"' not in await page("/console/nodes?status=offline")
    assert 'data-node="node-b"' in await page("/console/nodes?name=DE-B")

    # The node page: its facts, its events and its charts, drawn from the sampler's samples.
    node_id = re.search(r'href="/console/nodes/([0-9a-f]{32})">node-a', fleet)
    assert node_id
    detail = await until(
        lambda: _when(page(f"/console/nodes/{node_id[1]}"), lambda t: "<polyline" in t
                      or "<circle" in t),
        "a sample of node-a",
    )  # fmt: skip
    assert detail.count('<svg class="chart"') == 3
    assert "e2" in detail  # its events
    assert "<code>m@1</code> loaded" in detail
    assert "2,000 MiB used of 8,000 MiB" in detail
    assert "node-b" in await page("/console/nodes/node-b")  # by name too

    tokens = await page("/console/tokens")
    assert "&lt;b&gt;bold&lt;/b&gt;" in tokens
    assert "<b>bold</b>" not in tokens
    accounts = await page("/console/accounts")
    assert 'data-account="acme"' in accounts
    assert "50,000" in accounts
    assert "21 of 50,000" in accounts  # three events of 7 tokens, from the ledger
    assert 'data-account="beta"' in accounts
    assert "m@1" in await page("/console/placements")
    packages = await page("/console/packages")
    assert "Fractions" in packages
    assert "holds no jobs data" in packages

    # Drain and take back, revoke (only when confirmed).
    path = f"/console/nodes/{node_id[1]}"
    status, _, response = await console.post(path + "/drain", {})
    assert (status, response.headers["Location"]) == (303, f"{path}?notice=drained")
    assert "The node drains" in await page(f"{path}?notice=drained")
    assert _node(hub, "node-a").draining
    await console.post(path + "/drain", {"undo": "1"})
    assert not _node(hub, "node-a").draining
    await console.post(path + "/revoke", {})
    assert not _node(hub, "node-a").revoked
    await console.post(path + "/revoke", {"confirm": "yes"})
    assert _node(hub, "node-a").revoked
    assert "revoked" in await page(path)
    async with console.session.post(
        console.base + "/v1/node/heartbeat",
        json={},
        headers={"Authorization": f"Bearer {node_a}", **protocol.HEADERS},
    ) as response:
        assert response.status == 403  # the API refuses it too

    # A token is shown once; it enrolls a node; a revoked one does not.
    status, created, _ = await console.post(
        "/console/tokens", {"site": "east", "uses": "1", "expires": "1h"}
    )
    assert status == 200
    plaintext = re.search(r'value="(kvle_[^"]+)"', created)
    assert plaintext
    assert plaintext[1] not in await page("/console/tokens")
    body = {"token": html.unescape(plaintext[1]), "name": "node-c",
            "wg_public_key": str(WireguardKey.generate().public_key())}  # fmt: skip
    async with console.session.post(
        console.base + "/v1/enroll", json=body, headers=protocol.HEADERS
    ) as response:
        assert response.status == 201
    status, created, _ = await console.post(
        "/console/tokens", {"site": "east", "uses": "2", "expires": "7d"}
    )
    second = re.search(r'value="(kvle_[^"]+)"', created)
    assert second
    prefix = second[1].split("_")[1]
    status, _, response = await console.post(f"/console/tokens/{prefix}/revoke", {})
    assert (status, response.headers["Location"]) == (303, "/console/tokens?notice=token-revoked")
    async with console.session.post(
        console.base + "/v1/enroll",
        json={**body, "token": second[1], "name": "node-d"},
        headers=protocol.HEADERS,
    ) as response:
        assert response.status == 401
    bad = await console.post("/console/tokens", {"site": "", "uses": "1", "expires": "1h"})
    assert bad[0] == 400
    bad = await console.post("/console/tokens", {"site": "x", "uses": "0", "expires": "1h"})
    assert bad[0] == 400
    assert (await console.post("/console/tokens/kvle_nope/revoke", {}))[0] == 404

    # Deploy and undeploy, checked as the API checks them.
    status, _, response = await console.post(
        "/console/deployments", {"model": "m@1", "replicas": "2", "service_class": "S1"}
    )
    assert (status, response.headers["Location"]) == (303, "/console/placements?notice=deployed")
    deployments = _deployments(hub)
    assert [(d.model, d.replicas) for d in deployments] == [("m@1", 2)]
    listed = await page("/console/placements")
    assert f'data-deployment="{deployments[0].id}"' in listed
    status, text, _ = await console.post("/console/deployments", {"model": "m@1", "replicas": "-1"})
    assert status == 400
    assert "replicas" in text
    status, text, _ = await console.post("/console/deployments", {"model": "nope@1"})
    assert status == 400
    assert "no model" in text
    status, text, _ = await console.post(
        "/console/deployments", {"model": "m@1", "service_class": "S3"}
    )
    assert status == 400  # a dedicated deployment names its tenant
    undeploy = f"/console/deployments/{deployments[0].id}/undeploy"
    assert (await console.post(undeploy, {}))[0] == 303
    assert _deployments(hub) == []
    assert (await console.post(undeploy, {}))[0] == 404

    # An API key: shown once, its hash in the nodes' desired state; revoked.
    status, created, _ = await console.post("/console/keys", {"account": "acme", "admin": "1"})
    assert status == 200
    key = re.search(r'value="(kvl_[^"]+)"', created)
    assert key
    assert key[1] not in await page("/console/accounts")
    key_prefix = key[1].split("_")[1]
    assert _key(hub, key_prefix) == ("acme", 1, None)
    assert (await console.post(f"/console/keys/{key_prefix}/revoke", {}))[0] == 303
    assert _key(hub, key_prefix)[2] is not None
    assert (await console.post("/console/keys", {"account": "nobody"}))[0] == 400

    # Console errors are pages too.
    for path in ("/console/nope", "/console/nodes/nope"):
        status, text, response = await console.get(path)
        assert status == 404
        assert response.content_type == "text/html"
        assert "Not found" in text
    status, text, response = await console.get("/console/static/nope.css")
    assert status == 404
    assert response.content_type == "text/html"


async def _when(text: Any, check: Callable[[str], bool]) -> str | None:
    value = await text
    return value if check(value) else None


def _node(hub: HubSettings, name: str) -> Any:
    store = open_store(hub)
    try:
        return store.nodes.get(name)
    finally:
        store.close()


def _deployments(hub: HubSettings) -> list[Any]:
    store = open_store(hub)
    try:
        return store.deployments.all()
    finally:
        store.close()


def _key(hub: HubSettings, prefix: str) -> tuple[Any, ...]:
    store = open_store(hub)
    try:
        row = store.db.execute(
            "SELECT account, admin, revoked_at FROM api_keys WHERE prefix = ?", [prefix]
        ).fetchone()
        return tuple(row)
    finally:
        store.close()


# -- the live stream --------------------------------------------------------------------


async def test_the_fleet_stream_follows_the_nodes_and_ends_with_the_hub(
    aiohttp_server: AiohttpServer, hub: HubSettings
) -> None:
    add_user(hub)
    server = await start(aiohttp_server, hub)
    async with open_console(server, hub) as console:
        status, _, _ = await console.get("/console/nodes/stream")
        assert status == 401
        assert await console.login() == 303
        async with console.session.get(console.base + "/console/nodes/stream?site=lab") as stream:
            assert stream.headers["Content-Type"] == "text/event-stream"
            first = await stream_event(stream, "nodes")
            assert first["rows"] == []
            token = await enroll(console, hub, "live-1")
            await enroll(console, hub, "elsewhere", site="other")
            await heartbeat(console, token)

            async def status_of(wanted: str) -> dict[str, Any]:
                while True:
                    data: dict[str, Any] = await stream_event(stream, "nodes")
                    rows = {r["name"]: r for r in data["rows"]}
                    assert "elsewhere" not in rows  # the filter holds
                    if "live-1" in rows and rows["live-1"]["status"] == wanted:
                        return data

            online = await asyncio.wait_for(status_of("online"), 20)
            assert online["counts"]["online"] == 1
            assert online["counts"]["offline"] == 1  # the whole fleet's counts
            row = next(r for r in online["rows"] if r["name"] == "live-1")
            assert (row["version"], row["load"], row["queue"], row["outbox_lag"]) == (
                "9.9.9", "37 %", "2", "5"
            )  # fmt: skip
            # No more heartbeats: stale, then offline, without anyone reloading.
            await asyncio.wait_for(status_of("stale"), 20)
            await asyncio.wait_for(status_of("offline"), 20)
            # The hub shuts down: the stream ends instead of holding the shutdown up.
            closing = asyncio.create_task(server.close())
            assert await asyncio.wait_for(stream.content.read(), 20) == b""
            await asyncio.wait_for(closing, 20)


# -- charts -----------------------------------------------------------------------------


def test_charts_are_escaped_svg_that_break_at_gaps() -> None:
    svg = line_chart(
        "c1", "Load <of> node", [Series("cpu", [(0, 10.0), (10, 20.0), (100, 30.0)])],
        unit="%", start=0, end=100, y_max=100, gap_s=20,
    )  # fmt: skip
    assert svg.startswith('<svg class="chart" id="c1"')
    assert '<title id="c1-t">Load &lt;of&gt; node</title>' in svg
    assert svg.count("<polyline") == 1  # 0 → 10, then a gap, then a lone point
    assert svg.count("<circle") == 1
    assert "latest 30 %, highest 30 %" in svg
    empty = line_chart("c2", "Empty", [Series("x", [])], unit="MiB", start=0, end=60)
    assert "No samples yet" in empty
    assert [nice_ceiling(v) for v in (0, 0.3, 7, 12, 180, 2400)] == [1, 0.5, 10, 20, 200, 2500]


# -- kvl hub admin ----------------------------------------------------------------------


def admin(*args: str, data: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", "hub", "admin", *args, "--data-dir", data],
        input=stdin, capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip


async def test_kvl_hub_admin_creates_the_first_admin_who_can_log_in(
    aiohttp_server: AiohttpServer, hub: HubSettings
) -> None:
    data = str(hub.data_dir)
    made = admin("create", "--name", "first", "--password-stdin", data=data, stdin=PASSWORD + "\n")
    assert made.returncode == 0, made.stderr
    again = admin("create", "--name", "first", "--password-stdin", data=data, stdin=PASSWORD)
    assert again.returncode != 0
    assert "exists already" in again.stderr
    short = admin("create", "--name", "second", "--password-stdin", data=data, stdin="short\n")
    assert short.returncode != 0
    assert "at least 10 characters" in short.stderr
    assert admin("list", data=data).stdout.split()[0] == "first"
    assert "first" in kvl("hub", "admin", "list", "--data-dir", data).stdout

    server = await start(aiohttp_server, hub)
    async with open_console(server, hub) as console:
        assert await console.login("first") == 303
        assert (await console.get("/console/nodes"))[0] == 200
        # A new password ends the logins of that user.
        changed = admin("password", "first", "--password-stdin", data=data,
                        stdin="another long password\n")  # fmt: skip
        assert changed.returncode == 0, changed.stderr
        assert (await console.get("/console/nodes"))[0] == 303
        assert await console.login("first") == 401
        assert await console.login("first", "another long password") == 303
        gone = admin("delete", "first", data=data)
        assert gone.returncode == 0, gone.stderr
        assert (await console.get("/console/nodes"))[0] == 303
        assert admin("delete", "first", data=data).returncode != 0


async def test_the_alerts_page_shows_alerts_and_makes_and_ends_silences(
    console: Console, hub: HubSettings
) -> None:
    from hub.state.alerts import Firing  # noqa: PLC0415

    store = open_store(hub)
    store.alerts.record(
        [Firing("node_offline", {"node": "n9", "site": "lab"}, "page", 130.0, "n9 is quiet")],
        ["node_offline"],
        [],
    )
    store.close()
    status, _, response = await console.get("/console/alerts")
    assert status == 303  # a login first
    assert await console.login() == 303
    status, page, _ = await console.get("/console/alerts")
    assert status == 200
    assert 'href="/console/alerts" aria-current="page"' in page
    assert "n9 is quiet" in page
    assert "<code>node=n9</code>" in page
    status, page, _ = await console.post("/console/silences", {"rule": "", "duration": "1h"})
    assert status == 400  # neither a rule nor a label
    status, _, response = await console.post(
        "/console/silences",
        {"rule": "node_offline", "label": "node=n9", "duration": "4h", "comment": "moving"},
    )
    assert status == 303
    assert response.headers["Location"] == "/console/alerts?notice=silenced"
    store = open_store(hub)
    (silence,) = store.alerts.silences()
    store.close()
    assert silence.matchers == {"node": "n9", "rule": "node_offline"}
    assert silence.created_by == "ops"
    status, page, _ = await console.get("/console/alerts?notice=silenced")
    assert f'data-silence="{silence.id}"' in page
    status, _, _ = await console.post(f"/console/silences/{silence.id}/end", {})
    assert status == 303
    status, _, _ = await console.post(f"/console/silences/{silence.id}/end", {})
    assert status == 404
