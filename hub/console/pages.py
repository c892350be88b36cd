"""The console's pages and actions. Thin: read the form, call the store method that the
operator API and the CLI call too, render or redirect."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from hub.api.requests import DeploymentRequest
from hub.console.auth import (
    LOGIN_COOKIE,
    SESSION_COOKIE,
    hash_password,
    needs_rehash,
    new_csrf,
    new_session,
    same_token,
    session_hash,
    verify_password,
)
from hub.console.charts import Series, line_chart
from hub.console.fleet import (
    Filters,
    fleet_row,
    fleet_table,
    placement_errors,
    served_models,
)
from hub.console.logs import level_of, recent_logs
from hub.console.samples import sample_of
from hub.console.sse import nodes_stream
from hub.console.web import (
    FORM,
    console,
    current_session,
    from_here,
    guarded,
    hub_settings,
    hub_store,
    page,
    read_form,
    refused,
    render,
    see_other,
)
from hub.fleet.objectives import report_view
from hub.state.errors import NotFoundError
from hub.state.objectives import SloFilters
from hub.views import configuration_view, deployment_view, node_view, quota_view
from shared.keys import ENROLLMENT_TOKEN, parse_prefix
from shared.protocol import LOG_LEVELS

SITE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$")
EXPIRIES = {"1h": 3600.0, "24h": 86_400.0, "7d": 604_800.0, "30d": 2_592_000.0}
EVENTS_SHOWN = 20
PACKAGES_SHOWN = 500


async def home(request: web.Request) -> web.Response:
    return see_other("/console/nodes")


# -- login ------------------------------------------------------------------------------


def _next(target: str | None) -> str:
    """Where to go after logging in: a console page, never elsewhere."""
    if target and target.startswith("/console/") and not target.startswith("/console//"):
        return target
    return "/console/nodes"


def _login_form(
    request: web.Request,
    *,
    status: int = 200,
    error: str | None = None,
    next_page: str | None = None,
) -> web.Response:
    token = new_csrf()
    response = render(
        request,
        "login.html",
        status=status,
        login_csrf=token,
        error=error,
        next=_next(next_page or request.query.get("next")),
    )
    response.set_cookie(LOGIN_COOKIE, token, max_age=3600, path="/", secure=True, httponly=True,
                        samesite="Strict")  # fmt: skip
    return response


@guarded
async def login_page(request: web.Request) -> web.StreamResponse:
    if await current_session(request) is not None:
        return see_other(_next(request.query.get("next")))
    return _login_form(request)


@guarded
async def login(request: web.Request) -> web.StreamResponse:
    """Check the name and password (argon2id, off the event loop); a new session."""
    if not from_here(request):
        return refused(request)
    form = await read_form(request)
    if form is None or not same_token(form.get("csrf"), request.cookies.get(LOGIN_COOKIE)):
        return refused(request)
    state = console(request)
    address = request.remote or "unknown"
    name, password = form.get("name", "")[:200], form.get("password", "")
    wait = state.throttle.wait_s(address, time.time(), account=name)
    if wait > 0:
        response = _login_form(
            request,
            status=429,
            error=(
                f"Too many failed logins from this address or for this name: wait {wait:.0f} s."
            ),
            next_page=form.get("next"),
        )
        response.headers["Retry-After"] = str(int(wait) + 1)
        return response
    store = hub_store(request)
    stored = await store.run(store.sync.console.password_hash, name)
    if not await asyncio.to_thread(verify_password, stored, password):
        state.throttle.failed(address, time.time(), account=name)
        return _login_form(
            request, status=401, error="Wrong name or password.", next_page=form.get("next")
        )
    state.throttle.succeeded(address, account=name)
    assert stored is not None  # noqa: S101 - verify_password is False without a hash
    if needs_rehash(stored):
        rehashed = await asyncio.to_thread(hash_password, password)
        await store.run(store.sync.console.set_password_hash, name, rehashed, end_sessions=False)
    new = new_session()
    now = time.time()
    lifetime = hub_settings(request).console.session_s
    await store.run(store.sync.console.add_session, new.id_hash, name, new.csrf, now=now,
                    expires_at=now + lifetime)  # fmt: skip
    response = see_other(_next(form.get("next")))
    response.set_cookie(SESSION_COOKIE, new.token, max_age=int(lifetime), path="/", secure=True,
                        httponly=True, samesite="Strict")  # fmt: skip
    response.del_cookie(LOGIN_COOKIE, path="/", secure=True, httponly=True, samesite="Strict")
    return response


@page
async def logout(request: web.Request) -> web.StreamResponse:
    token = request.cookies.get(SESSION_COOKIE, "")
    store = hub_store(request)
    await store.run(store.sync.console.delete_session, session_hash(token))
    response = see_other("/console/login")
    response.del_cookie(SESSION_COOKIE, path="/", secure=True, httponly=True, samesite="Strict")
    return response


# -- the fleet and its nodes ------------------------------------------------------------


@page
async def nodes_page(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    nodes = await store.nodes()
    filters = Filters.from_query(request.query)
    table = fleet_table(nodes, hub_settings(request), time.time(), filters)
    return render(
        request,
        "nodes.html",
        table=table,
        filters=filters,
        sites=sorted({n.site for n in nodes}),
        total=len(nodes),
        query=request.query_string,
    )


@page
async def node_page(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    settings = hub_settings(request)
    node = await store.run(store.sync.nodes.get, request.match_info["node"])
    now = time.time()
    since = now - settings.console.samples_kept_s
    samples = await store.run(store.sync.console.samples, node.id, since)
    events = await store.run(store.sync.ledger.node_events, node.id, EVENTS_SHOWN)
    deployments = await store.run(store.sync.deployments.all)
    placed = await store.run(store.sync.deployments.placements)
    here = {d for d, n, _ in placed if n == node.id}
    configured = await store.run(configuration_view, node, store.sync.configuration)
    gap = max(3 * settings.console.sample_every_s, 3 * settings.fleet.stale_after_s)
    # From the first sample kept (at least the last ten minutes), so a new node's short
    # history is not a sliver at the right edge of six hours.
    start = max(since, min(samples[0].at if samples else now, now - 600))

    objectives = await store.read(
        report_view, store.reader, settings.objectives, window=settings.objectives.windows[0],
        by="node", filters=SloFilters(node=node.id), now=now,
    )  # fmt: skip

    def chart(chart_id: str, title: str, unit: str, *series: Series, **kw: Any) -> Any:
        return line_chart(chart_id, title, series, unit=unit, start=start, end=now, gap_s=gap,
                          **kw)  # fmt: skip

    logs = await recent_logs(request, node, settings, level_of(request))
    charts = [
        chart("load", "Load (CPU)", "%",
              Series("CPU", [(s.at, s.cpu_percent) for s in samples]), y_max=100.0),
        chart("memory", "Memory", "MiB",
              Series("used", [(s.at, float(s.memory_used_mib)) for s in samples]),
              Series("total", [(s.at, float(s.memory_total_mib)) for s in samples])),
        chart("queues", "Queue and outbox", "requests or events",
              Series("queue", [(s.at, float(s.queue_waiting)) for s in samples]),
              Series("outbox lag", [(s.at, float(s.outbox_lag)) for s in samples])),
    ]  # fmt: skip
    return render(
        request,
        "node.html",
        node=node,
        view=node_view(node, settings, now),
        row=fleet_row(node, settings, now),
        charts=charts,
        events=events,
        models=served_models(node),
        errors=placement_errors(node),
        evaluations=node.capacity.evaluations,
        configured=configured,
        sample=None if node.last_seen is None else sample_of(node.last_seen, node.capacity),
        gpus=[g.model_dump() for g in node.capacity.gpus],
        placed=[d for d in deployments if d.id in here],
        samples_kept_h=settings.console.samples_kept_s / 3600,
        charts_from=start,
        logs=logs,
        log_levels=[n.lower() for n in LOG_LEVELS],
        objectives=objectives,
    )


@page
async def node_drain(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    draining = request[FORM].get("undo") != "1"
    node = await store.run(
        lambda: store.sync.nodes.set_draining(request.match_info["node"], draining=draining)
    )
    return see_other(f"/console/nodes/{node.id}", "drained" if draining else "undrained")


@page
async def node_tenancy(request: web.Request) -> web.StreamResponse:
    """The operator sets a node's tenancy (what the node's labels say grants nothing)."""
    store = hub_store(request)
    node = await store.run(store.sync.nodes.get, request.match_info["node"])
    tenant = request[FORM].get("tenant", "").strip() or None
    if tenant is not None and not SITE.match(tenant):
        return see_other(f"/console/nodes/{node.id}", "tenant-invalid")
    private = request[FORM].get("private") == "1"
    await store.run(
        lambda: store.sync.accounts.set_node_tenancy(node, tenant=tenant, private=private)
    )
    return see_other(f"/console/nodes/{node.id}", "tenancy-set")


@page
async def node_revoke(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    node = await store.run(store.sync.nodes.get, request.match_info["node"])
    if request[FORM].get("confirm") != "yes":
        return see_other(f"/console/nodes/{node.id}", "unconfirmed")
    await store.revoke_node(node.id)
    return see_other(f"/console/nodes/{node.id}", "revoked")


# -- enrollment tokens ------------------------------------------------------------------


async def _tokens(
    request: web.Request, *, status: int = 200, created: str | None = None,
    error: str | None = None,
) -> web.Response:  # fmt: skip
    store = hub_store(request)
    tokens = await store.run(store.sync.tokens.all)
    return render(request, "tokens.html", status=status, tokens=tokens[::-1], created=created,
                  error=error, expiries=list(EXPIRIES))  # fmt: skip


@page
async def tokens_page(request: web.Request) -> web.StreamResponse:
    return await _tokens(request)


@page
async def tokens_create(request: web.Request) -> web.StreamResponse:
    form = request[FORM]
    site = form.get("site", "").strip()
    expires = EXPIRIES.get(form.get("expires", ""))
    try:
        uses = int(form.get("uses", "1"))
    except ValueError:
        uses = 0
    if not SITE.match(site):
        return await _tokens(request, status=400, error="A site is 1 to 100 letters, digits, "
                             "spaces, dots, dashes or underscores.")  # fmt: skip
    if not 1 <= uses <= 100_000 or expires is None:
        return await _tokens(request, status=400, error="Uses are 1 to 100000; pick a lifetime.")
    tenant = form.get("tenant", "").strip() or None
    if tenant is not None and not SITE.match(tenant):
        return await _tokens(request, status=400, error="A tenant is 1 to 100 letters, digits, "
                             "spaces, dots, dashes or underscores.")  # fmt: skip
    private = form.get("private") == "1"
    store = hub_store(request)
    new = await store.run(
        lambda: store.sync.tokens.create(
            site, uses=uses, expires_in_s=expires, tenant=tenant, private=private
        )
    )
    return await _tokens(request, created=new.plaintext)


@page
async def tokens_revoke(request: web.Request) -> web.StreamResponse:
    given = request.match_info["prefix"]
    prefix = parse_prefix(given, ENROLLMENT_TOKEN) or given
    store = hub_store(request)
    await store.run(store.sync.tokens.revoke, prefix)
    return see_other("/console/tokens", "token-revoked")


# -- accounts and their keys ------------------------------------------------------------


async def _accounts(
    request: web.Request, *, status: int = 200, created: tuple[str, str] | None = None,
    error: str | None = None,
) -> web.Response:  # fmt: skip
    store = hub_store(request)
    accounts = await store.run(store.sync.leases.quotas, time.time())
    keys = await store.run(store.sync.accounts.keys)
    names = await store.node_names()
    return render(
        request,
        "accounts.html",
        status=status,
        accounts=[(a, None if q is None else quota_view(q, names)) for a, q in accounts],
        keys=keys,
        created=created,
        error=error,
    )


@page
async def accounts_page(request: web.Request) -> web.StreamResponse:
    return await _accounts(request)


@page
async def keys_create(request: web.Request) -> web.StreamResponse:
    form = request[FORM]
    account = form.get("account", "")
    store = hub_store(request)
    try:
        new = await store.run(
            lambda: store.sync.accounts.create_key(account, admin=form.get("admin") == "1")
        )
    except NotFoundError as err:
        return await _accounts(request, status=400, error=str(err))
    return await _accounts(request, created=(account, new.plaintext))


@page
async def keys_revoke(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    await store.run(store.sync.accounts.revoke_key, request.match_info["prefix"])
    return see_other("/console/accounts", "key-revoked")


# -- placements -------------------------------------------------------------------------


async def _placements(
    request: web.Request, *, status: int = 200, error: str | None = None
) -> web.Response:
    store = hub_store(request)
    settings = hub_settings(request)
    deployments = await store.run(store.sync.deployments.all)
    placed = await store.run(store.sync.deployments.placements)
    nodes = {n.id: n for n in await store.nodes()}
    names = await store.node_names()
    models = await store.run(store.sync.deployments.models)
    now = time.time()
    shown = []
    for d in deployments:
        replicas = []
        for deployment_id, node_id, gpu in placed:
            node = nodes.get(node_id)
            if deployment_id != d.id or node is None:
                continue
            failed = placement_errors(node).get(d.model)
            running = d.model in served_models(node)
            state = "running" if running else "failed" if failed else "converging"
            replicas.append({
                "node": node, "gpu": gpu, "state": state, "error": failed,
                "status": node_view(node, settings, now)["status"],
            })  # fmt: skip
        shown.append({"view": deployment_view(d, placed, names), "replicas": replicas})
    return render(request, "placements.html", status=status, deployments=shown, models=models,
                  error=error)  # fmt: skip


@page
async def placements_page(request: web.Request) -> web.StreamResponse:
    return await _placements(request)


@page
async def deploy(request: web.Request) -> web.StreamResponse:
    """The operator API's deployment request, from a form: the same checks, the same record."""
    form = request[FORM]
    sites = [s.strip() for s in form.get("sites", "").split(",") if s.strip()]
    try:
        req = DeploymentRequest.model_validate({
            "model": form.get("model", ""), "replicas": form.get("replicas", "1"),
            "service_class": form.get("service_class", "S1"), "sites": sites,
            "gpu": form.get("gpu") == "1", "tenant": form.get("tenant", "").strip() or None,
        })  # fmt: skip
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return await _placements(request, status=400, error=f"{where}: {first['msg']}".strip(": "))
    record = req.record()
    store = hub_store(request)
    try:
        await store.run(store.sync.deployments.add, record)
    except NotFoundError as err:
        return await _placements(request, status=400, error=str(err))
    return see_other("/console/placements", "deployed")


@page
async def undeploy(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    await store.run(store.sync.deployments.remove, request.match_info["id"])
    return see_other("/console/placements", "undeployed")


# -- packages (and jobs) ----------------------------------------------------------------


@page
async def packages_page(request: web.Request) -> web.StreamResponse:
    store = hub_store(request)
    rows = await store.run(store.sync.packages.summaries, PACKAGES_SHOWN)
    names = await store.node_names()
    return render(request, "packages.html", packages=rows, names=names, limit=PACKAGES_SHOWN)


def console_routes() -> list[web.RouteDef]:
    return [
        web.get("/console", home),
        web.get("/console/", home),
        web.get("/console/login", login_page),
        web.post("/console/login", login),
        web.post("/console/logout", logout),
        web.get("/console/nodes", nodes_page),
        web.get("/console/nodes/stream", nodes_stream),
        web.get("/console/nodes/{node}", node_page),
        web.post("/console/nodes/{node}/drain", node_drain),
        web.post("/console/nodes/{node}/tenancy", node_tenancy),
        web.post("/console/nodes/{node}/revoke", node_revoke),
        web.get("/console/tokens", tokens_page),
        web.post("/console/tokens", tokens_create),
        web.post("/console/tokens/{prefix}/revoke", tokens_revoke),
        web.get("/console/accounts", accounts_page),
        web.post("/console/keys", keys_create),
        web.post("/console/keys/{prefix}/revoke", keys_revoke),
        web.get("/console/placements", placements_page),
        web.post("/console/deployments", deploy),
        web.post("/console/deployments/{id}/undeploy", undeploy),
        web.get("/console/packages", packages_page),
    ]
