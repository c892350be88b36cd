"""Who may use the console: argon2id passwords, session tokens stored as hashes, CSRF
checks and a per-address backoff after failed logins. No aiohttp here beyond reading
a request's headers, so the CLI imports it cheaply."""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

if TYPE_CHECKING:
    from collections.abc import Mapping

# `__Host-`: the browser keeps them only when Secure, for Path=/ and without Domain.
SESSION_COOKIE = "__Host-kvl-console"
LOGIN_COOKIE = "__Host-kvl-login"  # the CSRF token of the login form, before a session
MIN_PASSWORD = 10
MAX_PASSWORD = 1024  # argon2 takes any length; a bound keeps a huge form field cheap

_HASHER = PasswordHasher()  # argon2id, the library's current defaults


@functools.cache
def _dummy_hash() -> str:
    """Verified when the name is unknown, so a wrong name costs as long as a wrong password."""
    return _HASHER.hash(secrets.token_urlsafe(16))


class PasswordRefusedError(ValueError):
    """The password is not acceptable (the message says why)."""


def hash_password(password: str) -> str:
    if len(password) < MIN_PASSWORD:
        raise PasswordRefusedError(f"a console password has at least {MIN_PASSWORD} characters")
    if len(password) > MAX_PASSWORD:
        raise PasswordRefusedError(f"a console password has at most {MAX_PASSWORD} characters")
    return _HASHER.hash(password)


def verify_password(stored: str | None, password: str) -> bool:
    """Whether `password` matches the stored hash (None: an unknown user, always False,
    after as much work as a real check)."""
    if len(password) > MAX_PASSWORD:
        return False
    try:
        _HASHER.verify(stored or _dummy_hash(), password)  # raises unless it matches
    except (VerificationError, InvalidHashError):
        return False
    return stored is not None


def needs_rehash(stored: str) -> bool:
    """The hash was made with weaker parameters than the current ones."""
    return _HASHER.check_needs_rehash(stored)


@dataclass(frozen=True)
class NewSession:
    token: str  # the cookie's value, never stored
    id_hash: str  # what the store keeps
    csrf: str


def new_session() -> NewSession:
    token = secrets.token_urlsafe(32)
    return NewSession(token, session_hash(token), secrets.token_urlsafe(32))


def session_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_csrf() -> str:
    return secrets.token_urlsafe(32)


def same_token(given: str | None, expected: str | None) -> bool:
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def same_origin(headers: Mapping[str, str], scheme: str, host: str) -> bool:
    """Whether a state-changing request came from a page of this console: its `Origin`
    (or, without one, its `Referer`) names this scheme and host. Neither: refused, since
    every browser this console supports sends `Origin` with a form post."""
    origin = headers.get("Origin")
    source = origin if origin and origin != "null" else headers.get("Referer")
    if not source:
        return False
    parts = urlsplit(source)
    return parts.scheme == scheme and parts.netloc.lower() == host.lower()


class LoginThrottle:
    """Failed logins per address: after `allowed` of them the address waits
    `first_wait_s`, doubled with each further failure up to `max_wait_s`. A success clears
    the address. In memory: a restarted hub forgets, which costs an attacker a restart
    they cannot cause.

    An attempt is counted from the moment it is let through, not from when its password
    check (argon2, in a thread) says it failed: `wait_s` answering 0 admits one attempt,
    which `failed` or `succeeded` then settles. Otherwise many attempts sent at once would
    all pass the check before the first of them was recorded. An admitted attempt that is
    never settled (its request died) counts as failed after `settle_s`."""

    def __init__(
        self,
        allowed: int,
        *,
        first_wait_s: float = 30.0,
        max_wait_s: float = 900.0,
        max_addresses: int = 10_000,
        settle_s: float = 60.0,
    ) -> None:
        self._allowed = allowed
        self._first = first_wait_s
        self._max = max_wait_s
        self._max_addresses = max_addresses
        self._settle_s = settle_s
        self._addresses: dict[str, _Attempts] = {}  # oldest first

    def wait_s(self, address: str, now: float) -> float:
        """Seconds the address must still wait before it may try again; 0: it may, and
        this attempt is admitted (settle it with `failed` or `succeeded`)."""
        state = self._addresses.get(address)
        if state is None:
            state = self._remember(address, _Attempts())
        while state.trying and state.trying[0] <= now - self._settle_s:
            state.trying.pop(0)
            self._fail(state, now)  # admitted long ago and never settled: a failure
        if state.blocked_until > now:
            return state.blocked_until - now
        # What is left of the allowance, and past it one try at a time once each wait is
        # over: the attempts still being checked use it up as if they had failed already.
        if len(state.trying) >= max(1, self._allowed - state.failures):
            pending = state.failures + len(state.trying) - self._allowed
            return min(self._max, self._first * 2.0 ** max(0, pending))
        state.trying.append(now)
        return 0.0

    def failed(self, address: str, now: float) -> None:
        state = self._addresses.pop(address, None) or _Attempts()
        if state.trying:
            state.trying.pop(0)
        self._fail(state, now)
        self._remember(address, state)  # re-inserted: the dict stays oldest first

    def succeeded(self, address: str) -> None:
        self._addresses.pop(address, None)

    def _fail(self, state: _Attempts, now: float) -> None:
        state.failures += 1
        if state.failures >= self._allowed:
            wait = min(self._max, self._first * 2.0 ** (state.failures - self._allowed))
            state.blocked_until = max(state.blocked_until, now + wait)

    def _remember(self, address: str, state: _Attempts) -> _Attempts:
        self._addresses[address] = state
        while len(self._addresses) > self._max_addresses:
            del self._addresses[next(iter(self._addresses))]
        return state


@dataclass
class _Attempts:
    failures: int = 0
    blocked_until: float = 0.0
    trying: list[float] = field(default_factory=list)  # when each unsettled one was let in
