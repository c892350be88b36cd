"""Admin routes for the model registry: list, load (with replicas and pin), unload.

Behind an admin key (`kvl appliance keys create --account NAME --admin`); the auth
middleware refuses other keys on every /v1/admin route.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import psutil
from aiohttp import web

from appliance.gateway.appkeys import ADMISSION, EMBEDDINGS, REGISTRY, STORE
from appliance.gateway.parsing import read_json
from appliance.gateway.schemas import AdminModelRequest
from appliance.inference.schemas import parse_body
from appliance.serving.registry import (
    InsufficientMemoryError,
    ModelNotReadyError,
    ModelPinnedError,
    UnknownModelError,
    split_ref,
)
from shared.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from appliance.serving.registry import LoadedModel, ModelRegistry
    from appliance.state.records import ModelRecord


async def list_models(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    store = request.app[STORE]
    records = await store.run(store.sync.list_models)
    pinned = {r.ref for r in await store.run(store.sync.pinned_models)}
    loaded = {d.record.ref: d for d in registry.loaded_models()}
    data = [_entry(r, loaded.get(r.ref), r.ref in pinned) for r in records]
    for entry in data:
        if entry["state"] == "ready":
            entry["door"] = request.app[ADMISSION].door(entry["ref"])
    data += [
        {
            "ref": m.ref,
            "name": m.name,
            "version": m.version,
            "format": "onnx",
            "quantization": "int8",
            "sha256": m.sha256,
            "state": "ready",
            "pinned": True,  # configured by the `embeddings` settings, not by this API
            "provider": m.provider,
            "replicas": [],
        }
        for m in request.app[EMBEDDINGS].served()
    ]
    return web.json_response({"object": "list", "data": data, "memory": _memory(registry)})


async def load_model(request: web.Request) -> web.Response:
    req = parse_body(AdminModelRequest, await read_json(request))
    registry = request.app[REGISTRY]
    _refuse_embedding_model(request, req.model)
    try:
        deployment = await registry.load(req.model, replicas=req.replicas, pinned=req.pinned)
    except UnknownModelError as err:
        raise ApiError(ErrorCode.model_not_found, str(err), param="model") from err
    except InsufficientMemoryError as err:
        raise ApiError(ErrorCode.insufficient_memory, str(err), retry_after=30) from err
    except ModelNotReadyError as err:
        raise ApiError(ErrorCode.model_unavailable, str(err), retry_after=30) from err
    if deployment.state == "failed":
        raise ApiError(
            ErrorCode.model_unavailable,
            f"model {deployment.record.ref} failed to load: {deployment.error}",
            retry_after=30,
        )
    return web.json_response(_entry(deployment.record, deployment, deployment.pinned))


async def unload_model(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    _refuse_embedding_model(request, model)
    registry = request.app[REGISTRY]
    try:
        deployment = await registry.unload(model)
    except UnknownModelError as err:
        raise ApiError(ErrorCode.model_not_found, str(err)) from err
    except ModelPinnedError as err:
        raise ApiError(ErrorCode.model_pinned, str(err)) from err
    return web.json_response(_entry(deployment.record, None, deployment.pinned))


def _refuse_embedding_model(request: web.Request, model: str) -> None:
    name, _ = split_ref(model)
    if any(m.name == name for m in request.app[EMBEDDINGS].served()):
        raise ApiError(
            ErrorCode.model_pinned,
            f"{model} is the embedding model; the `embeddings` settings load it",
            param="model",
        )


def _entry(record: ModelRecord, deployment: LoadedModel | None, pinned: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "ref": record.ref,
        "name": record.name,
        "version": record.version,
        "format": record.format,
        "quantization": record.quantization,
        "sha256": record.sha256,
        "size_bytes": record.size_bytes,
        "state": "unloaded" if deployment is None else deployment.state,
        "pinned": pinned if deployment is None else deployment.pinned,
        "replicas": [],
    }
    if deployment is None:
        return entry
    measured = deployment.measured_mb()
    entry.update(
        {
            "memory_estimate_mib": round(deployment.memory_mb, 1),
            "memory_resident_mib": None if measured is None else round(measured, 1),
            "idle_s": round(time.monotonic() - deployment.last_used, 1),
            "outstanding": deployment.outstanding,
            "context_length": deployment.options.n_ctx,
            "error": deployment.error,
            "replicas": [
                {
                    "index": i,
                    "pid": r.pid,
                    "ready": r.ready,
                    "outstanding": r.outstanding,
                    "submitted": r.submitted,
                    "busy_slots": r.busy_slots,
                    "slots": r.options.n_slots,
                    "restarts": r.restarts,
                    "device": r.layout.device if r.layout is not None else None,
                }
                for i, r in enumerate(deployment.replicas)
            ],
        }
    )
    return entry


def _memory(registry: ModelRegistry) -> dict[str, float]:
    return {
        "budget_mib": round(registry.budget_mb, 1),
        "reserved_mib": round(registry.used_mb(), 1),
        "available_mib": round(psutil.virtual_memory().available / 2**20, 1),
    }
