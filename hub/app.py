"""The hub application: wiring only (settings, identity, store, loops, routes), in the
order they depend on each other."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from hub import backup as hub_backup
from hub.alerting.delivery import AlertSender, delivering
from hub.alerting.loop import Evaluator, evaluating
from hub.api.metrics import metrics_app
from hub.api.node import node_auth
from hub.api.operator import operator_auth
from hub.api.route_kinds import route_defs
from hub.api.route_table import ROUTES
from hub.appkeys import (
    BANDWIDTH,
    BEATS,
    FORWARDER,
    IDENTITY,
    LEARNING,
    LOOPS,
    METRICS,
    NODE_LOGS,
    PULLS,
    RUNNING,
    SCHEDULED,
    SETTINGS,
    STORE,
    TLS,
    TRACING,
)
from hub.certificates import HubTls
from hub.console.app import setup_console
from hub.fleet.bandwidth import SiteBandwidth
from hub.fleet.heartbeats import Heartbeats, flushing
from hub.fleet.learning import Learning
from hub.fleet.peers import tunnel_up
from hub.http import errors
from hub.identity import identity
from hub.loops import Running, running
from hub.models.jobs import PullRunner
from hub.nodelogs import NodeLogs
from hub.observability.metrics import HubMetrics
from hub.offload import Forwarder
from hub.reconciler import reconcile_forever
from hub.rollouts import rollouts_forever
from hub.state.store import AsyncHubStore
from shared import __version__, heap
from shared.backup_archive import serving
from shared.backup_schedule import Scheduled
from shared.tracing import Tracing

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from hub.settings import HubSettings


log = logging.getLogger(__name__)


def create_app(settings: HubSettings) -> web.Application:
    app = web.Application(
        middlewares=[errors, node_auth, operator_auth], client_max_size=16 * 2**20
    )
    app[SETTINGS] = settings
    app[METRICS] = HubMetrics()
    # Every background loop of this hub counts its failed rounds here (hub/loops.py),
    # and in kvl_hub_background_failures_total.
    app[LOOPS] = app[METRICS].failures
    app[RUNNING] = Running()
    app.add_routes(route_defs(ROUTES))  # the node and operator APIs, as the table declares
    app[IDENTITY] = identity(settings)
    app[TLS] = HubTls(settings)  # the CA and the hub's certificate, made on first start
    app[LEARNING] = Learning(time.time(), settings.quota.lease_s)
    app[BANDWIDTH] = SiteBandwidth()
    app[SCHEDULED] = Scheduled(
        settings.backups,
        settings.data_dir,
        hub_backup.KIND,
        lambda out: hub_backup.backup(settings, out, artifacts=settings.backups.artifacts),
    )
    app.cleanup_ctx.append(_store)
    app.cleanup_ctx.append(_heartbeats)
    app.cleanup_ctx.append(_tracing)
    app.cleanup_ctx.append(_forwarder)
    app.cleanup_ctx.append(_node_logs)
    app.cleanup_ctx.append(_pki)
    app.cleanup_ctx.append(_placement)
    app.cleanup_ctx.append(_rollouts)
    app.cleanup_ctx.append(_pulls)
    app.cleanup_ctx.append(_alerts)
    app.cleanup_ctx.append(_backups)
    if settings.overlay.interface is not None:
        app.cleanup_ctx.append(_tunnel)
    if settings.metrics.listen is not None:
        app.cleanup_ctx.append(_metrics_listener)
    setup_console(app)  # the web console (/console/), after the store it reads
    return app


async def freeze_heap(_: web.Application) -> None:
    """Once the hub has started: what the process holds by then (modules, settings, the
    application) is moved out of the garbage collector's reach, so that its full
    collections scan only what the fleet's calls add. Over the whole startup heap, each
    held the event loop for 50 to 90 ms under a fleet of 10,000 nodes."""
    heap.freeze()


FREEZE_EVERY_S = 2.0


async def freezing(app: web.Application) -> AsyncIterator[None]:
    """`kvl hub serve`'s heap, frozen again every FREEZE_EVERY_S after a collection of
    the young generations: what lives on by then (ten thousand nodes' kept TLS
    connections, the caches) joins the frozen part. Left to the collector, those
    connections made each full collection hold the loop for 0.6 s; a full collection
    before each freeze held it for a quarter of a second. Garbage in a cycle of objects
    frozen while alive waits for a restart; the hub's long-lived objects (connections,
    cache entries) break their cycles when they end, and reference counting frees
    them."""

    async def once() -> None:
        started = time.perf_counter()
        gc.collect(1)
        gc.freeze()
        held_ms = (time.perf_counter() - started) * 1000
        if held_ms > 100:
            log.info("collecting the heap held the loop for %.0f ms", held_ms)

    loop = app[LOOPS].forever("heap", once, FREEZE_EVERY_S)
    async with running(app[RUNNING], "heap", loop):
        yield


async def _store(app: web.Application) -> AsyncIterator[None]:
    # The data directory's lock, held while the store is open: `kvl hub restore` refuses
    # to write under a hub that serves, and a hub will not start under a restore.
    with serving(app[SETTINGS].data_dir, "hub"):
        store = AsyncHubStore(app[SETTINGS])  # SQLite, or PostgreSQL at settings.database_url
        await store.open()
        store.timed = app[METRICS].timed_call
        app[STORE] = store
        yield
        await store.close()


async def _heartbeats(app: web.Application) -> AsyncIterator[None]:
    """The write-behind of heartbeats (hub/fleet/heartbeats.py)."""
    beats = Heartbeats(app[SETTINGS].objectives.count_every_s)
    beats.taken = app[METRICS].flushed
    beats.objective_listeners.append(app[METRICS].objectives)  # kvl_fleet_*_total
    app[BEATS] = beats
    async with flushing(app[STORE], beats, app[LOOPS], app[RUNNING]):
        yield


async def _tracing(app: web.Application) -> AsyncIterator[None]:
    """Spans of the hub's hop of an offloaded request, to `tracing.otlp_endpoint`."""
    t = app[SETTINGS].tracing
    tracing = Tracing.otlp(
        t.otlp_endpoint,
        service=t.service_name,
        attributes={"service.version": __version__},
        sample_ratio=t.sample_ratio,
    )
    app[TRACING] = tracing
    yield
    tracing.shutdown()


async def _forwarder(app: web.Application) -> AsyncIterator[None]:
    """The client session burst offload forwards requests with."""
    forwarder = Forwarder(app[TLS], app[TRACING])
    app[FORWARDER] = forwarder
    yield
    await forwarder.close()


async def _node_logs(app: web.Application) -> AsyncIterator[None]:
    """The client session nodes' logs are read with, with the hub's current certificate."""
    hub_tls = app[TLS]
    reader = NodeLogs(lambda: hub_tls.client)
    app[NODE_LOGS] = reader
    yield
    await reader.close()


async def _pki(app: web.Application) -> AsyncIterator[None]:
    """Follow the CA files: a rotation step or a certificate issued again is served from
    the next handshake on (hub/certificates.py)."""
    hub_tls = app[TLS]

    async def refresh() -> None:
        await asyncio.to_thread(hub_tls.refresh)

    loop = app[LOOPS].forever("pki", refresh, app[SETTINGS].pki.reload_s)
    async with running(app[RUNNING], "pki", loop):
        yield


async def _placement(app: web.Application) -> AsyncIterator[None]:
    """The placement reconciler (hub/reconciler.py)."""
    loop = reconcile_forever(app[STORE], app[SETTINGS], app[LOOPS], app[METRICS])
    async with running(app[RUNNING], "placement", loop):
        yield


async def _rollouts(app: web.Application) -> AsyncIterator[None]:
    """The rollout loop (hub/rollouts.py): staged rollouts moved on, or halted."""
    loop = rollouts_forever(app[STORE], app[SETTINGS], app[LOOPS])
    async with running(app[RUNNING], "rollouts", loop):
        yield


async def _pulls(app: web.Application) -> AsyncIterator[None]:
    """The pull loop (hub/models/jobs.py): model pulls operators asked for, one at a time."""
    runner = app[PULLS] = PullRunner(app[STORE], app[SETTINGS], app[LOOPS])
    async with running(app[RUNNING], "pulls", runner.forever()):
        yield


async def _alerts(app: web.Application) -> AsyncIterator[None]:
    """The alert loop and its webhooks (hub/alerting/)."""
    settings, store, tls = app[SETTINGS], app[STORE], app[TLS]
    sender = AlertSender(store, settings.alerts)
    evaluator = Evaluator(
        store,
        settings,
        app[LOOPS],
        signing_ca=lambda: tls.phase.signing.fingerprint,
        changed=sender.wake.set,
        own_backup=app[SCHEDULED].report,
    )
    async with (
        delivering(sender, app[LOOPS], app[RUNNING]),
        evaluating(evaluator, settings.alerts.every_s, app[LOOPS], app[RUNNING]),
    ):
        yield


async def _backups(app: web.Application) -> AsyncIterator[None]:
    """The hub's scheduled backups (`backups.schedule`; shared/backup_schedule.py). With
    several replicas, give one of them the schedule."""
    scheduled = app[SCHEDULED]
    if not scheduled.scheduled:
        yield
        return
    async with running(app[RUNNING], "backups", scheduled.run()):
        yield


async def _tunnel(app: web.Application) -> AsyncIterator[None]:
    """The hub's WireGuard interface and its peer reconciler (hub/fleet/peers.py)."""
    async with tunnel_up(app[SETTINGS], app[STORE], app[LOOPS], app[RUNNING]):
        yield


async def _metrics_listener(app: web.Application) -> AsyncIterator[None]:
    """`metrics.listen`: `/metrics` alone, plain HTTP and no token, for a local Prometheus."""
    listen = app[SETTINGS].metrics.listen
    assert listen is not None  # noqa: S101 - only added when set
    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(metrics_app(app), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host.strip("[]"), int(port)).start()
    log.info("metrics: serving /metrics on http://%s without a token", listen)
    yield
    await runner.cleanup()
