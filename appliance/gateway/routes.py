"""The route table: one list that the app, the OpenAPI document and the docs test all read."""

from __future__ import annotations

from aiohttp import web

from appliance.gateway import (
    accounts,
    admin,
    backups,
    bundles,
    fleet,
    handlers,
    jobs,
    network,
    packages,
    peers,
    responses,
    speech,
    websocket,
)
from appliance.gateway.front import BUNDLES_ROUTE, FILES_ROUTE, RESTORE_ROUTE
from appliance.gateway.jobs import JobRequest
from appliance.gateway.openapi import Route, build_openapi
from appliance.gateway.schemas import AccountRequest, AdminModelRequest, KeyRequest
from appliance.inference.responses_api import ResponsesRequest
from appliance.inference.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from appliance.inference.speech import SpeechRequest
from appliance.packages.model import PackageRequest
from shared.errors import ErrorCode

_AUTH = (ErrorCode.missing_api_key, ErrorCode.invalid_api_key, ErrorCode.revoked_api_key)
_BODY = (
    ErrorCode.invalid_json,
    ErrorCode.invalid_value,
    ErrorCode.missing_required_parameter,
    ErrorCode.unknown_parameter,
    ErrorCode.unsupported_parameter,
    ErrorCode.request_too_large,
)
_GENERATE = (
    ErrorCode.model_not_found,
    ErrorCode.context_length_exceeded,
    ErrorCode.queue_full,
    ErrorCode.model_not_ready,
    ErrorCode.model_unavailable,
    ErrorCode.insufficient_memory,
)
_ADMIN = (*_AUTH, ErrorCode.permission_denied)
# Writes of accounts and keys: a node of a fleet takes them from its hub alone.
_LOCAL = (*_ADMIN, ErrorCode.hub_managed)
# A piece of an upload (a site bundle's).
_UPLOAD = (
    ErrorCode.not_found,
    ErrorCode.invalid_value,
    ErrorCode.upload_offset_mismatch,
    ErrorCode.upload_closed,
)


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI document of the table below."""
    return web.json_response(build_openapi(ROUTES))


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", handlers.healthz, "Liveness: the process is up.", auth=False),
    Route(
        "GET",
        "/readyz",
        handlers.readyz,
        "Readiness: 200 once the model (and the embedding model) is loaded, 503 before.",
        auth=False,
        errors=(ErrorCode.model_not_ready,),
    ),
    Route("GET", "/metrics", handlers.metrics, "OpenMetrics exposition.", auth=False),
    Route("GET", "/openapi.json", openapi, "This API's OpenAPI 3.1 document.", auth=False),
    Route(
        "GET",
        "/v1/models",
        handlers.list_models,
        "Every model a request may name, once each: registered models (loaded or not, "
        "with their `state`), the embedding model, and the aliases (`alias_of`).",
        auth=True,
        errors=_AUTH,
    ),
    Route(
        "GET",
        "/v1/models/{model}",
        handlers.retrieve_model,
        "One model of the list above, by its id, an alias or `name@version`.",
        auth=True,
        errors=(*_AUTH, ErrorCode.model_not_found),
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        handlers.chat_completions,
        "Chat completion (OpenAI), streaming with `stream: true`; `response_format` json_object "
        "and json_schema are enforced by constrained decoding and validated.",
        auth=True,
        body=ChatCompletionRequest,
        errors=(
            *_AUTH,
            *_BODY,
            *_GENERATE,
            ErrorCode.invalid_schema,
            ErrorCode.output_validation_failed,
        ),
        streams=True,
    ),
    Route(
        "POST",
        "/v1/completions",
        handlers.completions,
        "Text completion (OpenAI legacy), streaming with `stream: true`.",
        auth=True,
        body=CompletionRequest,
        errors=(*_AUTH, *_BODY, *_GENERATE),
        streams=True,
    ),
    Route(
        "POST",
        "/v1/offloaded/chat/completions",
        handlers.offloaded,
        "The hub hands this node a chat completion another node shed (burst offload), with "
        "its client's own fleet key: account and class come from the key.",
        auth=True,
        body=ChatCompletionRequest,
        errors=(*_AUTH, *_BODY, *_GENERATE),
        streams=True,
        caller="hub",
    ),
    Route(
        "POST",
        "/v1/offloaded/completions",
        handlers.offloaded,
        "The hub hands this node a text completion another node shed (burst offload).",
        auth=True,
        body=CompletionRequest,
        errors=(*_AUTH, *_BODY, *_GENERATE),
        streams=True,
        caller="hub",
    ),
    Route(
        "GET",
        "/v1/peer/artifacts/{sha256}",
        peers.peer_artifact,
        "Another node of this site fetches a model file this node holds, with the hub's "
        "ticket for it (`X-Kvl-Peer-Ticket`), no API key: the site's link carries the file "
        "once. Range and If-Range on the digest resume a cut fetch.",
        auth=False,
        errors=(
            ErrorCode.peer_ticket_refused,
            ErrorCode.not_found,
            ErrorCode.artifact_fetching,
        ),
        caller="peer",
    ),
    Route(
        "GET",
        "/v1/fleet/logs",
        fleet.node_logs,
        "The hub reads this node's recent log records (`?after=SEQ&limit=N&level=NAME`), "
        "following them with `wait=S` (a long poll, up to 30 s): on the fleet listener, "
        "with the hub's certificate, no API key.",
        auth=False,
        errors=(
            ErrorCode.client_certificate_required,
            ErrorCode.certificate_mismatch,
            ErrorCode.invalid_value,
        ),
        caller="hub",
    ),
    Route(
        "POST",
        "/v1/responses",
        responses.create,
        "OpenAI's Responses API: `input` (text, messages, function calls and their outputs) "
        "after the conversation of `previous_response_id`; tools, `text.format`; "
        "`stream: true` for its typed events. Stored answers are kept `responses.keep_s`.",
        auth=True,
        body=ResponsesRequest,
        errors=(
            *_AUTH,
            *_BODY,
            *_GENERATE,
            ErrorCode.response_not_found,
            ErrorCode.invalid_schema,
            ErrorCode.output_validation_failed,
        ),
        streams=True,
    ),
    Route(
        "GET",
        "/v1/responses/{id}",
        responses.retrieve,
        "A stored answer of this account.",
        auth=True,
        errors=(*_AUTH, ErrorCode.response_not_found),
    ),
    Route(
        "DELETE",
        "/v1/responses/{id}",
        responses.delete,
        "Forget a stored answer.",
        auth=True,
        errors=(*_AUTH, ErrorCode.response_not_found),
    ),
    Route(
        "POST",
        "/v1/embeddings",
        handlers.embeddings,
        "Embeddings (OpenAI): one unit vector per input text; concurrent requests are "
        "batched together.",
        auth=True,
        body=EmbeddingRequest,
        errors=(
            *_AUTH,
            *_BODY,
            ErrorCode.model_not_found,
            ErrorCode.queue_full,
            ErrorCode.model_not_ready,
        ),
    ),
    Route(
        "POST",
        "/v1/audio/speech",
        speech.create_speech,
        "Text to speech (OpenAI): espeak-ng or the neural voice reads `input`, a sentence at "
        "a time, and the audio is sent as it is read (wav, pcm, mp3, opus; flac whole).",
        auth=True,
        body=SpeechRequest,
        errors=(
            *_AUTH,
            *_BODY,
            ErrorCode.model_not_found,
            ErrorCode.queue_full,
            ErrorCode.rate_limit_exceeded,
            ErrorCode.insufficient_quota,
            ErrorCode.outbox_full,
            ErrorCode.model_unavailable,
        ),
    ),
    Route(
        "GET",
        "/v1/ws",
        websocket.stream,
        "WebSocket streaming: several chat and text completions on one connection, each "
        "with its own id, cancellable by message (see docs/api.md).",
        auth=True,
        errors=(*_AUTH, ErrorCode.bad_request),
    ),
    Route(
        "POST",
        "/v1/packages",
        packages.create_package,
        "Ask for a content package (topic, level, spec): a job (202), or with `wait: true` "
        "the finished, validated package; a repeated request is served from the cache.",
        auth=True,
        body=PackageRequest,
        errors=(*_AUTH, *_BODY, *_GENERATE, ErrorCode.package_validation_failed),
        status=202,
    ),
    Route(
        "GET",
        "/v1/packages",
        packages.list_packages,
        "The packages this key's account asked for and those the hub seeded (an admin key: "
        "the whole cache), newest first; `q` searches id, title and topic; `limit`, `offset`.",
        auth=True,
        errors=(*_AUTH, ErrorCode.invalid_value),
    ),
    Route(
        "GET",
        "/v1/packages/{id}",
        packages.get_package,
        "A package and its manifest (`version` for another than the newest); ETag.",
        auth=True,
        errors=(*_AUTH, ErrorCode.package_not_found),
    ),
    Route(
        "GET",
        "/v1/packages/{id}/files/{path}",
        packages.package_file,
        "A file of a package, verified against its sha256 before it is served; ETag (its "
        "sha256) and Range.",
        auth=True,
        errors=(*_AUTH, ErrorCode.package_not_found, ErrorCode.package_corrupt),
        router_path=FILES_ROUTE,
    ),
    Route(
        "GET",
        "/v1/packages/{id}/exports/{format}",
        packages.package_export,
        "The package for an LMS: `h5p` (H5P Question Set; `?libraries=H5P.QuestionSet-1.21,…` "
        "declares the newer minor versions a site has), `moodle-xml`, `qti3`.",
        auth=True,
        errors=(
            *_AUTH,
            ErrorCode.invalid_value,
            ErrorCode.package_not_found,
            ErrorCode.package_corrupt,
            ErrorCode.package_validation_failed,
        ),
    ),
    Route(
        "POST",
        "/v1/admin/packages/{id}/pin",
        packages.pin_package,
        'Pin a package (never evicted) or unpin it: `{"pinned": true, "version": …}`.',
        auth=True,
        body=packages.PinRequest,
        errors=(*_ADMIN, *_BODY, ErrorCode.package_not_found),
    ),
    Route(
        "POST",
        "/v1/jobs",
        jobs.create_job,
        "Create a durable job: a batch of chat and text completions (OpenAI Batch API items) "
        "run in the background as S0 work; a signed webhook when it ends.",
        auth=True,
        body=JobRequest,
        errors=(*_AUTH, *_BODY, ErrorCode.model_not_found, ErrorCode.invalid_schema),
        status=202,
    ),
    Route(
        "GET",
        "/v1/jobs",
        jobs.list_jobs,
        "This account's jobs, newest first (an admin key: every account's); `?limit=` "
        "(20) and `?after=<job id>`.",
        auth=True,
        errors=(*_AUTH, ErrorCode.invalid_value),
    ),
    Route(
        "GET",
        "/v1/jobs/{id}",
        jobs.get_job,
        "A job of this account: status, progress, webhook delivery.",
        auth=True,
        errors=(*_AUTH, ErrorCode.job_not_found),
    ),
    Route(
        "GET",
        "/v1/jobs/{id}/results",
        jobs.job_results,
        "The results of a job's items that ended, in request order: what each route would "
        "have answered (`?limit=` up to 1000, `?after=<custom_id>`).",
        auth=True,
        errors=(*_AUTH, ErrorCode.job_not_found, ErrorCode.invalid_value),
    ),
    Route(
        "DELETE",
        "/v1/jobs/{id}",
        jobs.cancel_job,
        "Cancel a job: no item starts again, items in flight stop, results so far stay.",
        auth=True,
        errors=(*_AUTH, ErrorCode.job_not_found, ErrorCode.job_finished),
    ),
    Route(
        "GET",
        "/v1/admin/models",
        admin.list_models,
        "Admin: every registered model, loaded or not: state, pin, replicas (pid, load, "
        "device), memory estimate and resident memory, and the memory budget.",
        auth=True,
        errors=_ADMIN,
    ),
    Route(
        "POST",
        "/v1/admin/models",
        admin.load_model,
        "Admin: load a model (unloading idle ones, least recently used first, to fit the "
        "memory budget), or change its replicas or pin; answers once it serves.",
        auth=True,
        body=AdminModelRequest,
        errors=(
            *_ADMIN,
            *_BODY,
            ErrorCode.model_not_found,
            ErrorCode.model_pinned,
            ErrorCode.insufficient_memory,
            ErrorCode.model_unavailable,
        ),
    ),
    Route(
        "DELETE",
        "/v1/admin/models/{model}",
        admin.unload_model,
        "Admin: unload a model once its requests in flight finish (`model.drain_s`); a "
        "pinned model must be unpinned first.",
        auth=True,
        errors=(*_ADMIN, ErrorCode.model_not_found, ErrorCode.model_pinned),
    ),
    Route(
        "POST",
        "/v1/admin/backup",
        backups.take_backup,
        "Admin: the appliance's backup, taken while it serves, as the archive `kvl appliance "
        "backup` writes (`?packages=false`: without the package cache), sealed with age when "
        "the body names recipients or a passphrase; `kvl appliance restore` puts it back.",
        auth=True,
        body=backups.BackupRequest,
        errors=(*_ADMIN, *_BODY, ErrorCode.internal_error),
    ),
    Route(
        "GET",
        "/v1/admin/backups",
        backups.list_backups,
        "Admin: the backups the schedule (`backups.schedule`) keeps on this node, newest "
        "first, and how it goes (the last good one, the last failure, when one is overdue).",
        auth=True,
        errors=_ADMIN,
    ),
    Route(
        "GET",
        "/v1/admin/backups/{name}",
        backups.download_backup,
        "Admin: download one kept backup, by the `id` the list gives.",
        auth=True,
        errors=(*_ADMIN, ErrorCode.not_found),
    ),
    Route(
        "GET",
        BUNDLES_ROUTE,
        bundles.list_uploads,
        "Admin: the site bundles the node keeps, newest first: uploaded through this API, "
        "or found on a USB stick at the node (`source`), each with its state.",
        auth=True,
        errors=_ADMIN,
    ),
    Route(
        "POST",
        BUNDLES_ROUTE,
        bundles.create_upload,
        "Admin: begin uploading a site bundle (its `size`): models, a release, packages and "
        "settings in one signed file, applied once whole and checked against the node's "
        "keyring; send it with PATCH, in pieces.",
        auth=True,
        body=bundles.BundleUploadRequest,
        errors=(*_ADMIN, *_BODY, ErrorCode.request_too_large, ErrorCode.upload_closed),
        status=201,
    ),
    Route(
        "GET",
        f"{BUNDLES_ROUTE}/{{id}}",
        bundles.get_upload,
        "Admin: where a bundle upload stands (`offset`), its state (open, checking, "
        "applying, applied, failed), what it applied, or which part failed and why.",
        auth=True,
        errors=(*_ADMIN, ErrorCode.not_found),
    ),
    Route(
        "PATCH",
        f"{BUNDLES_ROUTE}/{{id}}",
        bundles.append,
        "Admin: the next piece of a bundle upload at its `Upload-Offset`; the last one "
        "checks the bundle whole and applies it.",
        auth=True,
        errors=(*_ADMIN, *_UPLOAD),
    ),
    Route(
        "DELETE",
        f"{BUNDLES_ROUTE}/{{id}}",
        bundles.cancel,
        "Admin: cancel a bundle upload (or forget one that ended).",
        auth=True,
        errors=(*_ADMIN, ErrorCode.not_found, ErrorCode.upload_closed),
        status=204,
    ),
    Route(
        "GET",
        "/v1/admin/network",
        network.get_network,
        "Admin: the node's network: the setting in force (addresses, gateways, DNS, proxy), "
        "where it came from, and the last change (trying, applied, rolled back, refused).",
        auth=True,
        errors=_ADMIN,
    ),
    Route(
        "PUT",
        "/v1/admin/network",
        network.put_network,
        "Admin: change the node's network (a whole setting): tried at once by the image's "
        "network agent, kept only if confirmed over it within `confirm_within_s`, else the "
        "last working setting comes back.",
        auth=True,
        body=network.NetworkChange,
        errors=(*_ADMIN, *_BODY, ErrorCode.network_trial, ErrorCode.network_not_managed),
        status=202,
    ),
    Route(
        "POST",
        "/v1/admin/network/confirm",
        network.confirm_network,
        "Admin: keep the network change on trial (its `id`), sent over the new setting.",
        auth=True,
        body=network.NetworkConfirmation,
        errors=(*_ADMIN, *_BODY, ErrorCode.network_trial, ErrorCode.network_not_managed),
    ),
    Route(
        "POST",
        RESTORE_ROUTE,
        backups.restore_backup,
        "Admin: put back a backup (the archive as the body; a sealed one opened with the "
        "`Kvl-Backup-Identity` or `Kvl-Backup-Passphrase` header): checked whole while the "
        "appliance serves, then applied as it restarts (202); what the data directory held "
        "is set aside, never deleted.",
        auth=True,
        errors=(*_ADMIN, ErrorCode.bad_request, ErrorCode.request_too_large),
        status=202,
    ),
    Route(
        "GET",
        "/v1/admin/accounts",
        accounts.list_accounts,
        "Admin: every account on this node: class, quotas, whether the hub gave it "
        "(`fleet`), when it was disabled.",
        auth=True,
        errors=_ADMIN,
    ),
    Route(
        "POST",
        "/v1/admin/accounts",
        accounts.create_account,
        "Admin: make an account (a site without a hub; a node of a fleet answers 409 "
        "`hub_managed`).",
        auth=True,
        body=AccountRequest,
        errors=(*_LOCAL, *_BODY, ErrorCode.account_exists),
        status=201,
    ),
    Route(
        "DELETE",
        "/v1/admin/accounts/{name}",
        accounts.disable_account,
        "Admin: disable an account and revoke its keys (kept, with its usage); never the "
        "one holding every active admin key.",
        auth=True,
        errors=(
            *_LOCAL,
            ErrorCode.invalid_value,
            ErrorCode.account_not_found,
            ErrorCode.last_admin_key,
        ),
    ),
    Route(
        "GET",
        "/v1/admin/keys",
        accounts.list_keys,
        "Admin: every API key on this node (`?account=NAME`: that account's), by prefix; "
        "never a key itself.",
        auth=True,
        errors=(
            *_ADMIN,
            ErrorCode.invalid_value,
            ErrorCode.unknown_parameter,
            ErrorCode.account_not_found,
        ),
    ),
    Route(
        "POST",
        "/v1/admin/keys",
        accounts.create_key,
        "Admin: make a key of an account; the key is in this answer only (a site without a hub).",
        auth=True,
        body=KeyRequest,
        errors=(*_LOCAL, *_BODY, ErrorCode.account_not_found, ErrorCode.account_disabled),
        status=201,
    ),
    Route(
        "DELETE",
        "/v1/admin/keys/{prefix}",
        accounts.revoke_key,
        "Admin: revoke a key by its prefix; never the last active admin key.",
        auth=True,
        errors=(
            *_LOCAL,
            ErrorCode.invalid_value,
            ErrorCode.key_not_found,
            ErrorCode.last_admin_key,
        ),
    ),
)
