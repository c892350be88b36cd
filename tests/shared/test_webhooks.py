"""Webhook signatures: what a receiver accepts, what it refuses, and one effect per delivery;
and webhook URLs as logs show them, without what may be a credential."""

from __future__ import annotations

import hashlib
import hmac
import json
from urllib.parse import quote

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
    redact_url,
    redact_urls,
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


# -- URLs in logs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.example.com/kvl", "https://hooks.example.com/kvl"),
        ("https://user:hunter2@hooks.example.com/kvl", "https://***@hooks.example.com/kvl"),
        ("https://hunter2@hooks.example.com/", "https://***@hooks.example.com/"),
        ("https://a:b@c@hooks.example.com/", "https://***@hooks.example.com/"),  # the last @
        ("https://hooks.example.com/kvl?token=hunter2", "https://hooks.example.com/kvl?***"),
        ("https://hooks.example.com/kvl#hunter2", "https://hooks.example.com/kvl#***"),
        ("https://hooks.example.com/kvl?t=hunter2#x", "https://hooks.example.com/kvl?***#***"),
        ("https://hooks.example.com/#a?token=hunter2", "https://hooks.example.com/#***"),
        ("https://hooks.example.com?token=hunter2", "https://hooks.example.com?***"),
        ("https://hooks.example.com/kvl?", "https://hooks.example.com/kvl?"),
        ("HTTP://U:P@Hooks.Example.COM/", "HTTP://***@Hooks.Example.COM/"),
        ("https://u:hunter2@h.example:8443/kvl?a=1", "https://***@h.example:8443/kvl?***"),
        ("https://hooks.example.com:8443/kvl", "https://hooks.example.com:8443/kvl"),
        ("http://[2001:db8::1]/kvl?token=hunter2", "http://[2001:db8::1]/kvl?***"),
        ("http://u:hunter2@[2001:db8::1]:8080/kvl", "http://***@[2001:db8::1]:8080/kvl"),
        ("http://[fe80::1%25eth0]:80/", "http://[fe80::1%25eth0]:80/"),
        ("http://u:hunter2@192.0.2.7:9000/a@b", "http://***@192.0.2.7:9000/a@b"),
    ],
)
def test_a_urls_userinfo_query_and_fragment_are_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("", ""),
        ("not a url", "not a url"),
        ("hooks.example.com/kvl?token=hunter2", "hooks.example.com/kvl?***"),
        ("user:hunter2@hooks.example.com/kvl", "***@hooks.example.com/kvl"),  # no scheme
        ("//user:hunter2@hooks.example.com/", "//***@hooks.example.com/"),
        ("https://user:hunter2/x@hooks.example.com/", "https://user:***/x@hooks.example.com/"),
        ("https://user:hunter2#x@hooks.example.com/", "https://user:***#***"),
        ("https://hooks.example.com:hunter2/", "https://hooks.example.com:***/"),
        ("http://[2001:db8::1/kvl", "http://[2001:db8::1/kvl"),  # no closing bracket
        ("http://[2001:db8::1]hunter2/", "http://[2001:db8::1]***/"),
        ("http://[2001:db8::1]:hunter2/", "http://[2001:db8::1]:***/"),
        ("https://\u0661\u0662:1\u0663/", "https://\u0661\u0662:***/"),  # digits, not ASCII
        ("https://h.example/\n2024 forged line", "https://h.example/%0A2024 forged line"),
        ("@@@", "***@"),
        (":::", ":***"),
        ("?", "?"),
        ("#", "#"),
        ("  https://u:hunter2@hooks.example.com/  ", "https://***@hooks.example.com/"),
    ],
)
def test_a_malformed_url_is_redacted_as_a_parser_would_cut_it(url: str, shown: str) -> None:
    """Never raising, and leaving out at least what a URL parser reads as userinfo,
    query or fragment; a port that is not digits could be a password, and goes too."""
    assert redact_url(url) == shown


_SAFE = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=12)


@given(
    user=st.text(max_size=12),
    password=st.text(min_size=1, max_size=12),
    host=st.sampled_from(["hooks.example.com", "192.0.2.7", "[2001:db8::7]"]),
    port=st.none() | st.integers(min_value=1, max_value=65535),
    path=_SAFE,
    query=st.text(min_size=1, max_size=20),
    fragment=st.none() | st.text(max_size=10),
)
def test_property_the_secrets_of_a_url_are_never_shown_and_its_host_is(
    *,
    user: str,
    password: str,
    host: str,
    port: int | None,
    path: str,
    query: str,
    fragment: str | None,
) -> None:
    marker = "zz-SECRET-zz"  # in every secret part, in no host or path
    credentials = f"{quote(user + marker, safe='')}:{quote(password + marker, safe='')}@"
    at = host if port is None else f"{host}:{port}"
    url = f"https://{credentials}{at}/{path}?t={quote(query + marker)}"
    if fragment is not None:
        url += f"#{quote(fragment + marker)}"
    shown = redact_url(url)
    assert marker not in shown
    assert shown == f"https://***@{at}/{path}?***" + ("" if fragment is None else "#***")


@given(st.text(max_size=200))
def test_property_any_text_is_taken_and_shown_on_one_line(text: str) -> None:
    shown = redact_url(text)
    assert "\n" not in shown
    assert "\r" not in shown
    assert redact_urls(text).count("\n") <= text.count("\n")


def test_every_url_in_a_message_is_redacted_and_the_rest_kept() -> None:
    message = (
        "InvalidUrlClientError('https://u:hunter2@/kvl?token=hunter2'); retried"
        " http://[2001:db8::1]:8080/a#hunter2 and ftp://x:hunter2@files.example"
    )
    assert redact_urls(message) == (
        "InvalidUrlClientError('https://***@/kvl?***'); retried"
        " http://[2001:db8::1]:8080/a#*** and ftp://***@files.example"
    )
