"""`/v1/models`: every model a request may name, once each, with what it is doing now.

One entry per registered model name (the version a request without `@version` gets),
whether it is loaded or not (a request for an unloaded one loads it), then the embedding
model, then each alias as an entry of its own that says what it leads to. OpenAI's fields
first; the rest are this appliance's. Pure: the caller hands in what the registry, the
store and the embedding service know. `created` (Unix seconds, as OpenAI's) is when the
model was registered on this appliance; for a model a package ships and no request has
registered yet, and for the embedding model, when its file was installed; an alias's is
its model's.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from appliance.inference.embeddings import LoadedModel as LoadedEmbedding
    from appliance.inference.names import ModelNames
    from appliance.serving.registry import LoadedModel
    from appliance.state.records import ModelRecord


def model_entries(
    registered: list[ModelRecord],
    loaded: list[LoadedModel],
    embedding: LoadedEmbedding | None,
    names: ModelNames,
    embedded: Sequence[tuple[str, str, int]] = (),
) -> list[dict[str, Any]]:
    """`embedded`: (name, version, created) of the models shipped in installed packages,
    which a first request registers and loads."""
    by_ref = {d.record.ref: d for d in loaded}
    entries: list[dict[str, Any]] = []
    newest: dict[str, ModelRecord] = {}
    for record in registered:  # sorted by name, then age: the last of a name is newest
        newest[record.name] = record
    for name, record in newest.items():
        # A request naming `name` gets its newest serving version, else its newest.
        serving = [d for d in loaded if d.record.name == name and d.state == "ready"]
        chosen = max(serving, key=lambda d: d.record.added_at) if serving else None
        deployment = chosen or by_ref.get(record.ref)
        current = deployment.record if deployment is not None else record
        entry: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": _created(current.added_at),
            "owned_by": "kovenlab",
            "version": current.version,
            "ref": current.ref,
            "versions": [r.version for r in registered if r.name == name],
            "format": current.format,
            "quantization": current.quantization,
            "sha256": current.sha256,
            "state": deployment.state if deployment is not None else "unloaded",
            "aliases": names.aliases_of(current.ref, name),
        }
        if deployment is not None and deployment.state == "ready":
            replicas = deployment.replicas
            entry |= {
                "context_length": deployment.options.n_ctx,
                "slots": deployment.options.n_slots,
                "replicas": len(replicas),
                "device": next(
                    (r.layout.device for r in replicas if r.layout is not None), "unknown"
                ),
            }
        entries.append(entry)
    for name, version, created in embedded:
        if name not in newest:
            entries.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "kovenlab",
                    "version": version,
                    "ref": f"{name}@{version}",
                    "versions": [version],
                    "format": "gguf",
                    "state": "unloaded",
                    "aliases": names.aliases_of(f"{name}@{version}", name),
                }
            )
    entries.sort(key=lambda entry: entry["id"])
    if embedding is not None:
        entries.append(
            {
                "id": embedding.name,
                "object": "model",
                "created": embedding.created,
                "owned_by": "kovenlab",
                "version": embedding.version,
                "ref": embedding.ref,
                "format": "onnx",
                "quantization": "int8",
                "sha256": embedding.sha256,
                "state": "ready",
                "aliases": names.aliases_of(embedding.ref, embedding.name),
                "provider": embedding.provider,
                "dimension": embedding.dimension,
            }
        )
    known = {entry["id"]: entry for entry in entries} | {e["ref"]: e for e in entries}
    for alias, target in sorted(names.aliases.items()):
        to = known.get(target)
        entries.append(
            {
                "id": alias,
                "object": "model",
                "created": to["created"] if to is not None else 0,
                "owned_by": "kovenlab",
                "alias_of": target,
                "state": to["state"] if to is not None else "unregistered",
            }
        )
    return entries


def _created(added_at: str) -> int:
    """Unix seconds of a registration time as the store keeps it (ISO 8601, UTC)."""
    try:
        return int(datetime.fromisoformat(added_at).timestamp())
    except ValueError:
        return 0


def find_entry(entries: list[dict[str, Any]], model: str) -> dict[str, Any] | None:
    """The entry a model id names: its id, or a `name@version` ref."""
    for entry in entries:
        if entry["id"] == model:
            return entry
    for entry in entries:
        if entry.get("ref") == model:
            return entry
    return None
