"""The Hugging Face Hub's HTTP protocol, the part a pull needs (as `huggingface_hub` speaks
it, against `HF_ENDPOINT` when set, so a site's mirror stands in for the public Hub):

- ``GET /api/models/OWNER/REPO/revision/REVISION?blobs=true``: the commit a branch or tag
  names now, the files at that commit with their sizes and, for LFS files (every GGUF), their
  sha256; the card's licence; whether the repository is gated.
- ``GET /OWNER/REPO/resolve/COMMIT/PATH``: the file, usually by a redirect to a storage
  host (download.py follows it, and never takes the token there).

Errors come as `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`,
`GatedRepo`) on 401, 403 and 404; 429 with `Retry-After`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp

from hub.models.errors import PullError
from hub.models.reference import QUANTISATION

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hub.models.reference import HubReference

DEFAULT_ENDPOINT = "https://huggingface.co"
MAX_INFO_BYTES = 16 << 20  # a repository's listing: thousands of files at most
MAX_PARTS = 256  # of a split GGUF file (llama-gguf-split writes ~50 GB parts at most)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
# A quantisation as it appears in a file name: separated from what comes before by one of
# `-._/` (or starting it), and followed by `-` or `.` or nothing (Q4_K is not Q4_K_M).
_QUANT_IN_NAME = r"(?:^|[-._/]){quant}(?:[-.]|$)"
ANY_QUANT = re.compile(rf"(?:^|[-._/])({QUANTISATION})(?:[-.]|$)", re.I)


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # what the repository's LFS pointer says; None for a file outside LFS
    url: str  # pinned to the commit


@dataclass(frozen=True)
class Resolved:
    """A reference resolved: the commit it names now and the file to fetch (the parts of
    a split GGUF file, in order, to be joined into one)."""

    repo: str
    commit: str
    files: tuple[RemoteFile, ...]
    license: str | None

    @property
    def file(self) -> RemoteFile:
        """The file, or a split file's first part (whose name stands for the whole)."""
        return self.files[0]

    @property
    def source(self) -> str:
        """The reference pinned: the same bytes whatever the branch says later."""
        return f"hf://{self.repo}@{self.commit}/{self.file.path}"


def endpoint(configured: str | None) -> str:
    """The Hub's address: the setting, else `HF_ENDPOINT` (as huggingface_hub reads it),
    else the public Hub."""
    return (configured or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token(configured: str | None) -> str | None:
    """The token for gated and private repositories: the setting, else `HF_TOKEN`."""
    return configured or os.environ.get("HF_TOKEN") or None


async def resolve(
    session: aiohttp.ClientSession, base: str, reference: HubReference, auth: str | None
) -> Resolved:
    """The commit and file `reference` names, or PullError saying why none."""
    revision = reference.revision or "main"
    url = f"{base}/api/models/{reference.repo}/revision/{quote(revision, safe='')}"
    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
    try:
        async with session.get(
            url,
            params={"blobs": "true"},
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=60, sock_connect=15),
        ) as response:
            if response.status != 200:
                raise failure(response, f"hf://{reference.repo}@{revision}", auth is not None)
            raw = await response.content.read(MAX_INFO_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError) as err:
        raise PullError("unavailable", f"{base} cannot be reached: {err}") from err
    if len(raw) > MAX_INFO_BYTES:
        raise PullError("unavailable", f"{base} answered a repository listing over 16 MiB")
    try:
        info = _listing(json.loads(raw))
    except (ValueError, TypeError, KeyError) as err:
        raise PullError("unavailable", f"{base} answered no repository listing: {err}") from err
    commit, files, license_ = info
    remote = tuple(
        RemoteFile(
            chosen.path,
            chosen.size,
            chosen.sha256,
            f"{base}/{reference.repo}/resolve/{commit}/{quote(chosen.path)}",
        )
        for chosen in pick(reference, files)
    )
    return Resolved(reference.repo, commit, remote, license_)


@dataclass(frozen=True)
class _Listed:
    path: str
    size: int
    sha256: str | None


def _listing(body: Any) -> tuple[str, list[_Listed], str | None]:
    commit = body["sha"]
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError("no commit")
    files = []
    for sibling in body.get("siblings") or []:
        path = sibling["rfilename"]
        lfs = sibling.get("lfs") or {}
        size = lfs.get("size", sibling.get("size"))
        sha256 = lfs.get("sha256")
        if not isinstance(path, str) or not isinstance(size, int) or size < 0:
            raise ValueError(f"a file without a path or size: {sibling!r:.200}")
        if sha256 is not None and not (
            isinstance(sha256, str) and re.fullmatch(r"[0-9a-f]{64}", sha256)
        ):
            raise ValueError(f"{path}: an LFS sha256 that is none")
        files.append(_Listed(path, size, sha256))
    card = body.get("cardData") or {}
    license_ = card.get("license") if isinstance(card, dict) else None
    return commit, files, license_ if isinstance(license_, str) else None


def pick(reference: HubReference, files: list[_Listed]) -> list[_Listed]:
    """The file `reference` names among the repository's: by path, or the one GGUF of its
    quantisation (a vision projector, `mmproj`, is never a model); all the parts of a split
    one, in order."""
    ggufs = [f for f in files if f.path.lower().endswith(".gguf")]
    if reference.path is not None:
        found = next((f for f in files if f.path == reference.path), None)
        if found is None:
            raise PullError("not_found", f"{reference} is not a file of the repository")
        chosen = found
    else:
        wanted = reference.quant or ""
        quant = re.compile(_QUANT_IN_NAME.format(quant=re.escape(wanted)), re.I)
        models = [f for f in ggufs if "mmproj" not in f.path.lower()]
        matching = [f for f in models if quant.search(_SPLIT.sub(".gguf", f.path)[:-5])]
        firsts = [f for f in matching if not (m := _SPLIT.search(f.path)) or m.group(1) == "00001"]
        if not firsts:
            there = sorted({m.group(1).upper() for f in models if (m := ANY_QUANT.search(
                _SPLIT.sub(".gguf", f.path)[:-5]))})  # fmt: skip
            listed = ", ".join(there) if there else "none"
            raise PullError(
                "no_quantisation",
                f"hf://{reference.repo} has no GGUF file of {reference.quant} "
                f"(quantisations there: {listed})",
            )
        if len(firsts) > 1:
            names = ", ".join(f.path for f in firsts)
            raise PullError(
                "not_found",
                f"hf://{reference.repo} has several files of {reference.quant} ({names}): "
                "name one as hf://OWNER/REPO/PATH.gguf",
            )
        chosen = firsts[0]
    if not chosen.path.lower().endswith(".gguf"):
        raise PullError("unsupported", f"{chosen.path} is not a GGUF file")
    split = _SPLIT.search(chosen.path)
    if split is None:
        return [chosen]
    count = int(split.group(2))
    if not 1 <= count <= MAX_PARTS:
        raise PullError("unsupported", f"{chosen.path}: a split file of {count} parts")
    stem = chosen.path[: split.start()]
    by_path = {f.path: f for f in files}
    parts = []
    for number in range(1, count + 1):
        path = f"{stem}-{number:05d}-of-{count:05d}.gguf"
        if path not in by_path:
            raise PullError(
                "not_found", f"{path}, part {number} of {chosen.path}'s {count}, is not there"
            )
        parts.append(by_path[path])
    return parts


def failure(response: aiohttp.ClientResponse, what: str, had_token: bool) -> PullError:
    """A PullError for an answer other than the one asked for."""
    code = response.headers.get("X-Error-Code", "")
    status = response.status
    if code == "GatedRepo" or (status == 403 and not code):
        if had_token:
            return PullError("gated", f"{what} is gated, and the token has no access to it")
        return PullError(
            "gated",
            f"{what} is gated: accept its conditions on the repository's page and give the hub "
            "a token (`models.hf_token` in the hub's settings, or HF_TOKEN)",
        )
    if status == 401 and code not in {"RepoNotFound", "RevisionNotFound", "EntryNotFound"}:
        return PullError(
            "gated",
            f"{what} needs a token"
            + (" and refused the one given" if had_token else " (models.hf_token or HF_TOKEN)"),
        )
    if status in {401, 404}:
        what_missing = {
            "RevisionNotFound": "no such revision",
            "EntryNotFound": "no such file",
        }.get(code, "no such repository (or a private one the token cannot see)")
        return PullError("not_found", f"{what}: {what_missing}")
    if status == 429:
        wait = _retry_after(response.headers)
        return PullError(
            "unavailable",
            f"{what}: the source is rate limiting the hub"
            + (f"; try again in {wait:g} s" if wait else ""),
            retry_after_s=wait,
        )
    return PullError("unavailable", f"{what}: the source answered {status} {response.reason}")


def _retry_after(headers: Mapping[str, str]) -> float | None:
    raw = headers.get("Retry-After", "")
    return float(raw) if raw.isdigit() and len(raw) < 8 else None
