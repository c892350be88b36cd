"""The fleet link: enroll once, then heartbeats and outbox sync on a schedule.

Usage events are committed to the local database before a client is answered; the
outbox is every event after the sync checkpoint. The link sends them in batches, and
moves the checkpoint only past events the hub acknowledged. The hub's ledger is unique on
the event id, so a batch sent again after a lost acknowledgement is harmless: nothing is
lost and nothing is counted twice. While the hub is unreachable the appliance serves on;
the outbox grows, and past `fleet.outbox_alarm_events` the link raises an alarm (metric,
log, heartbeat field). Retries come from the schedule, with jitter, so a fleet that
reconnects together does not arrive at the hub together.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

import psutil
from pydantic import TypeAdapter, ValidationError

from appliance.fleet.certificates import lan_addresses
from appliance.fleet.client import HubClient, HubError, HubRefusedError, Proxy, bootstrap
from appliance.fleet.identity import FleetFiles, HubPeer, Identity
from appliance.fleet.placement import Converger
from appliance.quotas.leases import HeldLease
from shared import __version__, protocol
from shared.provisioning import Provisioning
from shared.wireguard import Endpoint, InterfaceConfig, Peer, Tunnel, WireGuardError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine
    from pathlib import Path

    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    from appliance.fleet.release import Updater
    from appliance.observability.metrics import Metrics
    from appliance.observability.objectives import ObjectiveBook
    from appliance.packages.service import PackageService
    from appliance.quotas.leases import LeaseBook
    from appliance.serving.registry import ModelRegistry
    from appliance.settings import FleetLinkSettings
    from appliance.state.store import AsyncStore
    from shared.backup_schedule import Scheduled

log = logging.getLogger(__name__)

VERSIONS = {"kvl": __version__}
_EVENT: TypeAdapter[protocol.Event] = TypeAdapter(protocol.Event)


async def enroll(
    files: FleetFiles, provisioning: Provisioning, proxy: Proxy | None = None
) -> Identity:
    """Enroll with the hub (once): the WireGuard private key stays here, the public key
    goes to the hub, and the identity it answers is kept for every later start. The
    hub is verified by the CA the provisioning file pins; the node's certificate comes
    back with the answer."""
    existing = files.identity()
    if existing is not None:
        return existing
    hub = provisioning.require_hub()
    keys = files.wireguard_key()
    certificate = files.certificate
    verification = await bootstrap(hub.url, hub.pin(), proxy)
    async with HubClient(hub.url, verification, proxy=proxy) as client:
        addresses = lan_addresses(None)
        csr = certificate.request(provisioning.name, addresses)
        try:
            answer = await client.enroll(provisioning, keys.public_key, VERSIONS, csr)
        except HubRefusedError as err:
            if err.code != "certificate_name_taken":
                raise
            # Another node's certificate names one of this machine's addresses (nodes
            # side by side on one host, say): enroll with the hub's names only.
            log.warning("enrolling without LAN addresses: %s", err)
            certificate.refused |= set(addresses)
            csr = certificate.request(provisioning.name, [])
            answer = await client.enroll(provisioning, keys.public_key, VERSIONS, csr)
    trust = answer.trust or answer.hub.ca_pem
    if answer.lan_certificate:
        certificate.save(answer.lan_certificate, trust)
    else:
        certificate.save_trust(trust.encode())
    identity = Identity(
        node_id=answer.node_id,
        name=answer.name,
        site=answer.site,
        node_token=answer.node_token,
        overlay_address=answer.overlay_address,
        overlay_prefix=answer.overlay_prefix,
        hub=HubPeer.model_validate(answer.hub.model_dump()),
        hub_url=hub.url,
        hub_fingerprint=hub.fingerprint,
    )
    files.save(identity)
    log.info("enrolled with the hub as %s (%s)", identity.name, identity.overlay_address)
    return identity


class FleetLink:
    def __init__(
        self,
        settings: FleetLinkSettings,
        files: FleetFiles,
        store: AsyncStore,
        metrics: Metrics,
        registry: ModelRegistry,
        *,
        on_lag: Callable[[int, bool], None] | None = None,
        leases: LeaseBook | None = None,
        api: dict[str, Any] | None = None,
        models_dir: Path | None = None,
        packages: PackageService | None = None,
        objectives: ObjectiveBook | None = None,
        updater: Updater | None = None,
        on_settings: Callable[[protocol.NodeSettings], None] | None = None,
        backups: Scheduled | None = None,
    ) -> None:
        self._settings = settings
        # The site's HTTPS proxy for the calls to the hub outside the tunnel (enrolling, or
        # every call of a node without one).
        self.proxy = (
            Proxy(settings.https_proxy, tuple(settings.no_proxy))
            if settings.https_proxy is not None
            else None
        )
        self._backups = backups  # its scheduled backups, reported in every heartbeat
        # What the hub sets of this node's settings, and who applies it (the model names,
        # admission's objectives: appliance/app.py).
        self.applied = protocol.NodeSettings()
        self._on_settings = on_settings
        self._objectives = objectives  # the live objectives, sent in every heartbeat
        self._ensuring = asyncio.Lock()
        self._api = api or {}
        # Models the hub places here are fetched into `models_dir` (None: placement off).
        self._converger = (
            Converger(
                store,
                registry,
                models_dir,
                packages,
                failures=metrics.failures,
                evaluate=settings.evaluate_placed,
                peer_wait_s=settings.peer_wait_s,
                trust_file=files.certificate.trust_path,
            )
            if models_dir is not None
            else None
        )
        # The image release the hub gives this node: fetched, installed (None: off).
        self._updater = updater
        self._leases = leases
        self._lease_call: asyncio.Task[None] | None = None
        if leases is not None:
            leases.on_demand = self._lease_now
        self._files = files
        self.certificate = files.certificate
        # Called with each certificate this node is issued (the app starts the fleet
        # listener on the first).
        self.on_certificate: Callable[[], Awaitable[None]] | None = None
        self._store = store
        self._metrics = metrics
        self._registry = registry
        self._on_lag = on_lag  # (events not yet acknowledged, at the bound)
        # Made by start(): a node outside a fleet never starts the link, nor imports
        # apscheduler (about 5 MiB, with tzlocal and its executors).
        self._scheduler: AsyncIOScheduler | None = None
        self._rounds: set[asyncio.Task[Any]] = set()  # the loops' rounds running now
        self._closing = False
        self.identity: Identity | None = files.identity()
        self.error: str | None = None
        self.fleet_port: int | None = None  # where the fleet listener serves the hub
        self.clock: Callable[[], float] = time.time  # when certificates are due
        self._client: HubClient | None = None
        self.tunnel: Tunnel | None = None

    @property
    def hub_url(self) -> str | None:
        """Through the tunnel: the hub's overlay address; without one, the enrolling URL."""
        if self.identity is None:
            return None
        return self.identity.hub.api_url if self._settings.tunnel else self.identity.hub_url

    def start(self) -> None:
        """The link's three loops on the scheduler, each round under the appliance's
        loop guard (a failure is logged, counted in kvl_background_failures_total, and the
        next round comes as scheduled)."""
        from apscheduler.schedulers.asyncio import AsyncIOScheduler  # noqa: PLC0415

        s = self._settings
        self._scheduler = scheduler = AsyncIOScheduler()
        scheduler.add_job(
            self._guarded("fleet.heartbeat", self.tick),
            "interval",
            seconds=s.heartbeat_s,
            jitter=s.heartbeat_s / 5,
            max_instances=1,
            coalesce=True,
            next_run_time=_now_dt(),
        )
        scheduler.add_job(
            self._guarded("fleet.sync", self.sync),
            "interval",
            seconds=s.sync_interval_s,
            jitter=s.sync_interval_s / 2,
            max_instances=1,
            coalesce=True,
        )
        if self._leases is not None:
            scheduler.add_job(
                self._guarded("fleet.leases", self.renew_leases),
                "interval",
                seconds=s.lease_check_s,
                max_instances=1,
                coalesce=True,
            )
        scheduler.start()

    def _guarded(
        self, loop: str, body: Callable[[], Awaitable[object]]
    ) -> Callable[[], Coroutine[Any, Any, None]]:
        async def round_() -> None:
            task = asyncio.current_task()
            if task is not None:
                self._rounds.add(task)
            try:
                with self._metrics.failures.guard(loop):
                    await body()
            except asyncio.CancelledError:
                if not self._closing:
                    raise
                # Stopped with the link (the process stops): the round ends, and the
                # scheduler does not report it as a job that failed.
            finally:
                if task is not None:
                    self._rounds.discard(task)

        return round_

    async def restore_leases(self) -> None:
        """The leases kept before a restart, with what was spent under them since."""
        if self._leases is None:
            return
        kept = await self._store.run(self._store.sync.load_leases)
        self._leases.restore(
            [(HeldLease(**lease, spent=spent), current) for lease, current, spent in kept]
        )

    def _lease_now(self) -> None:
        """A lease ran out or is due: ask the hub now, not at the next check."""
        if self._lease_call is None or self._lease_call.done():
            self._lease_call = asyncio.get_running_loop().create_task(
                self._guarded("fleet.leases", self.renew_leases)()
            )

    async def renew_leases(self) -> None:
        book = self._leases
        if book is None or self.identity is None:
            return
        call = book.call(time.time())
        if not call:
            return
        try:
            client = await self._ensure()
            if client is None:
                return
            answer = await client.leases(list(call.accounts), call.finals)
        except (HubError, HubRefusedError, WireGuardError) as err:
            book.failed(lease_call=True)
            log.warning("quota leases (%d calls failed in a row): %s", book.failures, err)
            return
        book.apply(call, answer, time.time())
        held = [(lease.to_json(), current) for lease, current in book.held()]
        await self._store.run(self._store.sync.save_leases, held)

    async def close(self) -> None:
        self._closing = True
        if self._converger is not None:
            await self._converger.close()
        if self._updater is not None:
            await self._updater.close()
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        rounds = list(self._rounds)  # a heartbeat or a sync in flight: ended before the client
        for task in rounds:
            task.cancel()
        await asyncio.gather(*rounds, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
        if self.tunnel is not None:
            await asyncio.to_thread(self.tunnel.down)

    @property
    def connected(self) -> bool:
        """Enrolled, and the last call to the hub went through."""
        return self.identity is not None and self.error is None and self._client is not None

    async def hub(self) -> HubClient | None:
        """The client for the hub (enrolling and bringing the tunnel up first if needed)."""
        return await self._ensure()

    async def _ensure(self) -> HubClient | None:
        """The client to the hub: enrolled, tunnel up. The heartbeat and the sync call this
        at once at start, so one at a time: a token spent twice, or a second interface of
        the same name, otherwise."""
        async with self._ensuring:
            return await self._ensure_locked()

    async def _ensure_locked(self) -> HubClient | None:
        if self.identity is None:
            path = self._settings.provisioning_file
            if path is None:
                return None
            provisioning = Provisioning.load(path)
            if provisioning.hub is None:
                return None  # a site without a hub: nobody to enroll with
            try:
                self.identity = await enroll(self._files, provisioning, self.proxy)
            except HubRefusedError as err:
                self.error = str(err)
                log.error("enrollment refused: %s", err)  # noqa: TRY400 - no traceback
                return None
        if self._settings.tunnel and self.tunnel is None:
            self.tunnel = await asyncio.to_thread(self._tunnel_up, self.identity)
        if self.on_certificate is not None:
            await self.on_certificate()  # the fleet listener, on the tunnel's address
        if self._client is None:
            url = self.hub_url
            if url is None:  # pragma: no cover - the identity is set above
                return None
            # Through the tunnel, the node's own link to its hub, nothing is proxied.
            proxy = None if self._settings.tunnel else self.proxy
            self._client = HubClient.for_node(self.identity, url, self.certificate, proxy)
        return self._client

    def _tunnel_up(self, identity: Identity) -> Tunnel:
        """This node's WireGuard interface, with the hub as its one peer (keepalive, so the
        hub can reach a node behind NAT)."""
        network = ipaddress.ip_network(identity.overlay_prefix)
        hub = Peer(
            identity.hub.wg_public_key,
            (network,),
            resolve_endpoint(identity.hub.endpoint),
            persistent_keepalive_s=25,
        )
        config = InterfaceConfig(
            self._settings.interface,
            self._files.wireguard_key().private_key,
            (ipaddress.ip_interface(f"{identity.overlay_address}/{network.prefixlen}"),),
            peers=(hub,),
        )
        # The interface is this node's: one its last run left (a crash, a kill) is taken over,
        # or the node could never reach its hub again until a reboot.
        tunnel = Tunnel(config).up(take_over=True)
        log.info("WireGuard %s up: %s", tunnel.name, identity.overlay_address)
        return tunnel

    async def apply_settings(self) -> None:
        """What the hub sets of this node's settings, as the store keeps them from the last
        desired state (at start too, the hub reachable or not), applied."""
        if self._on_settings is None:
            return
        raw = await self._store.run(self._store.sync.meta, "desired_settings")
        if raw is None:
            return
        try:
            given = protocol.NodeSettings.model_validate_json(raw)
        except ValidationError as err:  # checked when it arrived; kept as it was
            log.warning("the hub's settings are not ones this node reads: %s", err)
            return
        if given != self.applied:
            self._on_settings(given)
            self.applied = given
            log.info("the hub's settings applied: %s", given.model_dump(exclude_defaults=True))

    def fetching(self, sha256: str) -> bool:
        """Whether this node is fetching that file now (a peer asking for it waits)."""
        return self._converger is not None and sha256 in self._converger.fetching

    def peer_addresses(self) -> list[str]:
        """Where the other nodes of this site reach this node's LAN API (`fleet.peer_addresses`,
        or its interfaces' addresses but loopback, link-local and the tunnel's)."""
        if self._settings.peer_addresses is not None:
            return self._settings.peer_addresses
        overlay = self.identity.overlay_address if self.identity is not None else None
        found: list[str] = []
        for name, addresses in psutil.net_if_addrs().items():
            if name == self._settings.interface:
                continue
            for address in addresses:
                text = address.address.split("%")[0]
                try:
                    ip = ipaddress.ip_address(text)
                except ValueError:
                    continue  # a link-layer address
                if ip.is_loopback or ip.is_link_local or ip.is_multicast or text == overlay:
                    continue
                found.append(str(ip))
        return found[:8]

    async def tick(self) -> None:
        """One heartbeat (enrolling first if this node has not yet)."""
        await self.apply_settings()
        try:
            client = await self._ensure()
            if client is None:
                return
            objectives = await self.objectives()
            answer = await client.heartbeat(VERSIONS, await self.capacity(), objectives)
            applied = int(await self._store.run(self._store.sync.meta, "desired_serial") or -1)
            # The answer names the hub's serial: the state is pulled only when it moved.
            state = None if answer.desired_serial <= applied else await client.state(applied)
            if state is not None:
                serial = await self._store.run(self._store.sync.apply_desired_state, state)
                log.info("applied the hub's desired state %d", serial)
                await self.apply_settings()
            # Before the certificate's upkeep, which may fail on its own (a renewal the hub
            # does not answer in time): the models and the release converge regardless.
            if self._converger is not None:
                self._converger.kick(client)  # also retries what failed the last time
            if self._updater is not None:
                self._updater.kick(client)
            await self._keep_certificate(client, answer)
        except (HubError, HubRefusedError, WireGuardError) as err:
            self.error = str(err)
            log.warning("heartbeat failed: %s", err)
            if self._leases is not None:
                self._leases.failed()
            return
        self.error = None
        if self._leases is not None:
            self._leases.reachable = True
        await self._store.run(self._store.sync.set_meta, "last_heartbeat_at", str(time.time()))

    async def _keep_certificate(self, client: HubClient, answer: protocol.HeartbeatAnswer) -> None:
        """The trust bundle the hub names, and this node's certificate renewed when due
        (a third of its lifetime left, new LAN addresses, or the hub says so)."""
        certificate = self.certificate
        if answer.trust_digest and answer.trust_digest != certificate.trust_digest():
            trust = await client.trust()
            certificate.save_trust(trust.bundle.encode())
            log.info("keeping the hub's CA bundle %s", trust.digest)
        addresses = [a for a in self.addresses() if a not in certificate.refused]
        why = (
            "the hub says it is due"
            if answer.renew_certificate
            else certificate.due(self.clock(), addresses)
        )
        if why is not None:
            await self.renew_certificate(client, addresses, why)

    def addresses(self) -> list[str]:
        """This machine's LAN addresses, for its certificate."""
        overlay = ipaddress.ip_network(self.identity.overlay_prefix) if self.identity else None
        return lan_addresses(overlay)

    async def renew_certificate(self, client: HubClient, addresses: list[str], why: str) -> None:
        """A new key, and the hub's certificate for it (HubRefusedError when the hub
        refuses: a revoked node, say, whose last certificate then runs out)."""
        assert self.identity is not None  # noqa: S101 - a client exists
        name = self.identity.name
        try:
            answer = await client.certificate(self.certificate.request(name, addresses))
        except HubRefusedError as err:
            if err.code != "certificate_name_taken":
                raise
            log.warning("renewing without LAN addresses: %s", err)
            self.certificate.refused |= set(addresses)
            answer = await client.certificate(self.certificate.request(name, []))
        self.certificate.save(answer.certificate, answer.trust)
        log.info("renewed this node's certificate (%s); valid until %s", why, answer.not_after)
        if self.on_certificate is not None:
            await self.on_certificate()

    async def objectives(self) -> protocol.Objectives | None:
        """The live objectives as the next heartbeat sends them, stored first (one
        transaction): the hub is never told a count that a restart would not resume from,
        so within an epoch this node never reports a value lower than one it reported
        before. Nothing is lost while the hub is away: the counters are cumulative, and the
        next heartbeat that goes through carries everything."""
        book = self._objectives
        if book is None:
            return None
        # Both at once on the loop (no await between): what is stored is what is sent.
        series = book.snapshot()
        rows = book.take_dirty()
        try:
            epoch, restarts = await self._store.run(self._store.sync.save_objectives, rows)
        except BaseException:
            book.mark_dirty(rows)
            raise
        return protocol.Objectives(
            epoch=epoch,
            series=series,
            objectives_s=book.objectives_s(),  # type: ignore[arg-type]
            worker_restarts=restarts,
        )

    async def capacity(self) -> protocol.Capacity:
        memory = psutil.virtual_memory()
        lag = await self._store.run(self._store.sync.outbox_lag)
        self._metrics.outbox_lag.set(lag)
        alarm = lag >= self._settings.outbox_alarm_events
        if self._on_lag is not None:
            self._on_lag(lag, lag >= self._settings.outbox_limit_events)
        if alarm:
            log.warning("the outbox holds %d events not yet synced to the hub", lag)
        errors = self._converger.errors if self._converger else {}
        book = self._leases
        lapsed = len(book.lapsed(time.time())) if book is not None else 0
        return protocol.Capacity(
            cpu_percent=min(100.0, max(0.0, psutil.cpu_percent(None))),
            cpu_count=psutil.cpu_count() or 1,
            memory_total_mib=memory.total >> 20,
            memory_available_mib=min(memory.available, memory.total) >> 20,
            # One entry per model (a model with several replicas is one ref).
            models=list(dict.fromkeys(r.ref for r in self._registry.served()))[:64],
            model_memory_mib=int(getattr(self._registry, "budget_mb", 0)),
            placement_errors={k[:200]: v[:2000] for k, v in list(errors.items())[:64]},
            gpus=self.gpus()[:16],
            queue_waiting=sum(d.waiting for d in self._registry.loaded_models()),
            outbox_lag=lag,
            outbox_alarm=alarm,
            # Where the hub reaches this node's LAN API (at the address heartbeats come
            # from), for requests other nodes offload (with their clients' keys).
            api=(
                protocol.LanApi(
                    **self._api, fleet_port=self.fleet_port, addresses=self.peer_addresses()
                )
                if self._api
                else None
            ),
            offload=bool(self._api),
            trust_digest=self.certificate.trust_digest(),
            # The isolation each model runs at, as the registry read it back.
            isolation_max=self._registry.isolation_max.value,
            isolation={
                k[:200]: v.value for k, v in list(self._registry.isolation_levels().items())[:64]
            },
            # Lease trouble, for the hub's `lease_lapsed` alert (bounded as the wire is).
            leases_lapsed=min(lapsed, protocol.COUNT_MAX),
            lease_failures=min(book.failures if book is not None else 0, protocol.COUNT_MAX),
            # The image this node runs and its last update (protocol 6), or why it refuses
            # the release the hub gives it.
            image=self._updater.image if self._updater is not None else None,
            release_error=self._updater.release_error if self._updater is not None else None,
            # The hub's settings this node applies (protocol 7), for a settings rollout.
            settings_digest=self.applied.digest() if self._on_settings is not None else None,
            # Its scheduled backups (protocol 9), for the hub's console and its alert.
            backup=self._backups.report() if self._backups is not None else None,
            # Each placed model's short evaluation (protocol 7), for the hub's quality gate.
            evaluations=dict(list(self._converger.evaluations.items())[:64])
            if self._converger is not None
            else {},
        )

    def gpus(self) -> list[protocol.Gpu]:
        """The GPUs the model workers see (ggml's device list, as of their last report):
        name, hardware, memory total and free. Empty on a CPU-only node."""
        seen: dict[str, protocol.Gpu] = {}
        for replica in self._registry.replicas():
            if replica.layout is None:
                continue
            for device in replica.layout.devices:
                if device.kind in {"gpu", "igpu"}:
                    total = max(0, device.memory_total_mib)
                    seen[device.name] = protocol.Gpu(
                        name=device.name[:200],
                        description=device.description[:200],
                        memory_total_mib=total,
                        memory_free_mib=min(total, max(0, device.memory_free_mib)),
                    )
        return list(seen.values())

    async def sync(self) -> int:
        """Send the outbox in batches, usage events first, then the other events (packages
        made or removed here), until it is empty or the hub is unreachable; the number of
        events the hub acknowledged."""
        sent = 0
        try:
            client = await self._ensure()
            if client is None:
                return 0
            sent += await self._drain(client, self._usage_batch, self._store.sync.acknowledge)
            sent += await self._drain(
                client, self._events_batch, self._store.sync.acknowledge_events
            )
        except (HubError, HubRefusedError, WireGuardError) as err:
            self.error = str(err)
            log.warning("sync stopped: %s", err)
        else:
            await self._store.run(self._store.sync.set_meta, "last_sync_at", str(time.time()))
        return sent

    async def _usage_batch(self) -> list[tuple[int, protocol.Event]]:
        batch = await self._store.run(self._store.sync.outbox, self._settings.sync_batch)
        # vars(), not dataclasses.asdict(): the fields are flat, and asdict's deep copy was
        # most of a sync's time. model_construct: the store wrote these rows itself.
        return [
            (
                rowid,
                protocol.UsageEvent.model_construct(
                    id=event.id,
                    kind="usage",
                    body=protocol.UsageBody.model_construct(**vars(event), account=account),
                ),
            )
            for rowid, event, account in batch
        ]

    async def _events_batch(self) -> list[tuple[int, protocol.Event]]:
        batch = await self._store.run(self._store.sync.events_outbox, self._settings.sync_batch)
        return [(rowid, _EVENT.validate_python(event)) for rowid, event in batch]

    async def _drain(
        self,
        client: HubClient,
        batch: Callable[[], Awaitable[list[tuple[int, protocol.Event]]]],
        acknowledge: Callable[[int], None],
    ) -> int:
        """Push one stream of the outbox until it is empty; the checkpoint moves past the
        acknowledged run only, in order."""
        sent = 0
        while events := await batch():
            acknowledged = set(await client.push([e for _, e in events]))
            last = 0
            for rowid, event in events:
                if event.id not in acknowledged:
                    break
                last = rowid
            if last == 0:
                break
            await self._store.run(acknowledge, last)
            if self._on_lag is not None:
                lag = await self._store.run(self._store.sync.outbox_lag)
                self._on_lag(lag, lag >= self._settings.outbox_limit_events)
            sent += len(acknowledged)
            self._metrics.outbox_synced.inc(len(acknowledged))
        return sent


def resolve_endpoint(text: str) -> Endpoint:
    """`host:port` as an address WireGuard can use (a name is resolved now)."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        host = str(socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0][4][0])
    return Endpoint(ipaddress.ip_address(host), int(port))


def _now_dt() -> Any:
    import datetime  # noqa: PLC0415

    return datetime.datetime.now(datetime.UTC)
