"""What the tests of tar readers (backups, OCI layouts, shared/tarstream.py) share: the
pieces of hand-made, hostile tar archives."""

from __future__ import annotations


def pax_record(key: str, value: str) -> bytes:
    """A PAX extended header's record, `LENGTH KEY=VALUE\\n`, LENGTH counting the whole
    record (its own digits included)."""
    rest = f" {key}={value}\n".encode()
    length = len(rest) + 1
    while len(str(length)) + len(rest) != length:
        length += 1
    return str(length).encode() + rest
