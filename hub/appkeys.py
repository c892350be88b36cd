"""The keys of what the hub's application holds (aiohttp's typed AppKey and RequestKey):
one module, importing the types it names and nothing that imports it, so that the API,
the console and the wiring all name them without an import circle."""

from __future__ import annotations

from aiohttp import web

from hub.certificates import HubTls
from hub.fleet.bandwidth import SiteBandwidth
from hub.fleet.heartbeats import Heartbeats
from hub.fleet.learning import Learning
from hub.loops import Running
from hub.models.jobs import PullRunner
from hub.nodelogs import NodeLogs
from hub.observability.metrics import HubMetrics
from hub.offload import Forwarder
from hub.settings import HubSettings
from hub.state.nodes import Node
from hub.state.store import AsyncHubStore
from shared.backup_schedule import Scheduled
from shared.supervise import Failures
from shared.tracing import Tracing

SETTINGS = web.AppKey("hub_settings", HubSettings)
STORE = web.AppKey("hub_store", AsyncHubStore)
BEATS = web.AppKey("hub_heartbeats", Heartbeats)
LEARNING = web.AppKey("hub_learning", Learning)
FORWARDER = web.AppKey("hub_forwarder", Forwarder)
# Reads of nodes' recent log records, on their fleet listeners (hub/nodelogs.py).
NODE_LOGS = web.AppKey("hub_node_logs", NodeLogs)
# OpenTelemetry spans of the hub's hops (shared/tracing.py); no-op unless `tracing:` is set.
TRACING = web.AppKey("hub_tracing", Tracing)
# The hub's CA, certificates and TLS contexts (hub/certificates.py).
TLS = web.AppKey("hub_tls", HubTls)
# The hub's public WireGuard key and its overlay address (hub/identity.py).
IDENTITY = web.AppKey("hub_identity", dict[str, str])
# Every background loop of this hub counts its failed rounds here (hub/loops.py).
LOOPS = web.AppKey("hub_loops", Failures)
RUNNING = web.AppKey("hub_running_loops", Running)
# The model pulls operators asked for (hub/models/jobs.py).
PULLS = web.AppKey("hub_pulls", PullRunner)
# The hub's Prometheus registry and its families (hub/observability/metrics.py).
METRICS = web.AppKey("hub_metrics", HubMetrics)
# Each site's bandwidth for the files its nodes fetch (hub/fleet/bandwidth.py).
BANDWIDTH = web.AppKey("hub_site_bandwidth", SiteBandwidth)
# The hub's own scheduled backups (`backups.schedule`): the alert loop, the console and the
# metrics read how they go.
SCHEDULED = web.AppKey("hub_scheduled_backups", Scheduled)

NODE = web.RequestKey("node", Node)  # the calling node, on node routes
NODE_PROTOCOL = web.RequestKey("node_protocol", int)  # the version it speaks
OPERATOR = web.RequestKey("operator", str)  # the calling operator's name, on operator routes
REQUEST_ID = web.RequestKey("request_id", str)
