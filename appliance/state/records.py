"""Records of the appliance's store that its model workers read too: defined apart from the
store (appliance/state/store.py), so that a worker, which never opens the database, does
not import sqlite-utils and what it brings (16 MiB of a worker's memory)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelRecord:
    name: str
    version: str
    format: str
    path: str
    sha256: str
    size_bytes: int
    quantization: str | None
    source: str
    added_at: str

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"
