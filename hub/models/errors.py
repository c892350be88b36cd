"""Why a pull failed, in words an operator can act on, with a kind the operator API maps
to its error code."""

from __future__ import annotations

from typing import Literal

PullErrorKind = Literal[
    "not_found",  # no such repository, revision or file
    "gated",  # the repository needs a token that was not given, or not accepted
    "no_quantisation",  # no GGUF file of that quantisation (the message lists those there are)
    "unsupported",  # a file the hub cannot keep as a model
    "too_large",  # over the bound the settings set
    "disk_full",  # not room enough in the hub's data directory
    "checksum_mismatch",  # the bytes are not the ones the repository lists
    "unavailable",  # the source failed, refused, rate limited or cut us off too often
    "cancelled",
]


class PullError(Exception):
    def __init__(self, kind: PullErrorKind, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s
