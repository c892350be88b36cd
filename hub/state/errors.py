"""The errors any repository of the hub's store raises (the others are their aggregate's:
`TokenRefusedError` in hub/state/tokens.py, `NameTakenError` in hub/state/certificates.py,
…)."""

from __future__ import annotations


class ConflictError(ValueError):
    """The thing exists already."""


class NotFoundError(LookupError):
    """Nothing by that name or id. `param`: the field of the caller's request that named
    it, where one did (the model of a deployment, the account of a key)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidError(ValueError):
    """A value the store does not take (a key it does not know, a value out of bounds).
    `param`: the field of the caller's request that holds it."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
