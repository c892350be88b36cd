"""Webhook signatures: what a receiver accepts, what it refuses, and one effect per delivery."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.webhooks import (
    MalformedSignatureError,
    MalformedTimestampError,
    ReplayGuard,
    SignatureMismatchError,
    TimestampInFutureError,
    TimestampTooOldError,
    WebhookVerificationError,
    sign,
    verify,
)

SECRET = "whsec_test-secret"
NOW = 1_800_000_000
BODY = json.dumps({"id": "dlv_1", "type": "job.completed", "data": {"id": "job_1"}}).encode()


def test_a_signed_body_verifies() -> None:
    header = sign(SECRET, BODY, NOW)
    assert header.startswith(f"t={NOW},v1=")
    verify(SECRET, BODY, header, now=NOW)
    verify(SECRET, BODY.decode(), header, now=NOW)  # the same text as str


def test_the_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    """The documented scheme, computed independently, so receivers in any language agree."""
    expected = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert sign(SECRET, BODY, NOW) == f"t={NOW},v1={expected}"


def test_a_tampered_body_is_refused() -> None:
    header = sign(SECRET, BODY, NOW)
    tampered = BODY.replace(b"job.completed", b"job.cancelled")
    with pytest.raises(SignatureMismatchError):
        verify(SECRET, tampered, header, now=NOW)


def test_a_wrong_secret_is_refused() -> None:
    header = sign("whsec_someone-else", BODY, NOW)
    with pytest.raises(SignatureMismatchError):
        verify(SECRET, BODY, header, now=NOW)


def test_a_changed_timestamp_is_refused() -> None:
    signature = sign(SECRET, BODY, NOW).partition(",")[2]
    with pytest.raises(SignatureMismatchError):
        verify(SECRET, BODY, f"t={NOW + 1},{signature}", now=NOW)


def test_a_timestamp_more_than_five_minutes_old_is_refused() -> None:
    verify(SECRET, BODY, sign(SECRET, BODY, NOW - 300), now=NOW)  # the edge is still fresh
    with pytest.raises(TimestampTooOldError):
        verify(SECRET, BODY, sign(SECRET, BODY, NOW - 301), now=NOW)


def test_a_timestamp_in_the_future_is_refused() -> None:
    verify(SECRET, BODY, sign(SECRET, BODY, NOW + 300), now=NOW)  # clock skew within tolerance
    with pytest.raises(TimestampInFutureError):
        verify(SECRET, BODY, sign(SECRET, BODY, NOW + 301), now=NOW)


def test_the_tolerance_is_the_receivers_choice() -> None:
    header = sign(SECRET, BODY, NOW - 60)
    with pytest.raises(TimestampTooOldError):
        verify(SECRET, BODY, header, now=NOW, tolerance_s=30)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "v1=abc",  # no timestamp
        f"t={NOW}",  # no signature
        f"t={NOW},t={NOW},v1=abc",  # two timestamps
        f"t=soon,v1={'0' * 64}",
        f"t=-{NOW},v1={'0' * 64}",
        f"t={NOW},v1",  # not key=value
        f"t=١٢٣,v1={'0' * 64}",  # digits, but not ASCII ones
    ],
)
def test_a_malformed_header_is_refused(header: str | None) -> None:
    with pytest.raises(MalformedSignatureError):
        verify(SECRET, BODY, header, now=NOW)


@pytest.mark.parametrize(
    "timestamp",
    [
        None,  # missing
        "",
        "soon",
        "nan",
        "NaN",
        "inf",
        "1e9",
        "1800000000.5",
        "+1800000000",
        "1_800_000_000",
        " 1800000000",
        "²",  # a digit to str.isdigit(), not to int()
        "9" * 16,  # past any clock, and past exact float arithmetic
        "9" * 5000,  # past int()'s own limit on digits: it would raise ValueError
    ],
)
def test_a_malformed_timestamp_has_its_own_error(timestamp: str | None) -> None:
    signature = f"v1={'0' * 64}"
    header = signature if timestamp is None else f"t={timestamp},{signature}"
    with pytest.raises(MalformedTimestampError):
        verify(SECRET, BODY, header, now=NOW)


def test_a_huge_timestamp_signed_with_the_secret_is_still_malformed() -> None:
    """A sender holding the secret signs any `t`: a huge one is refused, not an
    OverflowError from the clock arithmetic."""
    with pytest.raises(MalformedTimestampError):
        verify(SECRET, BODY, sign(SECRET, BODY, 10**400), now=NOW)
    header = sign(SECRET, BODY, NOW)
    with pytest.raises(MalformedTimestampError):
        verify(SECRET, BODY, header.replace(f"t={NOW}", f"t={NOW},t={NOW}"), now=NOW)


def test_every_failure_is_a_verification_error() -> None:
    for error in (
        MalformedSignatureError,
        MalformedTimestampError,
        SignatureMismatchError,
        TimestampTooOldError,
        TimestampInFutureError,
    ):
        assert issubclass(error, WebhookVerificationError)


def test_during_rotation_either_secret_verifies() -> None:
    header = sign("whsec_new", BODY, NOW, previous_secrets=["whsec_old"])
    assert header.count("v1=") == 2
    verify("whsec_new", BODY, header, now=NOW)
    verify("whsec_old", BODY, header, now=NOW)
    with pytest.raises(SignatureMismatchError):
        verify("whsec_other", BODY, header, now=NOW)


def test_unknown_schemes_are_ignored() -> None:
    """A later scheme (v2) beside v1 does not break receivers of this version."""
    header = sign(SECRET, BODY, NOW) + ",v2=whatever"
    verify(SECRET, BODY, header, now=NOW)


@given(
    secret=st.text(min_size=1, max_size=40),
    body=st.binary(max_size=512),
    timestamp=st.integers(min_value=0, max_value=2**40),
    flip=st.integers(min_value=0),
)
def test_property_round_trip_and_any_flipped_byte(
    secret: str, body: bytes, timestamp: int, flip: int
) -> None:
    header = sign(secret, body, timestamp)
    verify(secret, body, header, now=timestamp)
    if body:
        at = flip % len(body)
        changed = body[:at] + bytes([body[at] ^ 0x01]) + body[at + 1 :]
        with pytest.raises(SignatureMismatchError):
            verify(secret, changed, header, now=timestamp)


class FakeClock:
    """A clock the test moves (the guard's window is time-based)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_replay_guard_admits_each_delivery_once_within_its_window() -> None:
    clock = FakeClock()
    guard = ReplayGuard(300, clock=clock)
    assert guard.admit("dlv_1")
    assert not guard.admit("dlv_1")
    assert guard.admit("dlv_2")
    clock.now = 299
    assert not guard.admit("dlv_1")
    clock.now = 301  # dlv_1 was seen 301 s ago, dlv_2 too: both forgotten
    assert len(guard) == 0
    assert guard.admit("dlv_1")


def test_replay_guard_lets_a_retry_through_after_a_failed_effect() -> None:
    guard = ReplayGuard()
    assert guard.admit("dlv_1")
    guard.release("dlv_1")  # the receiver's effect failed; it answers 500
    assert guard.admit("dlv_1")  # the sender's retry is done once
    assert not guard.admit("dlv_1")


@given(st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=30))
def test_property_replay_guard_gives_one_effect_per_id(ids: list[str]) -> None:
    guard = ReplayGuard()
    effects = [delivery for delivery in ids if guard.admit(delivery)]
    assert sorted(effects) == sorted(set(ids))
