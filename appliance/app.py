"""create_app: wiring only. Each long-lived resource is opened and closed by its own context."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import ChainMap
from typing import TYPE_CHECKING

from aiohttp import web

from appliance.bundles import Bundles, Targets
from appliance.fleet.certificates import NodeCertificate
from appliance.fleet.identity import FleetFiles, Provisioned, lan_tls_files, provisioned
from appliance.fleet.link import FleetLink
from appliance.fleet.release import Updater
from appliance.gateway import backups, cors
from appliance.gateway.appkeys import (
    ACCOUNTS,
    ADMISSION,
    CERTIFICATE,
    COMPLETIONS,
    EMBEDDINGS,
    LOGS,
    METRICS,
    NAMES,
    NODE_ID,
    OFFLOAD,
    PRESETS,
    REGISTRY,
    SETTINGS,
    STORE,
    TRACING,
)
from appliance.gateway.bundles import BUNDLES
from appliance.gateway.front import DECIDE, FILES_ROUTE
from appliance.gateway.jobs import JOBS
from appliance.gateway.middleware import authenticate, errors_and_metrics
from appliance.gateway.network import NETWORKS, SiteNetworks
from appliance.gateway.offload import Offload
from appliance.gateway.packages import PACKAGES, PACKAGES_URL, decide_file
from appliance.gateway.peers import PEERS, PeerFiles
from appliance.gateway.responses import RESPONSES
from appliance.gateway.routes import ROUTES
from appliance.gateway.server import FleetListener
from appliance.gateway.speech import SPEECH
from appliance.inference.accounts import AccountService
from appliance.inference.admission import AdmissionControl
from appliance.inference.completions import CompletionService
from appliance.inference.embeddings import EmbeddingService
from appliance.inference.names import ModelNames
from appliance.inference.responses_api import ResponsesService
from appliance.inference.speech import SpeechService
from appliance.jobs.service import JobService
from appliance.observability import logs
from appliance.observability.metrics import Metrics
from appliance.observability.tracing import Tracing
from appliance.packages.cache import PackageCache
from appliance.packages.service import PackageService
from appliance.packages.voice import Espeak, Neural
from appliance.serving.presets import Presets
from appliance.serving.registry import ModelRegistry
from appliance.state.store import AsyncStore
from appliance.update.installer import Rauc
from shared import __version__
from shared.backup_archive import serving
from shared.site_network import Paths

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from appliance.discovery.mdns import Announcer
    from appliance.grpc.server import GrpcServer
    from appliance.settings import ApplianceSettings
    from shared.protocol import NodeSettings

log = logging.getLogger(__name__)
# Discovery may be off: zeroconf (about 14 MiB) is imported only when it is on.
ANNOUNCER: web.AppKey[Announcer] = web.AppKey("announcer")
FLEET = web.AppKey("fleet", FleetLink)
# gRPC is off unless turned on: its module (grpcio, protobuf) is imported only then.
GRPC: web.AppKey[GrpcServer] = web.AppKey("grpc")
# What the provisioning file said at start: a hub to enroll with, or a bootstrap key.
PROVISIONED = web.AppKey("provisioned", Provisioned)


def create_app(settings: ApplianceSettings) -> web.Application:
    app = web.Application(
        middlewares=[cors.preflight, errors_and_metrics, authenticate],
        client_max_size=settings.server.max_body_bytes,
    )
    app[SETTINGS] = settings
    backups.setup(app)
    app.on_response_prepare.append(cors.add_headers)
    app[METRICS] = Metrics(objectives=settings.classes.objective_seconds())
    app[LOGS] = logs.ring()  # the hub reads the node's recent records (GET /v1/fleet/logs)
    app[CERTIFICATE] = NodeCertificate(settings.fleet_dir)
    agent = settings.network.agent_dir
    app[NETWORKS] = SiteNetworks(
        Paths(appliance=settings.data_dir / "network", agent=agent) if agent else None
    )
    app[PRESETS] = presets = Presets()
    app[NAMES] = ModelNames(
        # The node's own aliases first, then those of the hub's presets (read live).
        aliases=ChainMap(dict(settings.model.aliases), presets.aliases),
        default=settings.model.default,
        chat_default=settings.model.chat_default,
        embedding=settings.embeddings.model if settings.embeddings.enabled else None,
    )
    for route in ROUTES:
        app.router.add_route(route.method, route.router_path or route.path, route.handler)
    # Not the API's: the TLS front's nginx asks here (front.py); a 404 to anyone else.
    app.router.add_get(f"{DECIDE}{FILES_ROUTE}", decide_file)
    if settings.grpc.enabled:
        app.cleanup_ctx.append(_grpc_port)  # first: a port that is taken stops the start
    app.cleanup_ctx.append(_store)
    app.cleanup_ctx.append(_accounts)
    app.cleanup_ctx.append(_tracing)
    app.cleanup_ctx.append(_models)
    app.cleanup_ctx.append(_speech)
    app.cleanup_ctx.append(_jobs)
    app.cleanup_ctx.append(_fleet)
    app.cleanup_ctx.append(_embeddings)
    if settings.grpc.enabled:
        app.cleanup_ctx.append(_grpc)
    if settings.discovery.enabled:
        app.cleanup_ctx.append(_discovery)
    return app


async def _store(app: web.Application) -> AsyncIterator[None]:
    # The data directory's lock, held while the store is open: `kvl appliance restore`
    # refuses to write under an appliance that serves, and one will not start under a
    # restore.
    with serving(app[SETTINGS].data_dir, "appliance"):
        store = AsyncStore(app[SETTINGS].db_path)
        await store.open()
        app[STORE] = store
        app[NODE_ID] = await store.run(store.sync.node_id)
        yield
        await store.close()


async def _accounts(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    plan = provisioned(settings.fleet.provisioning_file)
    app[PROVISIONED] = plan
    identity = FleetFiles(settings.fleet_dir).identity_path

    def hub_managed() -> bool:
        # Provisioned for a hub, or enrolled with one (an identity outlives its file).
        return plan.hub or identity.is_file()

    service = AccountService(app[STORE], hub_managed=hub_managed)
    if plan.bootstrap_key is not None:
        # Before the API listens: the site's first admin key works from the first request.
        await service.import_bootstrap_key(plan.bootstrap_key)
    app[ACCOUNTS] = service
    yield


async def _tracing(app: web.Application) -> AsyncIterator[None]:
    t = app[SETTINGS].tracing
    tracing = Tracing.otlp(
        t.otlp_endpoint,
        service=t.service_name,
        attributes={"service.version": __version__, "service.instance.id": app[NODE_ID]},
        sample_ratio=t.sample_ratio,
    )
    app[TRACING] = tracing
    yield
    tracing.shutdown()


async def _models(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    host = ModelRegistry(app[STORE], settings, app[METRICS], app[PRESETS])
    app[REGISTRY] = host
    admission = AdmissionControl(settings.classes, app[STORE], app[METRICS])
    app[ADMISSION] = admission
    # The live objectives resume from what was stored before this start.
    store = app[STORE]
    admission.book.load(await store.run(store.sync.load_objectives))
    app[METRICS].watch_objectives(admission.book)
    app[OFFLOAD] = Offload(admission, app[METRICS], app[TRACING])
    app[COMPLETIONS] = CompletionService(
        host,
        app[STORE],
        app[METRICS],
        settings.model.max_tokens_limit,
        admission=admission,
        tracing=app[TRACING],
        names=app[NAMES],
    )
    app[RESPONSES] = ResponsesService(app[COMPLETIONS], app[STORE], settings.responses)
    host.start()
    yield
    await host.close()
    # Every request has ended: the book as it stands, for the next start.
    await store.run(store.sync.save_objectives, admission.book.take_dirty())


async def _speech(app: web.Application) -> AsyncIterator[None]:
    # The voices load on first use: espeak-ng is a process per piece, the neural voice's
    # model (about 60 MB) is read at its first request.
    settings = app[SETTINGS].speech
    model = settings.neural_voice_model or Neural.bundled()
    neural = None if model is None else Neural(model, rate_wpm=settings.rate_wpm)
    if neural is None and settings.default_model == "neural" and settings.enabled:
        log.warning(
            "speech.default_model is neural, but no voice file is set or installed (the "
            "`voice` extra): tts-1 and its kin read with espeak-ng"
        )
    app[SPEECH] = SpeechService(
        settings,
        app[STORE],
        app[METRICS],
        app[ADMISSION],
        espeak=Espeak(settings.rate_wpm),
        neural=neural,
    )
    yield


async def _fleet(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    files = FleetFiles(settings.fleet_dir)
    admission = app[ADMISSION]

    def on_lag(lag: int, full: bool) -> None:
        admission.outbox_full = full

    certificate = app[CERTIFICATE]
    files.certificate = certificate  # one object: its renewals reach every server
    listener: FleetListener | None = None

    async def on_certificate() -> None:
        """The fleet listener, once this node has its certificate (and its tunnel): the
        hub's calls come there, over mutual TLS. Its TLS follows renewals."""
        nonlocal listener
        if listener is not None or not certificate.present or link.identity is None:
            return
        host = link.identity.overlay_address if settings.fleet.tunnel else settings.server.host
        started = FleetListener(app, host, settings.fleet.listen_port)
        try:
            link.fleet_port = await started.start(certificate.server(require_client=True).outer)
        except OSError as err:
            log.error("the fleet listener cannot listen on %s: %s", host, err)  # noqa: TRY400
            return
        listener = started
        log.info("fleet listener on %s:%d (mutual TLS)", host, link.fleet_port)

    updater = Updater(
        app[STORE],
        Rauc(settings.update.rauc, settings.update.rauc_options),
        settings.updates_dir,
        os_release=settings.update.os_release,
        reboot=settings.update.reboot_command,
        retry_s=settings.update.retry_s,
        streaming=settings.update.streaming,
        failures=app[METRICS].failures,
    )
    link = FleetLink(
        settings.fleet,
        files,
        app[STORE],
        app[METRICS],
        app[REGISTRY],
        on_lag=on_lag,
        leases=admission.leases,
        api={"port": settings.server.port, "tls": lan_tls_files(settings) is not None},
        models_dir=settings.models_dir,
        packages=app[PACKAGES],
        objectives=admission.book,
        on_settings=lambda given: _apply_settings(app, given),
        backups=app[backups.SCHEDULED],
        updater=updater,
    )
    link.on_certificate = on_certificate
    await link.restore_leases()
    app[FLEET] = link
    # The model files this node holds, for the other nodes of its site (protocol 10).
    app[PEERS] = PeerFiles(
        site=lambda: link.identity.site if link.identity is not None else None,
        trust=link.certificate.trust,
        fetching=link.fetching,
    )
    # Only a node that is, or is to be, in a fleet talks to a hub: a provisioning file of a
    # site without a hub carries a bootstrap key and no hub.
    active = app[PROVISIONED].hub or link.identity is not None
    app[BUNDLES] = Bundles(
        settings.data_dir / "bundles",
        settings.update.keyring,
        Targets(
            app[STORE], app[REGISTRY], app[PACKAGES], updater, settings.models_dir,
            link.apply_settings,
        ),
    )  # fmt: skip
    await app[BUNDLES].resume()
    # The settings a site bundle (or the hub, last time) gave, applied whether a hub
    # answers or not.
    await link.apply_settings()
    if active:
        app[OFFLOAD].link = link
        link.start()
    else:
        # A node without a hub: a release a bundle installed is settled as the hub's path
        # settles one (marked good once it booted into it), in the background.
        settle = asyncio.get_running_loop().create_task(updater.converge(None))
        settle.add_done_callback(_settled)
    yield
    await app[BUNDLES].close()
    if listener is not None:
        await listener.stop()
    if active:
        await link.close()


async def _jobs(app: web.Application) -> AsyncIterator[None]:
    # After the models: jobs resume at start (the first items wait for the model to load)
    # and stop before the models close, so an item cut short stays pending and runs again.
    settings = app[SETTINGS]
    fleet_files = FleetFiles(settings.fleet_dir)

    def overlay_prefix() -> str | None:
        # Webhooks never go into the fleet's overlay; the node learns it when it enrolls.
        identity = fleet_files.identity()
        return None if identity is None else identity.overlay_prefix

    service = JobService(
        app[STORE], app[COMPLETIONS], settings.jobs, app[METRICS], overlay_prefix=overlay_prefix
    )
    app[JOBS] = service
    # Content packages run as jobs too (one item each), so they resume after a restart.
    cache = PackageCache(settings.packages_dir, max_bytes=settings.packages.cache_max_mb << 20)
    packages = PackageService(
        app[COMPLETIONS],
        app[REGISTRY],
        cache,
        settings.packages,
        model=settings.packages.model or settings.model.default,
        node_id=app[NODE_ID],
        store=app[STORE],
    )
    app[PACKAGES] = packages
    service.runner.handlers[PACKAGES_URL] = packages.run_job_item
    service.start()
    yield
    await service.close()


async def _embeddings(app: web.Application) -> AsyncIterator[None]:
    # The model loads in a thread in the background: /healthz answers meanwhile, and
    # /v1/embeddings says model_not_ready until it is loaded.
    service = EmbeddingService(app[SETTINGS].embeddings, app[STORE], app[METRICS], app[NAMES])
    app[EMBEDDINGS] = service
    app[PACKAGES].similarity = service.similarities  # the packages' on_topic check
    service.start()
    yield
    app[PACKAGES].similarity = None
    await service.close()


async def _grpc_port(app: web.Application) -> AsyncIterator[None]:
    # TLS as the LAN API has it, chosen at start the same way (appliance/cli.py).
    from appliance.grpc.server import GrpcServer  # noqa: PLC0415 - only when turned on

    settings = app[SETTINGS]
    server = GrpcServer(
        settings.grpc,
        host=settings.grpc.host or settings.server.host,
        tls=lan_tls_files(settings),
        max_message_bytes=settings.server.max_body_bytes,
    )
    port = server.listen()
    log.info("gRPC API on port %d (%s)", port, "TLS" if server.tls else "plaintext")
    app[GRPC] = server
    yield
    await server.stop()


async def _grpc(app: web.Application) -> AsyncIterator[None]:
    # After every service it serves from; it stops before they close, its calls in
    # flight given `grpc.shutdown_grace_s`.
    from appliance.grpc.server import Services  # noqa: PLC0415 - only when turned on

    services = Services(
        completions=app[COMPLETIONS],
        embeddings=app[EMBEDDINGS],
        registry=app[REGISTRY],
        admission=app[ADMISSION],
        store=app[STORE],
        metrics=app[METRICS],
        tracing=app[TRACING],
    )
    await app[GRPC].serve(services)
    yield
    await app[GRPC].stop()


async def _discovery(app: web.Application) -> AsyncIterator[None]:
    # zeroconf only when discovery is on (ANNOUNCER).
    from appliance.discovery.mdns import (  # noqa: PLC0415
        Announcement,
        Announcer,
        announced_on,
        lan_addresses,
    )

    settings = app[SETTINGS]
    interfaces = announced_on(settings.server.host, settings.discovery.interfaces)
    if interfaces == []:
        log.info("not announced over mDNS: the server listens on loopback only")
        yield
        return
    announcer = Announcer(
        Announcement(
            node_id=app[NODE_ID],
            name=settings.discovery.node_name or socket.gethostname(),
            version=__version__,
            port=settings.server.port,
            tls=settings.server.tls_cert_file is not None,
        ),
        addresses=lan_addresses(settings.server.host),
        interfaces=interfaces,
    )
    await announcer.start_or_keep_trying()
    app[ANNOUNCER] = announcer
    yield
    await announcer.stop()


def _settled(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("settling the image release: %s", task.exception())


def _apply_settings(app: web.Application, given: NodeSettings) -> None:
    """What the hub sets of this node's settings: the model names (its defaults and
    aliases over the node's own), the service classes' objectives, and the content
    packages' settings."""
    app[NAMES].hub = given
    app[ADMISSION].apply_targets(given.objectives)
    app[PACKAGES].apply(given.packages)
