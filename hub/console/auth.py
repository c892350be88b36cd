"""Who may use the console: argon2id passwords, session tokens stored as hashes, CSRF
checks and a backoff after failed logins, per source and per account. No aiohttp here
beyond reading a request's headers, so the CLI imports it cheaply."""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
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
    """Failed logins, counted per source and per account: after `allowed` failures the
    source, or the account, waits `first_wait_s`, doubled with each further failure up to
    `max_wait_s`; an attempt waits for the longer of the two. A success clears the
    source's count, and the account's when it came from a new place (its owner's typos).

    A source is an IPv4 address or an IPv6 /64 (`source_key`): one host is commonly given
    a whole /64, and counting its addresses apart would give it 2**64 allowances. The
    account is the name tried, whether or not a user has it, so that a throttled name says
    nothing of which names exist.

    The count per account stops guesses spread over many sources (a botnet). Its price:
    such an attacker, failing against a name, makes a real operator of that name wait too.
    What bounds the price: a source that has logged in to the account before is neither
    held back by the account's count nor adds to it nor clears it (its own count still
    applies), so an operator at a usual desk logs in during an attack while the attacker's
    count stands; elsewhere, the account's wait ends at most `max_wait_s` after the
    attacker's last failure; a restart of the hub clears it; and the CLI and the operator
    API, which take no console password, work throughout.

    In memory: a restarted hub forgets, which costs an attacker a restart they cannot
    cause. Each table keeps at most `max_keys` keys, dropping the one whose last failure is
    oldest; pushing an account out takes `max_keys` failed logins under other names after
    the last one against it, each a password check, to win `allowed` more guesses.

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
        max_keys: int = 10_000,
        settle_s: float = 60.0,
        known_per_account: int = 16,
    ) -> None:
        self._sources = _Backoff(allowed, first_wait_s, max_wait_s, max_keys, settle_s)
        self._accounts = _Backoff(allowed, first_wait_s, max_wait_s, max_keys, settle_s)
        self._max_keys = max_keys
        self._known_per_account = known_per_account
        # Per account, the sources that logged in to it, the latest last: only names that
        # are real accounts get here (a success), oldest account dropped first.
        self._known: dict[str, dict[str, None]] = {}

    def wait_s(self, address: str, now: float, *, account: str | None = None) -> float:
        """Seconds before a login from `address` as `account` (None: counted per source
        alone) may be tried; 0: it may, and this attempt is admitted (settle it with
        `failed` or `succeeded`, given the same account)."""
        source = source_key(address)
        # The account's count, unless this source logged in to it before.
        counted = None if account is None or self._is_known(source, account) else account
        wait = self._sources.wait_s(source, now)
        if counted is not None:
            wait = max(wait, self._accounts.wait_s(counted, now))
        if wait > 0:
            return wait  # nothing is remembered of a refused attempt: it costs no memory
        self._sources.admit(source, now)
        if counted is not None:
            self._accounts.admit(counted, now)
        return 0.0

    def failed(self, address: str, now: float, *, account: str | None = None) -> None:
        source = source_key(address)
        self._sources.failed(source, now)
        # A source known to the account was not admitted against its count. (One that
        # became known while this attempt was checked leaves it unsettled: one failure
        # more, after settle_s.)
        if account is not None and not self._is_known(source, account):
            self._accounts.failed(account, now)

    def succeeded(self, address: str, *, account: str | None = None) -> None:
        source = source_key(address)
        self._sources.forget(source)
        if account is None:
            return
        if not self._is_known(source, account):
            self._accounts.forget(account)
        known = self._known.pop(account, None) or {}
        known.pop(source, None)
        known[source] = None
        while len(known) > self._known_per_account:
            del known[next(iter(known))]
        self._known[account] = known  # re-inserted: the dict stays oldest first
        while len(self._known) > self._max_keys:
            del self._known[next(iter(self._known))]

    def _is_known(self, source: str, account: str) -> bool:
        return source in self._known.get(account, ())


def source_key(address: str) -> str:
    """What the throttle counts a client address under: an IPv4 address itself (an
    IPv4-mapped IPv6 address as its IPv4 one), an IPv6 address's /64, anything else (no
    address: a Unix socket, "unknown") as it is."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])  # without an IPv6 zone
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Backoff:
    """Failures per key, each key's backoff, and the attempts admitted and not yet settled."""

    def __init__(
        self, allowed: int, first_wait_s: float, max_wait_s: float, max_keys: int, settle_s: float
    ) -> None:
        self._allowed = allowed
        self._first = first_wait_s
        self._max = max_wait_s
        self._max_keys = max_keys
        self._settle_s = settle_s
        self._keys: dict[str, _Attempts] = {}  # oldest first

    def wait_s(self, key: str, now: float) -> float:
        """Seconds the key must still wait; 0: an attempt may be admitted (`admit`)."""
        state = self._keys.get(key)
        if state is None:
            return 0.0
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
        return 0.0

    def admit(self, key: str, now: float) -> None:
        state = self._keys.get(key)
        if state is None:
            state = self._remember(key, _Attempts())
        state.trying.append(now)

    def failed(self, key: str, now: float) -> None:
        state = self._keys.pop(key, None) or _Attempts()
        if state.trying:
            state.trying.pop(0)
        self._fail(state, now)
        self._remember(key, state)  # re-inserted: the dict stays oldest first

    def forget(self, key: str) -> None:
        self._keys.pop(key, None)

    def _fail(self, state: _Attempts, now: float) -> None:
        state.failures += 1
        if state.failures >= self._allowed:
            wait = min(self._max, self._first * 2.0 ** (state.failures - self._allowed))
            state.blocked_until = max(state.blocked_until, now + wait)

    def _remember(self, key: str, state: _Attempts) -> _Attempts:
        self._keys[key] = state
        while len(self._keys) > self._max_keys:
            del self._keys[next(iter(self._keys))]
        return state


@dataclass
class _Attempts:
    failures: int = 0
    blocked_until: float = 0.0
    trying: list[float] = field(default_factory=list)  # when each unsettled one was let in
