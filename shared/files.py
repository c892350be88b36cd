"""Files that hold secrets (private keys, tokens): written whole, readable by the owner only."""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path``, mode 0600 from the first byte, and replace atomically.

    The secret never passes through a file another user could read, not even for a moment:
    a temporary file made 0600 beside it is synced and renamed over ``path``. Raises
    OSError (the temporary file is removed).
    """
    _write_atomic(path, data, 0o600)


def write_public(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` whole (a certificate, say), mode 0644, replaced
    atomically: a reader sees the old file or the new one, never half of it."""
    _write_atomic(path, data, 0o644)


def _write_atomic(path: Path, data: str | bytes, mode: int) -> None:
    """A temporary file beside ``path``, 0600 from its first byte, then ``mode``,
    synced and renamed over ``path``."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(fd, mode)  # the umask can take bits away from 0o600, never add them
            out.write(raw)
            out.flush()
            os.fsync(fd)  # a node that loses power right after must still have it
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
