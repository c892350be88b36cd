"""What a model file is, told by its first bytes: GGUF (llama.cpp's weights), or a model
script (JSON: the appliance's scripted model, appliance/serving/scripted.py). The hub
records it when it takes a file to place; a node registers the file under it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pathlib import Path

ModelFormat = Literal["gguf", "script"]
GGUF_MAGIC = b"GGUF"


def model_format(path: Path) -> ModelFormat | None:
    """The file's format, or None when it is neither (or cannot be read)."""
    try:
        with path.open("rb") as f:
            head = f.read(64)
    except OSError:
        return None
    if head.startswith(GGUF_MAGIC):
        return "gguf"
    if head.lstrip()[:1] == b"{":
        return "script"
    return None
