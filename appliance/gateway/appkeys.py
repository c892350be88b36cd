"""Typed keys for everything the gateway keeps on the application and the request."""

from __future__ import annotations

from aiohttp import web

from appliance.fleet.certificates import NodeCertificate
from appliance.gateway.offload import Offload
from appliance.inference.accounts import AccountService
from appliance.inference.admission import AdmissionControl
from appliance.inference.completions import CompletionService
from appliance.inference.embeddings import EmbeddingService
from appliance.inference.names import ModelNames
from appliance.observability.logs import LogRing
from appliance.observability.metrics import Metrics
from appliance.observability.tracing import Tracing
from appliance.serving.presets import Presets
from appliance.serving.registry import ModelRegistry
from appliance.settings import ApplianceSettings
from appliance.state.store import ApiKey, AsyncStore

SETTINGS = web.AppKey("settings", ApplianceSettings)
STORE = web.AppKey("store", AsyncStore)
METRICS = web.AppKey("metrics", Metrics)
REGISTRY = web.AppKey("model_registry", ModelRegistry)
COMPLETIONS = web.AppKey("completions", CompletionService)
ADMISSION = web.AppKey("admission", AdmissionControl)
EMBEDDINGS = web.AppKey("embeddings", EmbeddingService)
NODE_ID = web.AppKey("node_id", str)
TRACING = web.AppKey("tracing", Tracing)
# The process's recent log records, served to the hub (appliance/observability/logs.py).
LOGS = web.AppKey("logs", LogRing)
OFFLOAD = web.AppKey("offload", Offload)
# What a request's `model` names: aliases and defaults (appliance/inference/names.py).
NAMES = web.AppKey("model_names", ModelNames)
# The hub's presets for the models it placed here (appliance/serving/presets.py).
PRESETS = web.AppKey("presets", Presets)
# This node's certificate and trust (appliance/fleet/certificates.py): who the hub is.
CERTIFICATE = web.AppKey("certificate", NodeCertificate)
# Accounts and keys made over the LAN (appliance/inference/accounts.py).
ACCOUNTS = web.AppKey("accounts", AccountService)

# Per request: the authenticated key (set by the auth middleware on /v1 routes).
REQUEST_KEY = web.RequestKey("key", ApiKey)
REQUEST_ID = web.RequestKey("request_id", str)


def api_key(request: web.Request) -> ApiKey:
    return request[REQUEST_KEY]
