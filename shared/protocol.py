"""The appliance ↔ hub protocol: every message between a node and the hub, typed and
bounded. Both sides import this module and nothing else to read or write the wire.

A node is untrusted. Every number a node sends is finite, non-negative and bounded, every
list and map has a length cap, every string a length cap; a message outside these bounds
is refused whole (4xx in the error shape) and changes nothing. The JSON Schema of every
message is kept in `tests/shared/protocol_schema.json` (a test compares): a change to the
wire shows in review.

Versions. A node names its protocol version in the `Kvl-Protocol` header of every call,
and the hub answers with its own. The hub serves nodes from `OLDEST_NODE_PROTOCOL` to
`PROTOCOL_VERSION`, so a fleet is upgraded hub first, then node by node; a node outside
the window gets 400 `protocol_unsupported` saying which side to upgrade. Version 2 is
the first versioned protocol (version 1, unversioned, sent capacity as a free map and
authenticated offloaded requests with a per-node secret); from version 3 on, the hub
keeps serving the version before its own. A field a version added names it in
`ADDED_IN`; the hub leaves such fields out of what it answers an older node, whose
models refuse fields they do not know. The hub lists each node with the version its last
heartbeat named (`versions["protocol"]`), and `tests/test_mixed_versions.py` runs today's
hub with a real node of today's code beside one of the previous version's commit.

Version 3 is mutual TLS: a node presents its certificate (issued at enrollment, renewed
through `POST /v1/node/certificate`) on every call, and trusts the hub through its CA
bundle (`GET /v1/trust`) instead of pinning the hub's certificate. A node the hub has
issued a certificate must present one whatever version it names; a version-2 node,
enrolled before certificates, is served on its node token until it upgrades.

Version 4 adds live objectives to heartbeats (`Objectives`): what the node measured of its
service classes' objectives, per class and account, as cumulative counters and histogram
buckets. Cumulative, so a heartbeat lost in a partition loses nothing and one resent counts
nothing twice: the hub takes the difference from the last one it saw of the same `epoch`.

Version 5 adds lease trouble to `Capacity`: `leases_lapsed`, the accounts a node serves
without a live quota lease because its lease calls fail (it serves them on their class's
safe capacity, or refuses them), and `lease_failures`, its lease calls that failed in a
row; the hub's `lease_lapsed` alert reads them. A version-4 node never sends them, and the
hub reads their defaults (none). A version-5 node that calls a version-4 hub is refused
whole (400 `protocol_unsupported`, "upgrade the hub": a fleet is upgraded hub first), so
the fields never reach a hub whose models would refuse them, and a node need not leave
them out (it does not read the hub's version).

Version 6 adds image releases. `DesiredState.release` names the image release the node
should run (version, sha256, size; and the update window of its site), which a node
fetches through the tunnel (`GET /v1/node/artifacts/SHA256`, resumable, digest checked)
and installs; `Capacity.image` reports the image the node runs (version, booted slot) and
how its last update went, and `Capacity.release_error` why a node refuses a release
target (no updater on it). The hub's staged rollouts (hub/rollouts.py) read them. An
older node never gets `release` (the hub leaves it out), so a rollout counts it as one
that cannot take the release.

Version 7 adds models' presets (`PlacedModel.preset`: context, slots, KV cache type,
sampling, names), the node's evaluation of each placed model (`Capacity.evaluations`),
and the part of a node's settings the hub sets (`DesiredState.settings`, and
`Capacity.settings_digest` once the node applied them). Version 8 adds the content
packages' settings to those (`NodeSettings.packages`) and the objectives' allowances per
token (`ClassTargets.first_token_per_token_s`, `complete_per_token_s`); the hub gives an
older node only the settings it takes, and expects its digest of those.

Version 9 adds the node's scheduled backups to `Capacity` (`backup`: its schedule, the last
good backup, the last failure, and when the next one is overdue); the hub's console shows
them and its `backup_overdue` alert reads them. An older node never sends it: the hub reads
no schedule. It adds the site's update window to `DesiredState` (`window`): model files
wait for it as releases do; an older node is not given it, and fetches them at once.

Version 10 lets the nodes of a site share model files, so the site's WAN link carries each
once: a node reports the addresses its site reaches its LAN API at (`LanApi.addresses`),
and each `PlacedModel` names the other nodes of the site placed the same model (`peers`,
the one that fetches it from the hub first marked) with the hub's `ticket` for the file
(shared/peer_tickets.py). An older node is given neither and fetches from the hub.

Version 11 adds the content packages' answer verification to the settings the hub sets
(`PackageOverrides.check_model`, `verify_samples`, `source_min_similarity`): a stronger
model placed on a node can check the items its own writing model writes. An older node is
given none of them (it verifies no answer).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from typing import Annotated, Any, Literal, Self, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    model_validator,
)

from shared import jsonlimits

PROTOCOL_VERSION = 11
OLDEST_NODE_PROTOCOL = 2
PROTOCOL_HEADER = "Kvl-Protocol"

# Offload (hub/offload.py, appliance/gateway/offload.py): the client's own API key travels
# with the request, so the node that serves it derives account and class from the key it
# holds the hash of; no node can name another account.
CLIENT_KEY_HEADER = "X-Kvl-Client-Key"
ORIGIN_HEADER = "X-Kvl-Origin"  # the node the request came from (informational)
OFFLOADED_HEADER = "X-Kvl-Offloaded"  # set on a request offloaded once: never again
# W3C Trace Context headers an offloaded request carries on, hop to hop: one trace.
TRACE_HEADERS = ("traceparent", "tracestate")
SERVED_BY_HEADER = "X-Kvl-Served-By"

MAX_EVENTS = 5000  # events in one sync call
MAX_LEASE_ACCOUNTS = 10_000
LINEAGE_DEPTH = 8

# Bounded scalars. The bounds are far above any real node and far below what overflows
# a 64-bit column or a float conversion.
COUNT_MAX = 1_000_000_000
Count = Annotated[int, Field(ge=0, le=COUNT_MAX)]
Tokens = Annotated[int, Field(ge=0, le=100_000_000)]  # one request, or one lease
Mib = Annotated[int, Field(ge=0, le=1 << 30)]  # up to a pebibyte
Seconds = Annotated[float, Field(ge=0, le=1e10)]  # unix time, or a duration
Millis = Annotated[float, Field(ge=0, le=1e9)]
Percent = Annotated[float, Field(ge=0, le=100)]


def _text(value: str) -> str:
    """Text a database can keep: no NUL (PostgreSQL's text refuses it) and no lone UTF-16
    surrogate (not Unicode, so not UTF-8 either)."""
    if "\x00" in value:
        raise ValueError("a string holds a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError("a string holds a lone UTF-16 surrogate") from err
    return value


Clean = AfterValidator(_text)
Name = Annotated[str, StringConstraints(min_length=1, max_length=200), Clean]
Short = Annotated[str, StringConstraints(max_length=200), Clean]
Text = Annotated[str, StringConstraints(max_length=2000), Clean]
Id = Annotated[str, StringConstraints(min_length=1, max_length=100), Clean]
Blob = Annotated[str, StringConstraints(max_length=20_000), Clean]  # a PEM, a CSR
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# What inet_aton reads as an IPv4 address without a dot: a number, decimal, octal or hex.
_NUMBER = re.compile(r"[0-9]+|0x[0-9a-f]*")


def node_name(value: str) -> str:
    """A node's name, as the hub gives it out: one DNS label (RFC 1123), lowercase. The
    node's certificate names it, `NAME.local` and `NAME.DOMAIN`, so a dot would let a
    node name another's domain or the hub's, and a label that is only a number reads as
    an IPv4 address to many resolvers (inet_aton). Names compare case-insensitively, as
    DNS does: `HONEST-B` is `honest-b`. ValueError names the rule."""
    lowered = value.lower()
    if not _LABEL.fullmatch(lowered) or _NUMBER.fullmatch(lowered):
        raise ValueError(
            f"{value[:80]!r} is not a node name: one DNS label (letters, digits and "
            "inner hyphens, 1 to 63 of them, not a number), no dots"
        )
    return lowered


NodeName = Annotated[str, StringConstraints(max_length=63), AfterValidator(node_name)]
WgKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=$")]
Labels = Annotated[
    dict[Annotated[str, StringConstraints(max_length=63), Clean], Short], Field(max_length=32)
]
Versions = Annotated[
    dict[Annotated[str, StringConstraints(max_length=40), Clean], Short], Field(max_length=32)
]


class Message(BaseModel):
    """A protocol message: unknown fields, NaN and infinities refused; immutable."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


# -- enrollment ----------------------------------------------------------------------------


class EnrollRequest(Message):
    token: Name
    name: NodeName
    wg_public_key: WgKey
    labels: Labels = Field(default_factory=dict)
    versions: Versions = Field(default_factory=dict)
    # A signing request for the node's certificate (its LAN API, and its side of mutual
    # TLS); the key stays on the node, the hub decides the names (hub/certificates.py).
    lan_csr: Blob | None = None


class HubPeer(Message):
    """The hub as a node's WireGuard peer and API."""

    wg_public_key: WgKey
    overlay_address: Short
    endpoint: Short  # host:port of its WireGuard listener
    api_url: Short  # its API through the tunnel
    ca_pem: Blob


class EnrollAnswer(Message):
    node_id: Id
    node_token: Short
    name: NodeName
    site: Short
    overlay_address: Short
    overlay_prefix: Short
    lan_certificate: Blob | None = None  # the node's certificate
    hub: HubPeer
    trust: Blob | None = None  # the CA bundle (protocol 3)
    renew_at: Seconds | None = None  # when to renew the certificate (protocol 3)


# -- heartbeats ----------------------------------------------------------------------------


class Gpu(Message):
    name: Short
    description: Short = ""
    memory_total_mib: Mib = 0
    memory_free_mib: Mib | None = None


def unicast(value: str) -> str:
    """A node's own address, where the other nodes of its site reach it: one host, not a
    multicast, unspecified or link-local one (loopback stays: a fleet on one machine)."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError as err:
        raise ValueError(f"{value[:60]!r} is not an IP address") from err
    if address.is_multicast or address.is_unspecified or address.is_link_local:
        raise ValueError(f"{address} is not an address another node can reach")
    return str(address)


Unicast = Annotated[str, StringConstraints(max_length=45), AfterValidator(unicast)]


class LanApi(Message):
    """Where the hub reaches a node's API (at the address its heartbeats come from): its
    LAN API, and (protocol 3) its fleet listener, where the node serves the hub's calls
    over mutual TLS only; (protocol 10) the addresses the other nodes of its site reach its
    LAN API at, to fetch a model file it holds."""

    port: int = Field(ge=1, le=65535)
    tls: bool = False
    fleet_port: int | None = Field(None, ge=1, le=65535)
    addresses: list[Unicast] = Field(default_factory=list, max_length=8)


# How a node's last image update went (appliance/update/): fetching the bundle, installing
# it into the other slot, installed and waiting for a reboot, booted into it on trial
# (not yet marked good), marked good; rolled back (the bootloader or the health check
# went back to the previous slot), or failed before a reboot.
ImageState = Literal[
    "idle", "downloading", "installing", "installed-pending-reboot", "booted-trial", "good",
    "rolled-back", "failed",
]  # fmt: skip


class ImageStatus(Message):
    """The image a node runs, and how its last update went (protocol 6)."""

    version: Short  # the running image's version ("" when the image does not say)
    slot: Short = ""  # the booted slot, as the updater names it (`rootfs.0`)
    state: ImageState = "idle"
    target: Short | None = None  # the release the last update was for
    error: Text | None = None  # why it failed or rolled back


class Evaluation(Message):
    """A placed model's short evaluation on the node that loaded it (protocol 7): of the
    fixed instructions (appliance/serving/evaluation.py), how many it followed and how many
    it answered on topic; how long it took to load, what its workers hold, how long the
    evaluation took."""

    followed: int = Field(ge=0, le=1000)
    on_topic: int = Field(ge=0, le=1000)
    total: int = Field(ge=1, le=1000)
    load_s: Seconds = 0.0
    memory_mib: Mib = 0
    eval_s: Seconds = 0.0

    @model_validator(mode="after")
    def _counted(self) -> Self:
        if max(self.followed, self.on_topic) > self.total:
            raise ValueError("more instructions followed than there are")
        return self


class BackupReport(Message):
    """How a node's scheduled backups go (protocol 9; shared/backup_schedule.py): the hub's
    `backup_overdue` alert fires past `overdue_at`, and its console shows the last good one."""

    schedule: Short  # the crontab line
    timezone: Short = "UTC"
    kept: Count = 0  # backups in its folder
    last_good_at: Seconds | None = None  # when the newest was taken
    last_size: int = Field(0, ge=0, le=1 << 53)  # its bytes
    last_error: Text | None = None  # why the last run failed, until one succeeds
    last_failed_at: Seconds | None = None
    # When the scheduled run after the last good backup (or after the schedule started)
    # should have ended.
    overdue_at: Seconds


class Capacity(Message):
    """What a node has and how loaded it is, as it reports in each heartbeat. None of it
    can make a node look better than empty: no negative load, no more free memory than
    it has."""

    cpu_percent: Percent = 0.0
    cpu_count: int = Field(1, ge=1, le=4096)
    memory_total_mib: Mib = 0
    memory_available_mib: Mib = 0
    models: list[Name] = Field(default_factory=list, max_length=64)  # name@version served
    model_memory_mib: Mib = 0  # the models' memory budget (0: the hub assumes 3/4 of RAM)
    placement_errors: dict[Name, Text] = Field(default_factory=dict, max_length=64)
    gpus: list[Gpu] = Field(default_factory=list, max_length=16)
    queue_waiting: Count = 0
    outbox_lag: Count = 0
    outbox_alarm: bool = False
    api: LanApi | None = None
    # The node takes offloaded requests on /v1/offloaded/… with the client's own key.
    offload: bool = False
    # The digest of the CA bundle the node trusts the hub by (protocol 3): a CA rotation
    # switches only once every node holds the staged CA (`kvl hub ca rotate`).
    trust_digest: Short | None = None
    # The highest isolation level the node can run a replica at (I2: it can give a
    # worker a cgroup v2 with memory.max and cpu.max; I3 is I2 on a node the hub knows is
    # dedicated), and the level each model it serves runs at now, as it checked it (a
    # worker's cgroup, read back): shared.classes.IsolationLevel.
    isolation_max: Literal["I1", "I2", "I3"] = "I1"
    isolation: dict[Name, Literal["I1", "I2", "I3"]] = Field(default_factory=dict, max_length=64)
    # Lease trouble (protocol 5): the accounts served without a live quota lease since the
    # last lease call failed (on their class's safe capacity, or refused), and how many
    # lease calls have failed in a row (appliance/quotas/leases.py). 0 once a call succeeds.
    leases_lapsed: Count = 0
    lease_failures: Count = 0
    # The image this node runs and its last update (protocol 6); None where the node has
    # no updater (a development machine), which then names why in `release_error` when the
    # hub gives it a release.
    image: ImageStatus | None = None
    release_error: Text | None = None
    # Each placed model's short evaluation, once it ran (protocol 7).
    evaluations: dict[Name, Evaluation] = Field(default_factory=dict, max_length=64)
    # The digest of the hub's settings the node applied (protocol 7: NodeSettings.digest).
    settings_digest: Short | None = None
    # Its scheduled backups, when it has a schedule (protocol 9).
    backup: BackupReport | None = None

    @model_validator(mode="after")
    def _within_itself(self) -> Self:
        if self.memory_available_mib > self.memory_total_mib:
            raise ValueError("memory_available_mib is more than memory_total_mib")
        for gpu in self.gpus:
            if gpu.memory_free_mib is not None and gpu.memory_free_mib > gpu.memory_total_mib:
                raise ValueError(f"GPU {gpu.name}: memory_free_mib is more than its total")
        if len(set(self.models)) != len(self.models):
            raise ValueError("models lists a model twice")
        return self


# -- live objectives (protocol 4) -------------------------------------------------------------

# The bounds (seconds) of the latency histograms a node sends: fixed by the protocol, so the
# hub adds up any nodes' buckets. They include the default objectives of every class.
LATENCY_BOUNDS_S: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    900.0, 1800.0, 3600.0,
)  # fmt: skip
ServiceClassName = Literal["S0", "S1", "S2", "S3", "S4"]
# The objectives of a class (docs/api.md "Service classes"): SLO.A admit, SLO.B first token,
# SLO.C complete.
Objective = Literal["admit", "first_token", "complete"]
OBJECTIVES: tuple[Objective, ...] = ("admit", "first_token", "complete")
# Why a request that reached admission was not served:
# - admit, first_token: refused at the door, the prediction said it would miss that objective;
# - shed: dropped from the queue once it had missed its first-token objective;
# - outbox: the usage outbox was full (the node waits for the hub);
# - error: the node failed it (a 5xx: a worker crash, an engine error);
# - quota: an account quota or budget refused it: the account's limit, not the service's
#   failure, so neither met nor missed.
Refusal = Literal["admit", "first_token", "shed", "outbox", "error", "quota"]
REFUSALS: tuple[Refusal, ...] = ("admit", "first_token", "shed", "outbox", "error", "quota")
MAX_OBJECTIVE_SERIES = 256  # (class, account) pairs in one heartbeat
Total = Annotated[int, Field(ge=0, le=1 << 53)]  # a cumulative counter (exact in a double)
SecondsSum = Annotated[float, Field(ge=0, le=1e15)]


class LatencyHistogram(Message):
    """Observations per bucket of `LATENCY_BOUNDS_S` (not cumulative: `counts[i]` are those
    at most `LATENCY_BOUNDS_S[i]` and above the bound before; the last, those above the
    last bound), and their sum in seconds. Cumulative over the node's epoch."""

    counts: list[Total] = Field(
        default_factory=lambda: [0] * (len(LATENCY_BOUNDS_S) + 1),
        min_length=len(LATENCY_BOUNDS_S) + 1,
        max_length=len(LATENCY_BOUNDS_S) + 1,
    )
    sum_s: SecondsSum = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


class ObjectiveSeries(Message):
    """One service class and account on one node, counted since the epoch began.

    `requests` reached admission (authenticated, with a model to serve them); each ends
    `admitted` or in `refused` under one reason, so `admitted + sum(refused) == requests`
    once none is at the door. Each objective counts the requests it applies to as `met` or
    `missed`: a request served is measured against the class's objective in seconds (a
    request its client cancelled counts for `complete` neither way); one refused for any
    reason but `quota` misses all three; a `quota` refusal counts for none."""

    service_class: ServiceClassName
    account: Name
    requests: Total = 0
    admitted: Total = 0
    refused: dict[Refusal, Total] = Field(default_factory=dict)
    met: dict[Objective, Total] = Field(default_factory=dict)
    missed: dict[Objective, Total] = Field(default_factory=dict)
    ttft: LatencyHistogram = Field(default_factory=LatencyHistogram)
    completion: LatencyHistogram = Field(default_factory=LatencyHistogram)

    @model_validator(mode="after")
    def _within_itself(self) -> Self:
        if self.admitted + sum(self.refused.values()) > self.requests:
            raise ValueError("more requests admitted and refused than reached admission")
        for objective in OBJECTIVES:
            if self.met.get(objective, 0) + self.missed.get(objective, 0) > self.requests:
                raise ValueError(f"{objective}: more met and missed than requests")
        if self.ttft.count > self.admitted or self.completion.count > self.admitted:
            raise ValueError("more latencies observed than requests admitted")
        return self


class Objectives(Message):
    """What a node measured of its objectives, cumulative since `epoch` began. The epoch is
    the counters' generation, kept in the node's database: it changes only when the
    counters start again from zero (a new database), and then the hub counts the new
    epoch's values whole. Within an epoch a node never reports a counter lower than
    before (it stores its counters before it sends them)."""

    epoch: Id
    series: list[ObjectiveSeries] = Field(default_factory=list, max_length=MAX_OBJECTIVE_SERIES)
    # The node's objectives in seconds, per class (what `met` and `missed` were measured
    # against).
    objectives_s: dict[ServiceClassName, dict[Objective, Seconds]] = Field(default_factory=dict)
    worker_restarts: Total = 0  # model workers restarted (any cause)

    @model_validator(mode="after")
    def _unique(self) -> Self:
        keys = [(s.service_class, s.account) for s in self.series]
        if len(set(keys)) != len(keys):
            raise ValueError("a (service_class, account) series appears twice")
        return self


class HeartbeatRequest(Message):
    versions: Versions = Field(default_factory=dict)
    capacity: Capacity = Field(default_factory=Capacity)
    objectives: Objectives | None = None  # protocol 4


class HeartbeatAnswer(Message):
    node_id: Id
    received_at: Seconds
    # The hub's desired-state serial: a node pulls its state only when it moved.
    desired_serial: int = Field(ge=0)
    # The digest of the hub's CA bundle: a node fetches the bundle (`GET /v1/trust`) when
    # it changed (a CA rotation). Protocol 3.
    trust_digest: Short | None = None
    # The node's certificate is due: signed by a CA that signs no more, or not presented.
    renew_certificate: bool = False


# -- certificates (protocol 3) ---------------------------------------------------------------


class CertificateRequest(Message):
    """A node asks for its certificate again (before a third of its lifetime is left, or
    when its LAN addresses changed): a new key's signing request."""

    csr: Blob


class CertificateAnswer(Message):
    certificate: Blob
    trust: Blob  # the CA bundle the hub trusts now
    renew_at: Seconds
    not_after: Seconds


class TrustAnswer(Message):
    """The fleet's CA bundle (public: certificates only), with its digest."""

    bundle: Blob
    digest: Short


# -- events (the outbox) ---------------------------------------------------------------------


class UsageBody(Message):
    """One served request, as the node recorded it before answering its client."""

    account: Name  # the hub knows accounts by name
    account_id: int = Field(0, ge=0, le=1 << 62)  # the node's own row id (kept as sent)
    key_prefix: Short = ""
    route: Short = ""
    model: Short = ""
    tokens_in: Tokens = 0
    tokens_out: Tokens = 0
    ttft_ms: Millis | None = None
    duration_ms: Millis = 0.0
    status: int = Field(200, ge=100, le=599)
    finish_reason: Short | None = None
    id: Short = ""
    created_at: Short = ""  # ISO 8601, when it was served
    lease_id: Id | None = None  # the quota lease it was charged to


class PackageBody(Message):
    """A content package this node now holds (made here, or seeded)."""

    object: Literal["package"] = "package"
    id: Id
    version: Id
    title: Text
    topic: Text
    level: Short
    items: Count
    created_at: Short
    size: Count
    pinned: bool = False
    digest: Short
    # What made it (model, voice, template, seed); kept as the node says, depth-bounded
    # by the JSON reader (`shared.jsonlimits`).
    lineage: dict[Short, Any] = Field(default_factory=dict, max_length=32)
    origin: Short = ""

    @model_validator(mode="after")
    def _shallow(self) -> Self:
        if jsonlimits.depth(self.lineage, LINEAGE_DEPTH) > LINEAGE_DEPTH:
            raise ValueError(f"lineage nests deeper than {LINEAGE_DEPTH} levels")
        return self


class PackageRef(Message):
    id: Id
    version: Id


class UsageEvent(Message):
    id: Id
    kind: Literal["usage"]
    body: UsageBody


class PackageEvent(Message):
    id: Id
    kind: Literal["package"]
    body: PackageBody


class PackageRemovedEvent(Message):
    id: Id
    kind: Literal["package_removed"]
    body: PackageRef


Event = Annotated[UsageEvent | PackageEvent | PackageRemovedEvent, Field(discriminator="kind")]


class EventsRequest(Message):
    events: list[Event] = Field(max_length=MAX_EVENTS)

    @model_validator(mode="after")
    def _unique(self) -> Self:
        if len({e.id for e in self.events}) != len(self.events):
            raise ValueError("an event id appears twice in the batch")
        return self


class EventsAnswer(Message):
    acknowledged: list[Id]  # every id, duplicates of earlier batches too
    new: Count  # how many were new to the ledger


# -- quota leases ----------------------------------------------------------------------------


class LeaseRequest(Message):
    # The accounts the node wants a new lease for (those it serves that have a budget).
    accounts: list[Name] = Field(default_factory=list, max_length=MAX_LEASE_ACCOUNTS)
    # Leases the node retired and will never spend again: their final spend.
    finals: dict[Id, Tokens] = Field(default_factory=dict, max_length=MAX_LEASE_ACCOUNTS)

    @model_validator(mode="after")
    def _unique(self) -> Self:
        if len(set(self.accounts)) != len(self.accounts):
            raise ValueError("an account appears twice in `accounts`")
        return self


class LeaseGrant(Message):
    account: Name
    lease_id: Id
    granted: Tokens
    expires_at: Seconds
    period_ends_at: Seconds


class LeaseAnswer(Message):
    leases: list[LeaseGrant] = Field(max_length=MAX_LEASE_ACCOUNTS)
    learning: bool = False  # a restarted hub's learning mode: no new leases yet
    retry_after_s: Seconds | None = None


# -- desired state ---------------------------------------------------------------------------


# A quota the node stores: at most SQLite's largest integer, so a desired state the node
# could not write is refused whole when it is read, not half-way through applying it.
Quota = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]


class AccountState(Message):
    name: Name
    service_class: Literal["S0", "S1", "S2", "S3", "S4"]
    requests_per_minute: Quota | None = None
    tokens_per_day: Quota | None = None
    budget_tokens: Quota | None = None  # spent through leases when set


class KeyState(Message):
    prefix: Short
    hash: Short
    account: Name
    admin: bool = False
    revoked: bool = False


KvType = Literal["f16", "q8_0", "q4_0"]
ToolFormat = Literal["auto", "generic", "hermes"]
Stop = Annotated[str, StringConstraints(min_length=1, max_length=256), Clean]
Alias = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^@\s]+$"), Clean]
MAX_SYSTEM_PROMPT = 8000  # characters


class ModelPreset(Message):
    """A deployment's settings for its model (protocol 7): the node loads the model with
    them and applies them to the requests it serves. Unset: the node's own setting
    (`model.n_ctx`, `model.n_slots`, f16, the request's or the API's default)."""

    n_ctx: int | None = Field(None, ge=256, le=131_072)  # context per slot, in tokens
    n_slots: int | None = Field(None, ge=1, le=256)
    kv_type: KvType | None = None  # the KV cache's element type
    # Default sampling: a request's own value wins.
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=100_000)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    # A chat without a system message gets this one first.
    system_prompt: (
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_SYSTEM_PROMPT), Clean] | None
    ) = None
    stop: list[Stop] = Field(default_factory=list, max_length=4)  # added to a request's own
    tool_format: ToolFormat = "auto"  # auto: the chat template's own, else generic
    aliases: list[Alias] = Field(default_factory=list, max_length=16)  # names it answers to

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        if len(set(self.aliases)) != len(self.aliases):
            raise ValueError("an alias appears twice")
        return self

    def load_options(self) -> tuple[int | None, int | None, KvType | None]:
        """What changes how the model is loaded (a change is a reload)."""
        return self.n_ctx, self.n_slots, self.kv_type


PeerUrl = Annotated[str, StringConstraints(max_length=300, pattern=r"^https?://[^\s/]+$")]


class ModelPeer(Message):
    """Another node of the site the same model is placed on (protocol 10): its LAN API, and
    whether it fetches the file from the hub before this node does (the node with the
    lower id goes first; the others wait for it, then fetch from it)."""

    node_id: Id
    urls: list[PeerUrl] = Field(max_length=8)
    first: bool = False


class PlacedModel(Message):
    """A model placed on the node: fetched through the tunnel by sha256, checked, loaded;
    (protocol 10) from a peer of its site where one holds it, with the hub's ticket."""

    name: Name
    version: Name
    sha256: Sha256
    size_bytes: int = Field(ge=0)
    format: Short
    preset: ModelPreset | None = None  # protocol 7
    peers: list[ModelPeer] = Field(default_factory=list, max_length=16)  # protocol 10
    ticket: Annotated[str, StringConstraints(max_length=1024)] | None = None  # protocol 10


class SeededPackage(Message):
    id: Id
    version: Id
    sha256: Sha256
    size: int = Field(ge=0)


class UpdateWindow(Message):
    """When a site lets its nodes fetch large files (an image, from protocol 9 model files
    too) and install an image: minutes of the day, UTC, from `start_min` up to `end_min` (a
    window past midnight has `end_min < start_min`)."""

    start_min: int = Field(ge=0, le=1439)
    end_min: int = Field(ge=0, le=1440)

    def holds(self, minute: int) -> bool:
        if self.start_min <= self.end_min:
            return self.start_min <= minute < self.end_min
        return minute >= self.start_min or minute < self.end_min


class ReleaseTarget(Message):
    """The image release a node should run (protocol 6): fetched through the tunnel by
    sha256 (`GET /v1/node/artifacts/SHA256`), checked, installed within `window`."""

    version: Name
    sha256: Sha256
    size_bytes: int = Field(ge=0, le=1 << 40)
    window: UpdateWindow | None = None  # None: any time


ObjectiveSeconds = Annotated[float, Field(ge=0.01, le=86_400)]


class ClassTargets(Message):
    """A service class's objectives as the hub sets them (each unset: the node's own)."""

    admit_s: ObjectiveSeconds | None = None  # SLO.A
    first_token_s: ObjectiveSeconds | None = None  # SLO.B
    complete_s: ObjectiveSeconds | None = None  # SLO.C
    # Their allowances per token (protocol 8): SLO.B's per prompt token, SLO.C's per
    # completion token (unset: the node's own, by default its model's idle speed).
    first_token_per_token_s: float | None = Field(None, ge=0, le=10)
    complete_per_token_s: float | None = Field(None, ge=0, le=60)


class PackageOverrides(Message):
    """What the hub sets of a node's content packages (its `packages` section; protocol 8):
    each unset keeps the node's own."""

    model: Name | None = None  # packages.model: the model that writes the items
    check_model: Name | None = None  # packages.check_model: the one that checks (protocol 11)
    verify_samples: int | None = Field(None, ge=1, le=9)  # protocol 11
    source_min_similarity: float | None = Field(None, ge=0, le=1)  # protocol 11
    max_attempts: int | None = Field(None, ge=1, le=20)
    item_max_tokens: int | None = Field(None, ge=64, le=4096)
    topic_min_similarity: float | None = Field(None, ge=0, le=1)
    cache_max_mb: int | None = Field(None, ge=1, le=10**7)


class NodeSettings(Message):
    """The part of a node's settings the hub sets (protocol 7): fleet-wide, per site and per
    node, the most specific winning (hub/state/configuration.py). A value set here wins over
    the node's configuration file; one unset leaves the node's own."""

    chat_default: Name | None = None  # model.chat_default
    default: Name | None = None  # model.default: a text completion without `model`
    aliases: dict[Alias, Name] = Field(default_factory=dict, max_length=64)  # model.aliases
    # The service classes' objectives (classes.s0 … s4): what admission holds requests to.
    objectives: dict[ServiceClassName, ClassTargets] = Field(default_factory=dict)
    packages: PackageOverrides = Field(default_factory=PackageOverrides)  # protocol 8

    def digest(self) -> str:
        """What a node reports once it applied these (`Capacity.settings_digest`)."""
        text = self.model_dump_json(exclude_defaults=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class DesiredState(Message):
    """What a node should hold, read in one transaction with the serial it is at."""

    node_id: Id
    serial: int = Field(ge=0)
    accounts: list[AccountState]
    keys: list[KeyState]
    models: list[PlacedModel] = Field(default_factory=list)
    packages: list[SeededPackage] = Field(default_factory=list)
    release: ReleaseTarget | None = None  # protocol 6
    settings: NodeSettings = Field(default_factory=NodeSettings)  # protocol 7
    # The site's update window for every file fetched (protocol 9): model files wait for it
    # as releases do (None: any time).
    window: UpdateWindow | None = None


# -- node logs (the hub reads them on the node's fleet listener) ---------------------------

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LOG_LEVELS: tuple[LogLevel, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_LOG_MESSAGE = 10_000  # characters: a message with its traceback, cut before this
MAX_LOG_RECORDS = 1000  # records in one answer (`limit`)


class LogRecord(Message):
    """One record of a node's log, numbered by the node (`seq`, from 1 in each run of its
    process)."""

    seq: int = Field(ge=1)
    time: Seconds
    level: LogLevel
    logger: Short
    message: Annotated[str, StringConstraints(max_length=MAX_LOG_MESSAGE), Clean]


class LogsAnswer(Message):
    """`GET /v1/fleet/logs` on a node: records after `after`, oldest first. `next_after`
    is what to ask after next (past records the level filter skipped); `oldest` the
    oldest seq the node still holds (0: none); `missed` how many after `after` it no
    longer held (its ring is bounded)."""

    records: list[LogRecord] = Field(max_length=MAX_LOG_RECORDS)
    next_after: int = Field(ge=0)
    oldest: int = Field(ge=0)
    missed: int = Field(ge=0)


# Every message of the protocol, by name: the schema snapshot and the hub's OpenAPI
# document are made from this list.
MESSAGES: tuple[type[Message], ...] = (
    EnrollRequest,
    EnrollAnswer,
    HeartbeatRequest,
    HeartbeatAnswer,
    CertificateRequest,
    CertificateAnswer,
    TrustAnswer,
    EventsRequest,
    EventsAnswer,
    LeaseRequest,
    LeaseAnswer,
    DesiredState,
    LogsAnswer,
)


# The fields a version added, by message. Those of a message the hub answers are left out
# of what it answers an older node (its models forbid fields they do not know); those of a
# message a node sends are never sent to a hub older than the node (it refuses the call),
# and an older node never sends them: the hub reads their defaults.
ADDED_IN: dict[type[Message], dict[str, int]] = {
    EnrollAnswer: {"trust": 3, "renew_at": 3},
    HeartbeatAnswer: {"trust_digest": 3, "renew_certificate": 3},
    HeartbeatRequest: {"objectives": 4},
    Capacity: {
        "leases_lapsed": 5,
        "lease_failures": 5,
        "image": 6,
        "release_error": 6,
        "evaluations": 7,
        "settings_digest": 7,
        "backup": 9,
    },
    DesiredState: {"release": 6, "settings": 7, "window": 9},
    PlacedModel: {"preset": 7, "peers": 10, "ticket": 10},
    LanApi: {"addresses": 10},
    NodeSettings: {"packages": 8},
    PackageOverrides: {"check_model": 11, "verify_samples": 11, "source_min_similarity": 11},
    ClassTargets: {"first_token_per_token_s": 8, "complete_per_token_s": 8},
}
# Where a message nests one of those above (in a list or as itself): their fields are left
# out there too.
NESTED: dict[type[Message], dict[str, type[Message]]] = {
    DesiredState: {"models": PlacedModel, "settings": NodeSettings},
    NodeSettings: {"objectives": ClassTargets, "packages": PackageOverrides},
}


def _left_out(message_type: type[Message], version: int) -> dict[str, Any]:
    """The fields of ``message_type`` (and of the messages it nests) a node that speaks
    ``version`` does not know, as pydantic's ``exclude`` takes them."""
    added = ADDED_IN.get(message_type, {})
    out: dict[str, Any] = {f: True for f, v in added.items() if v > version}
    for field, nested in NESTED.get(message_type, {}).items():
        inner = _left_out(nested, version)
        if inner and field not in out:
            many = get_origin(message_type.model_fields[field].annotation) in {list, dict}
            out[field] = {"__all__": inner} if many else inner
    return out


def dump_for(message: Message, version: int) -> str:
    """``message`` as JSON for a node that speaks ``version``."""
    return message.model_dump_json(exclude=_left_out(type(message), version))


def json_schema() -> dict[str, object]:
    """The JSON Schema of every message (with the version), for the snapshot test."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "oldest_node_protocol": OLDEST_NODE_PROTOCOL,
        "added_in": {m.__name__: added for m, added in ADDED_IN.items()},
        "messages": {m.__name__: m.model_json_schema() for m in MESSAGES},
    }


def node_protocol(header: str | None) -> int | None:
    """A node's protocol version from its header (None: absent or not a number)."""
    if header is None or not header.strip().isdigit() or len(header.strip()) > 6:
        return None
    return int(header.strip())


def supported(version: int | None) -> bool:
    return version is not None and OLDEST_NODE_PROTOCOL <= version <= PROTOCOL_VERSION


EVENTS: TypeAdapter[list[Event]] = TypeAdapter(list[Event])

# What every call of a node carries (the hub answers with its own).
HEADERS = {PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
