"""The one error shape of every HTTP API in the project, built here and nowhere else.

Clients get OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so the
official SDKs raise their usual exception classes. ``code`` is stable: clients and
tests branch on it, never on the message text.

Services raise a DomainError that says what went wrong (each names its code, none an HTTP
status); the HTTP and gRPC layers map them to their answers, each in one place.
"""

# The domain errors are named for what went wrong (ModelNotFound, QueueFull), without the
# Error suffix: most translate a lower layer's error of that very name (the store's
# JobNotFoundError, the engine's QueueFullError), and one name should not mean two classes.
# ruff: noqa: N818

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


@dataclass(frozen=True)
class _Kind:
    status: int
    type: str
    summary: str


class ErrorCode(StrEnum):
    """Every error code the APIs return. docs/api.md lists each one (a test checks)."""

    bad_request = "bad_request"
    invalid_json = "invalid_json"
    invalid_value = "invalid_value"
    missing_required_parameter = "missing_required_parameter"
    unknown_parameter = "unknown_parameter"
    unsupported_parameter = "unsupported_parameter"
    invalid_schema = "invalid_schema"
    context_length_exceeded = "context_length_exceeded"
    prompt_too_long_for_class = "prompt_too_long_for_class"
    request_too_large = "request_too_large"
    missing_api_key = "missing_api_key"
    invalid_api_key = "invalid_api_key"
    revoked_api_key = "revoked_api_key"
    permission_denied = "permission_denied"
    invalid_enrollment_token = "invalid_enrollment_token"  # noqa: S105 - a code, no secret
    invalid_node_token = "invalid_node_token"  # noqa: S105 - a code, no secret
    invalid_operator_token = "invalid_operator_token"  # noqa: S105 - a code, no secret
    node_revoked = "node_revoked"
    wrong_source_address = "wrong_source_address"
    protocol_unsupported = "protocol_unsupported"
    already_enrolled = "already_enrolled"
    foreign_account = "foreign_account"
    client_certificate_required = "client_certificate_required"
    certificate_mismatch = "certificate_mismatch"
    certificate_name_refused = "certificate_name_refused"
    certificate_name_taken = "certificate_name_taken"
    foreign_lease = "foreign_lease"
    node_offline = "node_offline"
    node_unreachable = "node_unreachable"
    rollout_conflict = "rollout_conflict"
    not_found = "not_found"
    model_not_found = "model_not_found"
    job_not_found = "job_not_found"
    response_not_found = "response_not_found"
    method_not_allowed = "method_not_allowed"
    output_validation_failed = "output_validation_failed"
    package_validation_failed = "package_validation_failed"
    package_not_found = "package_not_found"
    package_corrupt = "package_corrupt"
    queue_full = "queue_full"
    overloaded = "overloaded"
    rate_limit_exceeded = "rate_limit_exceeded"
    insufficient_quota = "insufficient_quota"
    too_many_auth_failures = "too_many_auth_failures"
    model_not_ready = "model_not_ready"
    model_unavailable = "model_unavailable"
    model_pinned = "model_pinned"
    outbox_full = "outbox_full"
    job_finished = "job_finished"
    upload_offset_mismatch = "upload_offset_mismatch"
    upload_closed = "upload_closed"
    network_not_managed = "network_not_managed"
    peer_ticket_refused = "peer_ticket_refused"
    artifact_fetching = "artifact_fetching"
    network_trial = "network_trial"
    account_not_found = "account_not_found"
    key_not_found = "key_not_found"
    account_exists = "account_exists"
    account_disabled = "account_disabled"
    last_admin_key = "last_admin_key"
    hub_managed = "hub_managed"
    insufficient_memory = "insufficient_memory"
    shutting_down = "shutting_down"
    internal_error = "internal_error"

    @property
    def status(self) -> int:
        return _KINDS[self].status

    @property
    def type(self) -> str:
        return _KINDS[self].type

    @property
    def summary(self) -> str:
        return _KINDS[self].summary


_INVALID = "invalid_request_error"
_KINDS: dict[ErrorCode, _Kind] = {
    ErrorCode.bad_request: _Kind(
        400, _INVALID, "the HTTP request itself is malformed, or its body cannot be decoded"
    ),
    ErrorCode.invalid_json: _Kind(400, _INVALID, "the body is not valid JSON"),
    ErrorCode.invalid_value: _Kind(
        400, _INVALID, "a field has the wrong type or is out of range; `param` names it"
    ),
    ErrorCode.missing_required_parameter: _Kind(400, _INVALID, "a required field is missing"),
    ErrorCode.unknown_parameter: _Kind(400, _INVALID, "a field this API does not know"),
    ErrorCode.unsupported_parameter: _Kind(
        400, _INVALID, "an OpenAI parameter (or value) the appliance does not support"
    ),
    ErrorCode.invalid_schema: _Kind(
        400, _INVALID, "`response_format.json_schema` is not a usable JSON Schema"
    ),
    ErrorCode.context_length_exceeded: _Kind(
        400, _INVALID, "prompt plus `max_tokens` does not fit the model's context"
    ),
    ErrorCode.prompt_too_long_for_class: _Kind(
        400,
        _INVALID,
        "even an idle node could not give the prompt its first token within its class's "
        "objective: the message names the longest prompt the class takes on this node",
    ),
    ErrorCode.request_too_large: _Kind(413, _INVALID, "the body is over `server.max_body_bytes`"),
    ErrorCode.missing_api_key: _Kind(401, "authentication_error", "no `Authorization: Bearer`"),
    ErrorCode.invalid_api_key: _Kind(401, "authentication_error", "the key is not known"),
    ErrorCode.revoked_api_key: _Kind(401, "authentication_error", "the key was revoked"),
    ErrorCode.permission_denied: _Kind(
        403, "permission_error", "the key may not use this route (admin routes need an admin key)"
    ),
    ErrorCode.invalid_enrollment_token: _Kind(
        401,
        "authentication_error",
        "hub: the enrollment token is unknown, used, expired or revoked (the message says which)",
    ),
    ErrorCode.invalid_node_token: _Kind(
        401, "authentication_error", "hub: the node token is missing or not known"
    ),
    ErrorCode.invalid_operator_token: _Kind(
        401,
        "authentication_error",
        "hub: an admin call without a valid operator token (`kvl hub operators create`)",
    ),
    ErrorCode.node_revoked: _Kind(403, "permission_error", "hub: the node was revoked"),
    ErrorCode.wrong_source_address: _Kind(
        403,
        "permission_error",
        "hub: a node call that did not come from the node's overlay address",
    ),
    ErrorCode.protocol_unsupported: _Kind(
        400,
        _INVALID,
        "hub: the node's `Kvl-Protocol` version is outside the versions this hub serves "
        "(the message says which side to upgrade)",
    ),
    ErrorCode.already_enrolled: _Kind(
        409,
        "conflict_error",
        "hub: a node with this WireGuard key is enrolled already, and this is not a retry "
        "of that enrollment (same token and key, within ten minutes)",
    ),
    ErrorCode.foreign_account: _Kind(
        403,
        "permission_error",
        "hub: a node reported usage of, or asked a lease for, an account it does not serve",
    ),
    ErrorCode.client_certificate_required: _Kind(
        401,
        "authentication_error",
        "a call that must present a client certificate of the fleet (mutual TLS) came "
        "without one: a node the hub has issued a certificate, or the hub calling a node",
    ),
    ErrorCode.certificate_mismatch: _Kind(
        403,
        "permission_error",
        "the client certificate speaks for someone else: another node than the node "
        "token's, or not the hub",
    ),
    ErrorCode.certificate_name_refused: _Kind(
        403,
        "permission_error",
        "hub: a node asked for a name in its certificate that is not its own to have "
        "(the hub's, an overlay address not its own, a DNS name the hub did not give it)",
    ),
    ErrorCode.certificate_name_taken: _Kind(
        409,
        "conflict_error",
        "hub: a node asked for a name (an address, a DNS name) that another live node's "
        "certificate holds",
    ),
    ErrorCode.foreign_lease: _Kind(
        403, "permission_error", "hub: a node reported a lease granted to another node"
    ),
    ErrorCode.node_offline: _Kind(
        409,
        "conflict_error",
        "hub: the node cannot be asked now (offline, revoked, or without a fleet listener)",
    ),
    ErrorCode.rollout_conflict: _Kind(
        409,
        "conflict_error",
        "hub: a release of that version exists already, another rollout of the same thing "
        "is active, the rollout would reach no node, or it cannot take that step in its state",
    ),
    ErrorCode.node_unreachable: _Kind(
        503,
        "server_error",
        "hub: the node did not answer through the tunnel in time, or not as it should",
    ),
    ErrorCode.not_found: _Kind(404, "not_found_error", "no such route"),
    # OpenAI's type for an unknown model (its SDKs read `code`; some clients read `type`).
    ErrorCode.model_not_found: _Kind(404, _INVALID, "no model by that name"),
    ErrorCode.job_not_found: _Kind(404, "not_found_error", "no job by that id in this account"),
    ErrorCode.response_not_found: _Kind(
        404,
        _INVALID,
        "no stored response by that id in this account (never stored, deleted, or expired "
        "after `responses.keep_s`)",
    ),
    ErrorCode.method_not_allowed: _Kind(405, _INVALID, "the route exists, not with that method"),
    ErrorCode.package_validation_failed: _Kind(
        422,
        _INVALID,
        "the package failed its checks after every attempt; the message lists the checks",
    ),
    ErrorCode.package_not_found: _Kind(404, _INVALID, "no such package, version or file"),
    ErrorCode.package_corrupt: _Kind(
        503,
        "server_error",
        "a cached file failed its digest check; it is never served (ask for the package again)",
    ),
    ErrorCode.output_validation_failed: _Kind(
        422,
        "invalid_output_error",
        "structured output did not validate against the requested schema (fails closed)",
    ),
    ErrorCode.queue_full: _Kind(
        429, "rate_limit_error", "the model's queue is full; retry after `Retry-After` seconds"
    ),
    ErrorCode.overloaded: _Kind(
        429,
        "rate_limit_error",
        "the request cannot meet its service class's objectives now (refused at the door, "
        "or dropped from the queue); retry after `Retry-After` seconds",
    ),
    ErrorCode.rate_limit_exceeded: _Kind(
        429,
        "requests",
        "the account is over a rate of its class (`requests_per_minute`, or the fleet "
        "budget's safe capacity while the hub is away, or a lease not yet granted); "
        "`Retry-After` says when (OpenAI's code; SDKs retry it)",
    ),
    ErrorCode.insufficient_quota: _Kind(
        429,
        "insufficient_quota",
        "the account's allowance is spent (`tokens_per_day`, or its budget across the fleet "
        "for the period); `Retry-After` says when it refills, and `x-should-retry: false` "
        "tells OpenAI's SDKs not to retry (OpenAI's code)",
    ),
    ErrorCode.too_many_auth_failures: _Kind(
        429, "rate_limit_error", "too many failed authentications from this address"
    ),
    ErrorCode.model_not_ready: _Kind(
        503, "server_error", "the model is still loading; retry after `Retry-After` seconds"
    ),
    ErrorCode.model_unavailable: _Kind(
        503,
        "server_error",
        "the model's worker process stopped mid-request and is restarting; retry after "
        "`Retry-After` seconds",
    ),
    ErrorCode.model_pinned: _Kind(
        409, "conflict_error", "the model is pinned; unpin it before unloading it"
    ),
    ErrorCode.job_finished: _Kind(
        409, "conflict_error", "the job already ended (completed, failed or cancelled)"
    ),
    ErrorCode.upload_offset_mismatch: _Kind(
        409,
        "conflict_error",
        "a piece of an upload sent at an offset that is not where the upload stands "
        "(`Upload-Offset` in the answer says where)",
    ),
    ErrorCode.upload_closed: _Kind(
        409,
        "conflict_error",
        "a piece of an upload that takes no more (being checked or applied, applied, "
        "failed), a cancel of one being applied, or an upload begun while too many are open",
    ),
    ErrorCode.peer_ticket_refused: _Kind(
        403,
        "permission_error",
        "a file asked of a node by another of its site without the hub's ticket for it, or "
        "with one not the hub's, for another file or site, or expired",
    ),
    ErrorCode.artifact_fetching: _Kind(
        409,
        "conflict_error",
        "a file asked of a node that is fetching it itself: ask again later (Retry-After)",
    ),
    ErrorCode.network_not_managed: _Kind(
        409,
        "conflict_error",
        "the node's network is not the image's to set (no network agent: not the appliance image)",
    ),
    ErrorCode.network_trial: _Kind(
        409,
        "conflict_error",
        "a network change is being tried (confirm it, or wait until it is rolled back), or "
        "the confirmation names no change on trial",
    ),
    ErrorCode.account_not_found: _Kind(404, "not_found_error", "no account by that name"),
    ErrorCode.key_not_found: _Kind(404, "not_found_error", "no API key with that prefix"),
    ErrorCode.account_exists: _Kind(
        409, "conflict_error", "an account of that name exists already (disabled or not)"
    ),
    ErrorCode.account_disabled: _Kind(
        409, "conflict_error", "the account was disabled: it gets no new keys"
    ),
    ErrorCode.last_admin_key: _Kind(
        409,
        "conflict_error",
        "the change would leave the node without an active admin key; make another first",
    ),
    ErrorCode.hub_managed: _Kind(
        409,
        "conflict_error",
        "the node's accounts and keys come from its hub: change them there, not on the node",
    ),
    ErrorCode.outbox_full: _Kind(
        503,
        "server_error",
        "the appliance holds `fleet.outbox_limit_events` usage events the hub has not yet "
        "acknowledged; it takes new work once the hub is back",
    ),
    ErrorCode.insufficient_memory: _Kind(
        503,
        "server_error",
        "the model does not fit the memory budget, even with every idle model unloaded",
    ),
    ErrorCode.shutting_down: _Kind(
        503,
        "server_error",
        "the server is stopping: the connection closes, and a new one reaches the server "
        "that follows it",
    ),
    ErrorCode.internal_error: _Kind(500, "server_error", "a bug; the request id is in the log"),
}


class DomainError(Exception):
    """What went wrong, in the words of the service that found it.

    The services below the HTTP and gRPC layers (inference, jobs, packages, quotas) raise
    these and never an HTTP status: each concrete class names its stable `code`, and an
    error carries what an answer needs besides its message, the `param` at fault and, for
    a refusal for now, `retry_after` in seconds. The gateway (appliance/gateway/errors.py)
    and the gRPC server (appliance/grpc/errors.py) map them, each in one place.
    """

    code: ErrorCode  # each concrete class's own; the abstract groups below have none

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


# -- the request is wrong: the same request fails again --------------------------------------


class InvalidRequest(DomainError):
    """A field has the wrong type or is out of range; `param` names it."""

    code = ErrorCode.invalid_value


class MissingParameter(InvalidRequest):
    code = ErrorCode.missing_required_parameter


class UnknownParameter(InvalidRequest):
    """A field this API does not know (with `server.strict_parameters` on)."""

    code = ErrorCode.unknown_parameter


class UnsupportedParameter(InvalidRequest):
    """An OpenAI parameter, or a value of one, that the appliance does not support."""

    code = ErrorCode.unsupported_parameter


class InvalidSchema(InvalidRequest):
    """A JSON Schema (a response format's, a tool's parameters) no grammar can enforce."""

    code = ErrorCode.invalid_schema


class ContextTooLong(InvalidRequest):
    """The prompt and the tokens asked for do not fit the model's context."""

    code = ErrorCode.context_length_exceeded


class PromptTooLongForClass(InvalidRequest):
    """No wait would bring the prompt's first token within its class's objective on this
    node: not retryable, unlike Overloaded."""

    code = ErrorCode.prompt_too_long_for_class


class MissingApiKey(DomainError):
    code = ErrorCode.missing_api_key


class InvalidApiKey(DomainError):
    code = ErrorCode.invalid_api_key


class RevokedApiKey(DomainError):
    code = ErrorCode.revoked_api_key


class ModelNotFound(DomainError):
    code = ErrorCode.model_not_found


class JobNotFound(DomainError):
    code = ErrorCode.job_not_found


class ResponseNotFound(DomainError):
    code = ErrorCode.response_not_found


class AccountNotFound(DomainError):
    code = ErrorCode.account_not_found


class KeyNotFound(DomainError):
    code = ErrorCode.key_not_found


class AccountExists(DomainError):
    code = ErrorCode.account_exists


class AccountDisabled(DomainError):
    code = ErrorCode.account_disabled


class LastAdminKey(DomainError):
    """The change would leave the node without an active admin key."""

    code = ErrorCode.last_admin_key


class HubManaged(DomainError):
    """The node's accounts and keys are its hub's to change."""

    code = ErrorCode.hub_managed


class JobFinished(DomainError):
    code = ErrorCode.job_finished


class OutputInvalid(DomainError):
    """The output does not satisfy the requested response format (it fails closed)."""

    code = ErrorCode.output_validation_failed


class PackageInvalid(DomainError):
    """A content package failed its checks."""

    code = ErrorCode.package_validation_failed


# -- not now: the same request may pass later ------------------------------------------------


class TryLater(DomainError):
    """A refusal for now, for load or a limit: ask again after `retry_after` seconds."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)


class QueueFull(TryLater):
    code = ErrorCode.queue_full


class Overloaded(TryLater):
    """The request cannot meet its service class's objectives now (refused at the door,
    or dropped from the queue)."""

    code = ErrorCode.overloaded


class AccountLimit(TryLater):
    """The account is over a limit of its own (its rate, its allowance): its requests
    wait, other accounts' do not."""


class RateLimited(AccountLimit):
    code = ErrorCode.rate_limit_exceeded


class QuotaExhausted(AccountLimit):
    """The account's allowance is spent until `retry_after`."""

    code = ErrorCode.insufficient_quota


class TooManyAuthFailures(TryLater):
    code = ErrorCode.too_many_auth_failures


class NodeFault(DomainError):
    """The node failed a request, not the request the node: a model not there, a bug."""


class Unavailable(NodeFault):
    """The node cannot serve it now (a model loading or restarting, out of memory, the
    outbox full); `retry_after` when it knows when to ask again."""


class ModelNotReady(Unavailable):
    code = ErrorCode.model_not_ready


class ModelUnavailable(Unavailable):
    code = ErrorCode.model_unavailable


class InsufficientMemory(Unavailable):
    code = ErrorCode.insufficient_memory


class OutboxFull(Unavailable):
    """The usage ledger waits for the hub: no new work until it has acknowledged some."""

    code = ErrorCode.outbox_full


class ShuttingDown(Unavailable):
    """The server stopped taking work (its store is closed) while a connection kept
    alive from before still sent a request."""

    code = ErrorCode.shutting_down


class InternalError(NodeFault):
    """A bug, or a tool the node runs that failed it."""

    code = ErrorCode.internal_error


class ApiError(DomainError):
    """An HTTP API's own refusal, its code named where it is raised: a body that is not
    JSON, a route that is the hub's to call, and the hub's API throughout.

    Only the HTTP layers raise it (a test checks the appliance's services never do); the
    gateway turns a service's DomainError into one (appliance/gateway/errors.py), and
    the middleware serializes it.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, param=param, retry_after=retry_after)
        self.code = code

    @property
    def status(self) -> int:
        return self.code.status

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, param=self.param)

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.code is ErrorCode.insufficient_quota:
            # OpenAI's SDKs retry every 429 unless told: a spent allowance is hours away.
            out["x-should-retry"] = "false"
        if self.retry_after is not None:
            # Retry-After takes whole seconds; round up so a client never retries early.
            out["Retry-After"] = str(max(1, int(-(-self.retry_after // 1))))
        return out


def error_body(code: ErrorCode, message: str, *, param: str | None = None) -> dict[str, Any]:
    """The error shape. Every error response body in the project comes from here."""
    return {"error": {"message": message, "type": code.type, "param": param, "code": code.value}}


# The error shape as JSON Schema, for the OpenAPI documents of both APIs.
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string", "enum": [c.value for c in ErrorCode]},
            },
        }
    },
}
