"""The image's sizes as the docs state them: the `## Sizes` table of docs/image.md."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "image.md"
SIZE = re.compile(r"(\d+(?:\.\d+)?) (MiB|GiB)")
UNITS = {"MiB": 2**20, "GiB": 2**30}


def section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def size_bytes(cell: str) -> int:
    match = SIZE.search(cell)
    assert match, f"no size in {cell!r}"
    return round(float(match.group(1)) * UNITS[match.group(2)])


def documented_sizes() -> dict[str, int]:
    """The `## Sizes` table of docs/image.md: what → bytes (its second column)."""
    sizes = {}
    for line in section("Sizes").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and SIZE.search(cells[1]) and not cells[0].startswith("-"):
            sizes[cells[0]] = size_bytes(cells[1])
    return sizes
