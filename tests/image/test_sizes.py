"""docs/image.md and the build agree: the partitions' sizes are the build's, the flashing step
names the file the build writes, and the measured sizes are in one table that the `image`
tier compares with the build's manifest (tests/image/test_image.py)."""

from __future__ import annotations

import re
from pathlib import Path

from image.build import COMPRESSED_NAME, DATA_SIZE, ESP_SIZE, ROOT_SLOT_SIZE
from image.configure import DATA_LABEL, ESP_LABEL, ROOT_A_LABEL, ROOT_B_LABEL

DOC = Path(__file__).resolve().parents[2] / "docs" / "image.md"
UNITS = {"MiB": 2**20, "GiB": 2**30}
SIZE = re.compile(r"(\d+(?:\.\d+)?) (MiB|GiB)")


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _bytes(cell: str) -> int:
    match = SIZE.search(cell)
    assert match, f"no size in {cell!r}"
    return round(float(match.group(1)) * UNITS[match.group(2)])


def documented_sizes() -> dict[str, int]:
    """The `## Sizes` table of docs/image.md: what → bytes (its second column)."""
    sizes = {}
    for line in _section("Sizes").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and SIZE.search(cells[1]) and not cells[0].startswith("-"):
            sizes[cells[0]] = _bytes(cells[1])
    return sizes


def test_the_partition_table_states_the_build_s_sizes() -> None:
    wanted = {
        ESP_LABEL: ESP_SIZE,
        ROOT_A_LABEL: ROOT_SLOT_SIZE,
        ROOT_B_LABEL: ROOT_SLOT_SIZE,
        DATA_LABEL: DATA_SIZE,
    }
    rows = {
        label: line
        for line in _section("Build").splitlines()
        for label in wanted
        if line.startswith(f"| `{label}`")
    }
    assert set(rows) == set(wanted), "docs/image.md's partition table lacks a partition"
    for label, size in wanted.items():
        cells = rows[label].strip("|").split("|")
        assert _bytes(cells[1]) == size, f"docs/image.md: {label} is {size // 2**20} MiB"


def test_the_flashing_step_names_what_the_build_writes() -> None:
    flash = _section("Flash")
    assert f"zstd -dc {COMPRESSED_NAME} | sudo dd of=/dev/sdX" in flash
    assert f"sha256sum -c {COMPRESSED_NAME}.sha256" in flash


def test_the_sizes_table_is_there() -> None:
    assert set(documented_sizes()) == {
        "image file",
        "data in it",
        "root file system",
        "download",
        "update bundle",
    }
