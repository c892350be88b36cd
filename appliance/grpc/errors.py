"""The one error shape, in gRPC's terms, and the one place the gRPC API maps a domain
error (shared.errors.DomainError): it becomes a status code (by its code), its message
the status details, and trailing metadata that says what the REST API's body and headers
say.

Trailing metadata of a failed call:
    kvl-error-code     the stable error code (`queue_full`, `invalid_value`, …)
    kvl-error-param    the parameter at fault, when there is one
    retry-after        whole seconds to wait before retrying, when known (as the header)
    x-request-id       the call's request id (in the log of an internal error)
    grpc-status-details-bin
                       google.rpc.Status with an ErrorInfo (reason: the code, domain
                       `kovenlab.edge`) and, with a retry time, a RetryInfo: the rich
                       error model that Google's client libraries read
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

if TYPE_CHECKING:
    from shared.errors import DomainError, ErrorCode

DOMAIN = "kovenlab.edge"

# By the REST status of the code: the mapping of Google's API guidelines (google.rpc.Code).
_BY_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,  # no REST route answers gRPC; for completeness
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    # The output failed its response_format (422): the arguments were valid, the
    # state of the generation was not (stopped at max_tokens, say).
    422: grpc.StatusCode.FAILED_PRECONDITION,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}


def status_code(code: ErrorCode) -> grpc.StatusCode:
    return _BY_STATUS.get(code.status, grpc.StatusCode.UNKNOWN)


def retry_seconds(err: DomainError) -> int | None:
    """Whole seconds, rounded up (as `Retry-After`): a client never retries early."""
    if err.retry_after is None:
        return None
    return max(1, math.ceil(err.retry_after))


def trailing_metadata(err: DomainError, request_id: str) -> tuple[tuple[str, str | bytes], ...]:
    metadata: list[tuple[str, str | bytes]] = [
        ("kvl-error-code", err.code.value),
        ("x-request-id", request_id),
    ]
    if err.param is not None:
        metadata.append(("kvl-error-param", err.param))
    info = error_details_pb2.ErrorInfo(reason=err.code.value, domain=DOMAIN)
    if err.param is not None:
        info.metadata["param"] = err.param
    details = [_packed(info)]
    if (seconds := retry_seconds(err)) is not None:
        metadata.append(("retry-after", str(seconds)))
        retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds))
        details.append(_packed(retry))
    status = status_pb2.Status(
        code=status_code(err.code).value[0], message=err.message, details=details
    )
    metadata.append(("grpc-status-details-bin", status.SerializeToString()))
    return tuple(metadata)


def _packed(message: error_details_pb2.ErrorInfo | error_details_pb2.RetryInfo) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
