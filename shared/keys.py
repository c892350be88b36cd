"""Secrets shown once: API keys `kvl_<prefix>_<secret>`, enrollment tokens `kvle_…`, node
tokens `kvln_…` and the hub's operator tokens `kvlo_…`. Only a hash is stored; the prefix
finds the row.

The secret is 32 characters of base62 (about 190 bits), so a single SHA-256 is enough:
a slow password hash (argon2) protects low-entropy secrets, and costs every request here.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from dataclasses import dataclass

_ALPHABET = string.ascii_letters + string.digits
PREFIX_LEN = 8
SECRET_LEN = 32
API_KEY, ENROLLMENT_TOKEN, NODE_TOKEN, OPERATOR_TOKEN = "kvl", "kvle", "kvln", "kvlo"
_KEY_RE = re.compile(
    rf"^(kvl|kvle|kvln|kvlo)_([A-Za-z0-9]{{{PREFIX_LEN}}})_([A-Za-z0-9]{{{SECRET_LEN}}})$"
)


@dataclass(frozen=True)
class NewKey:
    """A freshly made key: `plaintext` is shown once and never stored."""

    plaintext: str
    prefix: str
    hash: str


def generate_key(kind: str = API_KEY) -> NewKey:
    prefix = "".join(secrets.choice(_ALPHABET) for _ in range(PREFIX_LEN))
    secret = "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LEN))
    plaintext = f"{kind}_{prefix}_{secret}"
    return NewKey(plaintext=plaintext, prefix=prefix, hash=hash_key(plaintext))


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("ascii")).hexdigest()


def parse_prefix(plaintext: str, kind: str = API_KEY) -> str | None:
    """The lookup prefix of a well-formed secret of this kind, or None for anything else."""
    match = _KEY_RE.match(plaintext)
    return match.group(2) if match and match.group(1) == kind else None


def key_matches(plaintext: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_key(plaintext), stored_hash)
