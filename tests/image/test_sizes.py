"""docs/image.md and the build agree: the partitions' sizes are the build's, the flashing step
names the file the build writes, and the measured sizes are in one table that the `image`
tier compares with the build's manifest (tests/image/test_image.py)."""

from __future__ import annotations

from image.build import COMPRESSED_NAME, DATA_SIZE, ESP_SIZE, ROOT_SLOT_SIZE
from image.configure import DATA_LABEL, ESP_LABEL, ROOT_A_LABEL, ROOT_B_LABEL
from tests.image.sizes import documented_sizes, section, size_bytes


def test_the_partition_table_states_the_build_s_sizes() -> None:
    wanted = {
        ESP_LABEL: ESP_SIZE,
        ROOT_A_LABEL: ROOT_SLOT_SIZE,
        ROOT_B_LABEL: ROOT_SLOT_SIZE,
        DATA_LABEL: DATA_SIZE,
    }
    rows = {
        label: line
        for line in section("Build").splitlines()
        for label in wanted
        if line.startswith(f"| `{label}`")
    }
    assert set(rows) == set(wanted), "docs/image.md's partition table lacks a partition"
    for label, size in wanted.items():
        cells = rows[label].strip("|").split("|")
        assert size_bytes(cells[1]) == size, f"docs/image.md: {label} is {size // 2**20} MiB"


def test_the_flashing_step_names_what_the_build_writes() -> None:
    flash = section("Flash")
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
