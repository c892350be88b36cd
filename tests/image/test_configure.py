"""`kvl image configure` and `kvl image show` on small GPT disk images made here: the
provisioning file goes onto the EFI system partition's FAT file system and nowhere else, and
bad input is refused before the image is touched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import uuid
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from image.configure import (
    ESP_TYPE,
    LINUX_DATA_TYPE,
    SECTOR,
    ImageError,
    partitions,
    read_provisioning,
)
from shared.cli import main
from shared.keys import hash_key, parse_prefix
from shared.provisioning import BootstrapKey, Provisioning

FINGERPRINT = "sha256:" + "ab" * 32
TOKEN = "kvle_Abcdefgh_" + "x" * 32
HUB = "https://198.18.0.2:8443"
ESP_FIRST, ESP_LAST = 2048, 2048 + 16384 - 1  # 8 MiB
DATA_FIRST, DATA_LAST = 20480, 20480 + 2048 - 1  # 1 MiB
DISK_BYTES = 24 * 1024 * 1024
SENTINEL = b"kovenlab data partition " * 1000

needs_mtools = pytest.mark.skipif(
    shutil.which("mformat") is None,
    reason="writing FAT file systems needs mtools: run `just setup-image`",
)


def write_gpt(path: Path, parts: list[tuple[uuid.UUID, str, int, int]]) -> None:
    """A GPT disk image (primary header and table) with these (type, name, first, last)."""
    entries = bytearray(128 * 128)
    for index, (kind, name, first, last) in enumerate(parts):
        entries[index * 128 : (index + 1) * 128] = struct.pack(
            "<16s16sQQQ72s",
            kind.bytes_le,
            uuid.uuid4().bytes_le,
            first,
            last,
            0,
            name.encode("utf-16-le"),
        )
    lbas = DISK_BYTES // SECTOR
    header = bytearray(
        struct.pack(
            "<8sIIIIQQQQ16sQIII",
            b"EFI PART",
            0x10000,
            92,
            0,
            0,
            1,
            lbas - 1,
            34,
            lbas - 34,
            uuid.uuid4().bytes_le,
            2,
            128,
            128,
            zlib.crc32(entries),
        )
    )
    header[16:20] = struct.pack("<I", zlib.crc32(header))
    with path.open("wb") as f:
        f.truncate(DISK_BYTES)
        f.seek(SECTOR)
        f.write(header)
        f.seek(2 * SECTOR)
        f.write(entries)
        f.seek(DATA_FIRST * SECTOR)
        f.write(SENTINEL)


def run_mtools(*argv: str) -> None:
    subprocess.run(
        argv, check=True, capture_output=True, env={**os.environ, "MTOOLS_SKIP_CHECK": "1"}
    )


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """An image as the build lays it out, in small: a FAT ESP and a data partition."""
    path = tmp_path / "disk.img"
    write_gpt(
        path,
        [
            (ESP_TYPE, "kvl-esp", ESP_FIRST, ESP_LAST),
            (LINUX_DATA_TYPE, "kvl-data", DATA_FIRST, DATA_LAST),
        ],
    )
    if shutil.which("mformat") is not None:
        count = ESP_LAST - ESP_FIRST + 1
        run_mtools("mformat", "-i", f"{path}@@{ESP_FIRST * SECTOR}", "-T", str(count), "-h",
                   "16", "-s", "32", "-v", "ESP", "::")  # fmt: skip
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def configure(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["image", "configure", *args])
    return result.exit_code, result.output


def expected(name: str = "lab-1", labels: dict[str, str] | None = None) -> Provisioning:
    return Provisioning(
        hub_url=HUB, token=TOKEN, hub_fingerprint=FINGERPRINT, name=name, labels=labels or {}
    )


def test_partitions_are_read_from_the_gpt(disk: Path) -> None:
    esp, data = partitions(disk)
    assert (esp.number, esp.type, esp.name, esp.offset) == (1, ESP_TYPE, "kvl-esp", 1024 * 1024)
    assert esp.size == 8 * 1024 * 1024
    assert (data.number, data.name, data.size) == (2, "kvl-data", 1024 * 1024)


@needs_mtools
def test_configure_writes_the_file_onto_the_esp_only(disk: Path) -> None:
    assert read_provisioning(disk) is None
    options = ["--hub", HUB, "--token", TOKEN, "--fingerprint", FINGERPRINT]
    code, output = configure(str(disk), *options, "--name", "lab-1", "--label", "room=12")
    assert code == 0, output
    assert read_provisioning(disk) == expected(labels={"room": "12"})
    with disk.open("rb") as f:  # the data partition is as it was
        f.seek(DATA_FIRST * SECTOR)
        assert f.read(len(SENTINEL)) == SENTINEL

    # Again, for another node: the file is replaced.
    code, output = configure(str(disk), *options, "--name", "lab-2")
    assert code == 0, output
    assert read_provisioning(disk) == expected(name="lab-2")

    shown = CliRunner().invoke(main, ["image", "show", str(disk), "--json"])
    assert shown.exit_code == 0, shown.output
    document = json.loads(shown.output)
    assert document["provisioning"]["name"] == "lab-2"
    assert document["provisioning"]["token"] == TOKEN[:13] + "…"  # never the whole secret
    assert [p["name"] for p in document["partitions"]] == ["kvl-esp", "kvl-data"]


@needs_mtools
def test_configure_takes_a_provisioning_file(disk: Path, tmp_path: Path) -> None:
    source = tmp_path / "kovenlab.json"
    source.write_text(expected(labels={"rack": "4"}).model_dump_json())
    code, output = configure(str(disk), "--provisioning", str(source))
    assert code == 0, output
    assert read_provisioning(disk) == expected(labels={"rack": "4"})

    code, output = configure(str(disk), "--provisioning", str(source), "--name", "other")
    assert code == 2
    assert "--provisioning comes alone, without --name" in output


@needs_mtools
def test_the_token_can_come_from_the_environment(disk: Path) -> None:
    result = CliRunner(env={"KVL_ENROLLMENT_TOKEN": TOKEN}).invoke(
        main,
        ["image", "configure", str(disk), "--hub", HUB, "--fingerprint", FINGERPRINT,
         "--name", "lab-1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert read_provisioning(disk) == expected()


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--hub", "http://198.18.0.2:8443", "only speaks HTTPS"),
        ("--hub", "https://", "names no host"),
        ("--hub", "https://hub:99999", "is not a URL"),
        ("--hub", "https://hub:8443/v1/enroll", "the hub's address alone"),
        ("--hub", "hub:8443", "only speaks HTTPS"),
        ("--token", "kvl_Abcdefgh_" + "x" * 32, "not an enrollment token"),
        ("--token", "kvle_short", "not an enrollment token"),
        ("--fingerprint", "sha256:00", "--fingerprint"),
        ("--name", "no spaces", "--name"),
    ],
)
def test_bad_input_is_refused_before_the_image_is_touched(
    disk: Path, flag: str, value: str, said: str
) -> None:
    given = {"--hub": HUB, "--token": TOKEN, "--fingerprint": FINGERPRINT, "--name": "lab-1"}
    given[flag] = value
    before = digest(disk)
    code, output = configure(str(disk), *(part for pair in given.items() for part in pair))
    assert code == 2, output
    assert said in output
    assert flag in output
    assert digest(disk) == before


def test_missing_options_are_named(disk: Path) -> None:
    code, output = configure(str(disk), "--hub", HUB)
    assert code == 2
    assert "missing --token, --fingerprint, --name" in output


def test_a_file_that_is_not_a_gpt_image_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not-an-image.img"
    path.write_bytes(b"\x00" * 4096)
    code, output = configure(str(path), "--provisioning", str(write_expected(tmp_path)))
    assert code == 1
    assert "is not a GPT disk image" in output


def test_an_image_without_an_esp_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "no-esp.img"
    write_gpt(path, [(LINUX_DATA_TYPE, "kvl-data", DATA_FIRST, DATA_LAST)])
    before = digest(path)
    code, output = configure(str(path), "--provisioning", str(write_expected(tmp_path)))
    assert code == 1
    assert "has no EFI system partition" in output
    assert digest(path) == before


def test_a_damaged_partition_table_is_refused(disk: Path) -> None:
    with disk.open("r+b") as f:
        f.seek(2 * SECTOR + 56)  # the first entry's name
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(ImageError, match="partition table is damaged"):
        partitions(disk)


def test_a_truncated_image_is_refused(disk: Path) -> None:
    with disk.open("r+b") as f:
        f.truncate(DATA_FIRST * SECTOR)
    with pytest.raises(ImageError, match="past the end of the file"):
        partitions(disk)


@needs_mtools
def test_an_esp_without_a_file_system_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "blank-esp.img"
    write_gpt(path, [(ESP_TYPE, "kvl-esp", ESP_FIRST, ESP_LAST)])
    code, output = configure(str(path), "--provisioning", str(write_expected(tmp_path)))
    assert code == 1
    assert "holds no FAT file system" in output


def write_expected(folder: Path) -> Path:
    path = folder / "kovenlab.json"
    path.write_text(expected().model_dump_json())
    return path


@needs_mtools
def test_a_file_named_in_capitals_is_found(disk: Path, tmp_path: Path) -> None:
    """As another system may have written it: FAT, and the first boot, ignore case."""
    source = write_expected(tmp_path)
    run_mtools("mcopy", "-i", f"{disk}@@{ESP_FIRST * SECTOR}", str(source), "::/KOVENLAB.JSON")
    assert read_provisioning(disk) == expected()


@needs_mtools
def test_no_hub_writes_a_bootstrap_keys_hash_and_prints_the_key_once(
    disk: Path, tmp_path: Path
) -> None:
    result = CliRunner().invoke(main, ["image", "configure", str(disk), "--no-hub", "--name",
                                       "lab-1", "--admin-account", "ops"])  # fmt: skip
    assert result.exit_code == 0, result.output
    key = result.stdout.strip()  # alone on stdout, so `> file` keeps it
    assert parse_prefix(key) is not None
    document = read_provisioning(disk)
    assert document is not None
    assert document.hub is None
    assert document.bootstrap_key == BootstrapKey(
        account="ops", prefix=key.split("_")[1], hash=hash_key(key)
    )
    assert key.encode() not in disk.read_bytes()  # only its hash went into the image
    assert "bootstrap admin key" in result.stderr

    shown = CliRunner().invoke(main, ["image", "show", str(disk), "--json"])
    assert shown.exit_code == 0, shown.output
    provisioning = json.loads(shown.output)["provisioning"]
    assert provisioning["bootstrap_key"] == f"{key.split('_')[1]} (account ops)"
    assert "token" not in provisioning

    # A file of a site without a hub is taken whole too.
    source = tmp_path / "kovenlab.json"
    source.write_text(document.text())
    code, output = configure(str(disk), "--provisioning", str(source))
    assert code == 0, output
    assert read_provisioning(disk) == document


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--no-hub", "--name", "lab-1", "--hub", HUB], "leave out --hub"),
        (["--no-hub", "--name", "lab-1", "--token", TOKEN], "leave out --token"),
        (["--no-hub", "--name", "lab-1", "--label", "a=b"], "leave out --label"),
        (["--no-hub"], "missing --name"),
        (["--no-hub", "--name", "lab-1", "--admin-account", "a b"], "--admin-account"),
        (["--no-hub", "--name", "no spaces"], "--name"),
        (["--name", "lab-1", "--admin-account", "ops"], "leave out --admin-account"),
    ],
)
def test_no_hub_refuses_what_does_not_belong_before_the_image_is_touched(
    disk: Path, args: list[str], said: str
) -> None:
    before = digest(disk)
    result = CliRunner().invoke(main, ["image", "configure", str(disk), *args])
    assert result.exit_code == 2, result.output
    assert said in result.output
    assert result.stdout.find("kvl_") == -1  # no key printed for a file never written
    assert digest(disk) == before


def test_a_site_network_goes_into_the_file_and_a_wrong_one_is_named(disk: Path) -> None:
    network = ["--address", "198.18.7.20/24", "--gateway", "198.18.7.2", "--dns", "198.18.7.3",
               "--https-proxy", "http://198.18.7.2:3128", "--no-proxy", ".lan"]  # fmt: skip
    result = CliRunner().invoke(
        main, ["image", "configure", str(disk), "--no-hub", "--name", "lab-1", *network]
    )
    assert result.exit_code == 0, result.output
    document = read_provisioning(disk)
    assert document is not None
    assert document.network is not None
    assert document.network.system() == {
        "interfaces": "en* eth*", "addresses": ["198.18.7.20/24"], "gateways": ["198.18.7.2"],
        "dns": ["198.18.7.3"],
    }  # fmt: skip
    assert document.network.https_proxy == "http://198.18.7.2:3128"
    assert document.network.no_proxy == [".lan"]

    before = digest(disk)
    for args, said in (
        (["--address", "198.18.7.20/24", "--gateway", "198.18.9.1"], "--gateway: "),
        (["--address", "198.18.7.0/24"], "--address: "),
        (["--dns", "nameserver"], "--dns: "),
        (["--https-proxy", "socks://p"], "--https-proxy: "),
    ):
        result = CliRunner().invoke(
            main, ["image", "configure", str(disk), "--no-hub", "--name", "lab-1", *args]
        )
        assert result.exit_code == 2, result.output
        assert said in result.output, result.output
        assert result.stdout.find("kvl_") == -1
    assert digest(disk) == before
