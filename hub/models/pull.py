"""A pull: a reference resolved, its file fetched into the hub's data directory, checked
and inspected, and the model it is made ready to register, with where it came from and the
memory a replica needs.

Nothing is registered until the file is whole, checked and in place; a pull stopped at
any point leaves only its part files, which the next pull of the same file goes on from. The
parts of a split GGUF file are each fetched and checked so, then joined into one file
(shared/gguf_split.py), which the hub keeps and delivers as it keeps any other.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import aiohttp

from hub.models import huggingface
from hub.models.download import Bounds, Wanted, download
from hub.models.errors import PullError
from hub.models.inspect import inspect
from hub.models.reference import BadReferenceError, HubReference, parse_reference
from hub.state.deployments import ModelArtifact
from shared import gguf_split
from shared.gguf import GGUFError

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from hub.settings import HubSettings


@dataclass(frozen=True)
class Naming:
    """What the operator named the model (None: from its reference)."""

    name: str | None = None
    version: str | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class _Planned:
    wanted: tuple[Wanted, ...]  # the file, or the parts of a split one in order
    source: str
    license: str | None
    name: str
    version: str


async def pull(
    text: str,
    settings: HubSettings,
    naming: Naming = Naming(),
    *,
    progress: Callable[[int, int | None], None] = lambda done, total: None,
    session: aiohttp.ClientSession | None = None,
) -> ModelArtifact:
    """Fetch the model `text` names into the hub's artifacts; the model to register.
    PullError saying why when it cannot."""
    try:
        reference = parse_reference(text)
    except BadReferenceError as err:
        raise PullError("not_found", str(err)) from err
    own = session is None
    session = session or aiohttp.ClientSession(trust_env=True)
    bounds = Bounds(settings.models.max_pull_bytes, settings.models.keep_free_bytes)
    try:
        planned = await _plan(session, reference, settings, naming)
        parts = await _fetch(session, planned, settings, bounds, progress)
    finally:
        if own:
            await session.close()
    if len(parts) == 1:
        part, (sha256, size) = parts[0]
    else:
        key = hashlib.sha256(planned.source.encode()).hexdigest()
        part = settings.pulls_dir / f"{key}.joined.part"
        sha256, size = await asyncio.to_thread(_join, [p for p, _ in parts], part, bounds)
    try:
        inspection = await asyncio.to_thread(inspect, part)
    except PullError:
        part.unlink(missing_ok=True)
        raise
    target = settings.artifacts_dir / sha256
    if target.exists():
        part.unlink()
    else:
        part.replace(target)
    return ModelArtifact(
        planned.name,
        planned.version,
        sha256,
        size,
        "gguf",
        naming.memory_mib or inspection.replica_mib(size),
        planned.source,
        planned.license,
        inspection.as_json(),
    )


async def _plan(
    session: aiohttp.ClientSession, reference: object, settings: HubSettings, naming: Naming
) -> _Planned:
    if isinstance(reference, HubReference):
        token = huggingface.token(
            settings.models.hf_token.get_secret_value() if settings.models.hf_token else None
        )
        base = huggingface.endpoint(settings.models.hf_endpoint)
        resolved = await huggingface.resolve(session, base, reference, token)
        remote = resolved.file
        stem = PurePosixPath(remote.path).name[: -len(".gguf")]
        quant = reference.quant or _quant_of(stem)
        return _Planned(
            tuple(Wanted(f.url, f.size, f.sha256, token) for f in resolved.files),
            resolved.source,
            resolved.license,
            naming.name or _name(reference.repo.split("/")[1]),
            naming.version or (quant or resolved.commit[:12]).lower(),
        )
    url = str(reference)
    stem = unquote(PurePosixPath(urlsplit(url).path).name).removesuffix(".gguf") or "model"
    return _Planned(
        (Wanted(url, None, None),),
        url,
        None,
        naming.name or _name(stem),
        naming.version or (_quant_of(stem) or "1").lower(),
    )


async def _fetch(
    session: aiohttp.ClientSession,
    planned: _Planned,
    settings: HubSettings,
    bounds: Bounds,
    progress: Callable[[int, int | None], None],
) -> list[tuple[Path, tuple[str, int]]]:
    """Each file of the plan downloaded and checked: its part file, sha256 and size."""
    sizes = [w.size for w in planned.wanted]
    total = None if None in sizes else sum(s or 0 for s in sizes)
    if total is not None and total > bounds.max_bytes:
        raise PullError(
            "too_large",
            f"the {len(sizes)} parts are {total / 2**20:,.0f} MiB, over the hub's bound of "
            f"{bounds.max_bytes / 2**20:,.0f} MiB (models.max_pull_bytes)",
        )
    fetched: list[tuple[Path, tuple[str, int]]] = []
    before = 0
    for wanted in planned.wanted:
        key = wanted.sha256 or hashlib.sha256(f"{planned.source} {wanted.url}".encode()).hexdigest()
        part = settings.pulls_dir / f"{key}.part"

        def report(done: int, of: int | None, before: int = before) -> None:
            progress(before + done, total if len(planned.wanted) > 1 else of)

        fetched.append((part, await download(session, wanted, part, bounds, progress=report)))
        before += fetched[-1][1][1]
    return fetched


def _join(parts: list[Path], target: Path, bounds: Bounds) -> tuple[str, int]:
    """The parts of a split GGUF file joined into `target`: its sha256 and size. The parts
    are deleted once joined, and when they are not the parts of one file."""
    total = sum(p.stat().st_size for p in parts)
    free = shutil.disk_usage(target.parent).free
    if free < total + bounds.keep_free_bytes:  # the parts stay, for a pull once there is room
        raise PullError(
            "disk_full",
            f"{free / 2**20:,.0f} MiB free in the hub's data directory: joining the parts "
            f"needs {total / 2**20:,.0f} MiB, and {bounds.keep_free_bytes / 2**20:,.0f} MiB are "
            "kept free (models.keep_free_bytes)",
        )
    digest = hashlib.sha256()
    size = 0
    try:
        with target.open("wb") as out:

            def write(data: bytes) -> None:
                nonlocal size
                out.write(data)
                digest.update(data)
                size += len(data)

            gguf_split.merge(parts, write)
    except GGUFError as err:
        target.unlink(missing_ok=True)
        for part in parts:
            part.unlink(missing_ok=True)
        raise PullError("unsupported", f"the parts do not join into one GGUF file: {err}") from err
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    for part in parts:
        part.unlink()
    return digest.hexdigest(), size


def _name(text: str) -> str:
    """A model name from a repository's or a file's: lowercase, without `-GGUF`."""
    name = re.sub(r"[-_.]gguf$", "", text, flags=re.I).lower()
    name = re.sub(r"[^a-z0-9._-]+", "-", name).strip("-.") or "model"
    return name[:100]


def _quant_of(stem: str) -> str | None:
    found = huggingface.ANY_QUANT.search(stem)
    return found.group(1).upper() if found else None
