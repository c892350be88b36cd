"""A pull: a reference resolved, its file fetched into the hub's data directory, checked
and inspected, and the model it is made ready to register, with where it came from and the
memory a replica needs.

Nothing is registered until the file is whole, checked and in place; a pull stopped at
any point leaves only its part file, which the next pull of the same file goes on from.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
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

if TYPE_CHECKING:
    from collections.abc import Callable

    from hub.settings import HubSettings


@dataclass(frozen=True)
class Naming:
    """What the operator named the model (None: from its reference)."""

    name: str | None = None
    version: str | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class _Planned:
    wanted: Wanted
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
    try:
        planned = await _plan(session, reference, settings, naming)
        key = planned.wanted.sha256 or hashlib.sha256(planned.source.encode()).hexdigest()
        part = settings.pulls_dir / f"{key}.part"
        bounds = Bounds(settings.models.max_pull_bytes, settings.models.keep_free_bytes)
        sha256, size = await download(session, planned.wanted, part, bounds, progress=progress)
    finally:
        if own:
            await session.close()
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
            Wanted(remote.url, remote.size, remote.sha256, token),
            resolved.source,
            resolved.license,
            naming.name or _name(reference.repo.split("/")[1]),
            naming.version or (quant or resolved.commit[:12]).lower(),
        )
    url = str(reference)
    stem = unquote(PurePosixPath(urlsplit(url).path).name).removesuffix(".gguf") or "model"
    return _Planned(
        Wanted(url, None, None),
        url,
        None,
        naming.name or _name(stem),
        naming.version or (_quant_of(stem) or "1").lower(),
    )


def _name(text: str) -> str:
    """A model name from a repository's or a file's: lowercase, without `-GGUF`."""
    name = re.sub(r"[-_.]gguf$", "", text, flags=re.I).lower()
    name = re.sub(r"[^a-z0-9._-]+", "-", name).strip("-.") or "model"
    return name[:100]


def _quant_of(stem: str) -> str | None:
    found = huggingface.ANY_QUANT.search(stem)
    return found.group(1).upper() if found else None
