"""What an operator names to pull a model, parsed and checked before anything is fetched.

- ``hf://OWNER/REPO[@REVISION]:QUANT``: the repository's GGUF file of that quantisation
  (``Q4_K_M``, ``Q8_0``, ``IQ4_XS``, ``F16``…), chosen as Ollama and llama-server choose it;
- ``hf://OWNER/REPO[@REVISION]/PATH.gguf``: that file;
- ``https://HOST/…``: a file at a URL (no digest to check it against but its own).

A revision is a branch, a tag or a commit (``main`` when none is named); the pull pins the
commit it resolved to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

# The Hub's own rules for a repository id: names of letters, digits, `-`, `_` and `.`,
# neither starting nor ending with `-` or `.`, with no `--` or `..`, at most 96 characters.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO = re.compile(rf"{_NAME}/{_NAME}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
# llama.cpp's quantisation types, as GGUF file names carry them.
QUANTISATION = (
    r"(?:Q[2-8]_[01]|Q[2-6]_K(?:_[SML])?|Q4_0_[48]_[48]|IQ[1-4]_(?:XXS|XS|S|M|NL)|TQ[12]_0"
    r"|BF16|F16|F32|MXFP4(?:_MOE)?)"
)
_QUANT = re.compile(QUANTISATION, re.I)
_PATH_PART = re.compile(r"[^/\x00-\x1f\\]{1,255}")
MAX_REFERENCE = 1000


class BadReferenceError(ValueError):
    """A reference that names no model the hub could pull; the message says what is wrong."""


@dataclass(frozen=True)
class HubReference:
    """A file of a Hugging Face repository: by its path, or by its quantisation."""

    repo: str
    revision: str | None  # None: the default branch
    path: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        which = f"/{self.path}" if self.path else f":{self.quant}"
        return f"hf://{self.repo}{at}{which}"


@dataclass(frozen=True)
class UrlReference:
    url: str

    def __str__(self) -> str:
        return self.url


Reference = HubReference | UrlReference


def parse_reference(text: str) -> Reference:
    """The reference `text` names, or BadReferenceError saying why it names none."""
    text = text.strip()
    if not text or len(text) > MAX_REFERENCE:
        raise BadReferenceError(f"a model reference has 1 to {MAX_REFERENCE} characters")
    if text.startswith("hf://"):
        return _hub(text.removeprefix("hf://"))
    if text.startswith("https://"):
        parts = urlsplit(text)
        if not parts.hostname or any(c.isspace() for c in text):
            raise BadReferenceError(f"{text!r} is not a URL the hub can fetch")
        return UrlReference(text)
    if text.startswith("http://"):
        raise BadReferenceError("a model is fetched over https:// (or hf://), never plain http://")
    raise BadReferenceError(
        f"{text!r}: name a model as hf://OWNER/REPO:QUANT, hf://OWNER/REPO/FILE.gguf or "
        "an https:// URL"
    )


def _hub(rest: str) -> HubReference:
    owner, _, after = rest.partition("/")
    name = re.split(r"[/@:]", after, maxsplit=1)[0]
    repo = f"{owner}/{name}"
    tail = after[len(name) :]
    if not _REPO.fullmatch(repo) or "--" in repo or ".." in repo:
        raise BadReferenceError(f"{repo!r} is not a repository id (OWNER/REPO)")
    revision = None
    if tail.startswith("@"):
        revision = re.split(r"[:/]", tail[1:], maxsplit=1)[0]
        tail = tail[1 + len(revision) :]
        if not _REVISION.fullmatch(revision) or ".." in revision:
            raise BadReferenceError(f"{revision!r} is not a revision (a branch, tag or commit)")
    if tail.startswith(":"):
        quant = tail[1:]
        if not _QUANT.fullmatch(quant):
            raise BadReferenceError(
                f"{quant!r} is not a quantisation (Q4_K_M, Q8_0, IQ4_XS, F16, …)"
            )
        return HubReference(repo, revision, quant=quant.upper())
    if tail.startswith("/"):
        path = tail[1:]
        parts = path.split("/")
        if any(p in {".", ".."} or not _PATH_PART.fullmatch(p) for p in parts):
            raise BadReferenceError(f"{path!r} is not a file of the repository")
        if not path.lower().endswith(".gguf"):
            raise BadReferenceError(f"{path!r}: the hub pulls GGUF files (name one ending .gguf)")
        return HubReference(repo, revision, path=path)
    if not tail:
        raise BadReferenceError(
            f"hf://{repo}: say which file, by quantisation (hf://{repo}:Q4_K_M) or by path "
            f"(hf://{repo}/FILE.gguf)"
        )
    raise BadReferenceError(f"hf://{rest}: unexpected {tail!r} after the repository")
