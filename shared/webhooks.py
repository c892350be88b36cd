"""Signed webhooks: the sender's `sign`, and `verify` and `ReplayGuard` for receivers.

A delivery is a POST whose JSON body is signed with the account's webhook secret:

    Kvl-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">
    Kvl-Delivery: <delivery id>

(Stripe's scheme.) While a rotated secret is still in its grace period, the header holds one
`v1=` per secret, and any one of them verifies. A receiver checks the signature over the raw
body bytes as received, refuses timestamps more than `tolerance_s` away from its clock (a
captured request cannot be replayed later), and deduplicates on the delivery id, which stays
the same on every retry:

    verify(secret, body, request.headers[SIGNATURE_HEADER])
    if guard.admit(request.headers[DELIVERY_HEADER]):
        ...  # the effect, once

Senders log a webhook's URL as `redact_url` gives it: without the userinfo, query and
fragment, where a URL's owner may have put a credential.

No aiohttp or appliance import here: receivers vendor or import this module alone.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

SIGNATURE_HEADER = "Kvl-Signature"
DELIVERY_HEADER = "Kvl-Delivery"
SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300.0
# Unix seconds of any real clock fit in far fewer digits; a bound keeps `int()` cheap and the
# arithmetic with a float clock exact (below 2**53), whatever a sender writes.
MAX_TIMESTAMP_DIGITS = 15


class WebhookVerificationError(Exception):
    """The request is not a genuine, fresh delivery; answer it with 400 and do nothing."""


class MalformedSignatureError(WebhookVerificationError):
    """The signature header is missing or cannot be read (no `t=`, no `v1=`)."""


class MalformedTimestampError(MalformedSignatureError):
    """The header's `t=` is missing, repeated, or not unix seconds as 1 to 15 ASCII digits
    (a sign, a fraction, `nan`, a huge number): refused before any arithmetic on it."""


class SignatureMismatchError(WebhookVerificationError):
    """No `v1=` signature matches the body under this secret: a changed body, or another secret."""


class TimestampTooOldError(WebhookVerificationError):
    """The signature is older than the tolerance: a late replay of a captured request."""


class TimestampInFutureError(WebhookVerificationError):
    """The signature is dated beyond the tolerance into the future."""


def _digest(secret: str, body: bytes, timestamp: int) -> str:
    message = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp: int, *, previous_secrets: Iterable[str] = ()) -> str:
    """The `Kvl-Signature` header value for `body` sent at `timestamp` (unix seconds).

    `previous_secrets` add one `v1=` each, so that receivers still holding a rotated secret
    keep verifying during its grace period.
    """
    signatures = [_digest(s, body, timestamp) for s in (secret, *previous_secrets)]
    return ",".join([f"t={timestamp}", *(f"{SCHEME}={sig}" for sig in signatures)])


def verify(
    secret: str,
    body: bytes | str,
    header: str | None,
    *,
    now: float | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> None:
    """Check a delivery; raise a :class:`WebhookVerificationError` subclass if it fails.

    `body` is the raw request body (bytes as received: parse the JSON only after this).
    """
    timestamp, signatures = _parse(header)
    raw = body.encode() if isinstance(body, str) else body
    expected = _digest(secret, raw, timestamp)
    # Every entry is compared in constant time; which one matched reveals nothing secret.
    if not any(hmac.compare_digest(expected, sig) for sig in signatures):
        raise SignatureMismatchError("no v1 signature matches the body under this secret")
    current = time.time() if now is None else now
    if current - timestamp > tolerance_s:
        raise TimestampTooOldError(
            f"the signature is {current - timestamp:.0f} s old; at most {tolerance_s:.0f} s "
            "is accepted"
        )
    if timestamp - current > tolerance_s:
        raise TimestampInFutureError(
            f"the signature is dated {timestamp - current:.0f} s in the future; check the clocks"
        )


def _parse(header: str | None) -> tuple[int, list[str]]:
    if not header:
        raise MalformedSignatureError(f"no {SIGNATURE_HEADER} header")
    timestamps: list[str] = []
    signatures: list[str] = []
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep:
            raise MalformedSignatureError(f"{part.strip()!r} is not `key=value`")
        if key == "t":
            timestamps.append(value)
        elif key == SCHEME:
            signatures.append(value)
        # Other schemes (a later v2) are skipped, so senders can add one without breaking us.
    if len(timestamps) != 1:
        raise MalformedTimestampError("the header needs exactly one `t=<unix seconds>`")
    text = timestamps[0]
    # isdigit() alone takes other scripts' digits and superscripts; int() takes signs,
    # spaces and underscores: only plain ASCII digits are unix seconds here.
    if not 0 < len(text) <= MAX_TIMESTAMP_DIGITS or not all("0" <= c <= "9" for c in text):
        raise MalformedTimestampError(
            f"`t=` must be unix seconds: 1 to {MAX_TIMESTAMP_DIGITS} ASCII digits"
        )
    if not signatures:
        raise MalformedSignatureError(f"the header has no `{SCHEME}=` signature")
    return int(text), signatures


class ReplayGuard:
    """One effect per delivery id: `admit` is True the first time an id is seen, False after.

    Ids are remembered for `window_s` (by default the verification tolerance, the longest a
    captured request stays valid). The sender retries an undelivered webhook, with the same
    id, for hours; to deduplicate those retries across a restart of the receiver, also keep
    the ids of effects done in the receiver's own database (a unique column).
    """

    def __init__(
        self, window_s: float = DEFAULT_TOLERANCE_S, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, delivery_id: str) -> bool:
        """True the first time `delivery_id` is seen within the window: do the effect then."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            if delivery_id in self._seen:
                return False
            self._seen[delivery_id] = now
            return True

    def release(self, delivery_id: str) -> None:
        """The effect of an admitted delivery failed: let the sender's retry through."""
        with self._lock:
            self._seen.pop(delivery_id, None)

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._seen)

    def _expire(self, now: float) -> None:
        # Insertion order is time order, so the expired ids are at the front.
        while self._seen:
            first, seen_at = next(iter(self._seen.items()))
            if now - seen_at < self._window_s:
                break
            del self._seen[first]


# -- URLs in logs -------------------------------------------------------------------------------

# What stands for a part of a URL a log leaves out.
REDACTED = "***"
# A URL inside free text (an exception's message or repr): a scheme, `://`, then anything
# up to white space or a quote, which end a URL in a message or a repr.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:(?=//)")
# Control characters would let a URL start a forged line of the log.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def redact_url(url: str) -> str:
    """`url` as a log or an operator may see it: scheme, host, port and path, with its
    userinfo, query and fragment each replaced by `***` (`https://***@host:8443/hook?***`).

    A webhook URL is its owner's: `user:password@` and `?token=` are common ways to carry a
    credential in one, and a log travels further than the URL's owner meant it to (a
    node's log to the hub's operators). Anything is taken and nothing raises. A malformed
    URL is cut where the HTTP client's parser (yarl, as urllib) cuts it, or earlier: the
    query from the first `?`, the fragment from the first `#`, the authority up to the
    first `/` after `//` and its userinfo up to the authority's last `@`; a port that is
    not digits (a password read as a port) is left out too.
    """
    text = _CONTROL.sub(lambda m: f"%{ord(m.group()):02X}", str(url).strip())
    cut = min((i for i in (text.find("?"), text.find("#")) if i >= 0), default=len(text))
    base, tail = text[:cut], text[cut:]
    query, hashed, fragment = tail.partition("#")  # the query, if any, comes first
    tail = (query and _redacted("?", query[1:])) + (hashed and _redacted("#", fragment))
    scheme = _SCHEME.match(base)
    prefix = f"{scheme.group()}//" if scheme else ("//" if base.startswith("//") else "")
    # Without `//`, whatever comes first is read as an authority: `user:pw@host/hook`
    # keeps no password either.
    rest = base[len(prefix) :]
    authority, slash, path = rest.partition("/")
    _, at, hostport = authority.rpartition("@")
    return f"{prefix}{REDACTED + '@' if at else ''}{_host_port(hostport)}{slash}{path}{tail}"


def _redacted(mark: str, part: str) -> str:
    return f"{mark}{REDACTED}" if part else mark  # an empty one hides nothing


def _host_port(hostport: str) -> str:
    if hostport.startswith("["):  # an IPv6 literal: its colons are no port's
        host, bracket, after = hostport.partition("]")
        if not bracket:
            return hostport
        host += bracket
        if not after:
            return host
        colon, port = after[:1], after[1:]
    else:
        host, colon, port = hostport.partition(":")
    if colon != ":":
        return host if not colon else f"{host}{REDACTED}"
    if port and not (port.isascii() and port.isdigit()):
        port = REDACTED
    return f"{host}:{port}"


def redact_urls(text: str) -> str:
    """`text` (an exception's message or repr) with every URL in it as :func:`redact_url`
    gives it."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group()), str(text))
