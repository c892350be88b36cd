"""Image release bundles the hub holds: to the hub a bundle (a RAUC `.raucb`, which the
node's updater checks against its keyring) is an opaque file, kept under its own sha256 in
the artifacts folder beside the model files and package archives, served to the nodes a
rollout gives it to (`GET /v1/node/artifacts/SHA256`, with Range), and carried by backups
like them.

A bundle is streamed to a file while it is hashed, never held in memory: an image is
gigabytes. The file is written under a temporary name in the same folder, then renamed
to its digest, so a cut upload leaves no file that looks whole.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

MAX_RELEASE = 1 << 34  # bytes: 16 GiB, above any image this project builds
CHUNK = 1 << 20


class BundleTooLargeError(ValueError):
    """The bundle is over MAX_RELEASE."""


class _Sink:
    """A temporary file in the artifacts folder, hashed as it is written."""

    def __init__(self, artifacts_dir: Path) -> None:
        artifacts_dir.mkdir(parents=True, exist_ok=True)
        self.folder = artifacts_dir
        self.path = artifacts_dir / f".upload-{secrets.token_hex(8)}"
        self.file = self.path.open("xb")
        self.path.chmod(0o600)
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > MAX_RELEASE:
            raise BundleTooLargeError(f"a release bundle is at most {MAX_RELEASE} bytes")
        self.digest.update(chunk)
        self.file.write(chunk)

    def keep(self) -> tuple[str, int]:
        """(sha256, size), the file renamed to its digest (or dropped: held already)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        sha256 = self.digest.hexdigest()
        target = self.folder / sha256
        if target.exists():
            self.path.unlink()
        else:
            self.path.replace(target)
        return sha256, self.size

    def drop(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


async def keep_stream(artifacts_dir: Path, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
    """An uploaded bundle kept by its sha256: (sha256, size). BundleTooLargeError past
    MAX_RELEASE (nothing kept)."""
    sink = _Sink(artifacts_dir)
    try:
        async for chunk in chunks:
            sink.write(chunk)
        return sink.keep()
    except BaseException:
        sink.drop()
        raise


def keep_file(artifacts_dir: Path, source: Path) -> tuple[str, int]:
    """A bundle file kept by its sha256 (the CLI's `kvl hub releases add`)."""
    sink = _Sink(artifacts_dir)
    try:
        for chunk in _read(source):
            sink.write(chunk)
        return sink.keep()
    except BaseException:
        sink.drop()
        raise


def _read(source: Path) -> Iterator[bytes]:
    with source.open("rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk
