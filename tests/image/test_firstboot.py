"""The image's first boot: the provisioning file from the EFI system partition applied, left
alone when absent, and refused (nothing changed) when wrong."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from image.firstboot import Layout, first_boot, hostname_for, main
from shared.provisioning import BootstrapKey, Provisioning

FINGERPRINT = "sha256:" + "ab" * 32
TOKEN = "kvle_Abcdefgh_" + "x" * 32


def provisioning(name: str = "Lab_Server.1") -> Provisioning:
    return Provisioning(
        hub_url="https://198.18.0.2:8443",
        token=TOKEN,
        hub_fingerprint=FINGERPRINT,
        name=name,
        labels={"room": "12"},
    )


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    made = Layout(esp=tmp_path / "esp", data=tmp_path / "data", etc=tmp_path / "etc")
    for folder in (made.esp, made.data, made.etc, made.appliance_data):
        folder.mkdir(parents=True)
    return made


def test_a_valid_file_is_copied_and_the_appliance_pointed_at_it(layout: Layout) -> None:
    layout.source.write_text(provisioning().model_dump_json())
    named: list[str] = []

    message = first_boot(layout, named.append)

    assert Provisioning.load(layout.target) == provisioning()
    assert stat.S_IMODE(layout.target.stat().st_mode) == 0o600
    assert layout.target.stat().st_uid == layout.appliance_data.stat().st_uid
    assert layout.env_file.read_text() == f"KVL_FLEET__PROVISIONING_FILE={layout.target}\n"
    assert named == ["lab-server-1"]
    assert (layout.etc / "hostname").read_text() == "lab-server-1\n"
    assert "node Lab_Server.1" in message


def test_a_file_without_a_hub_points_the_appliance_at_its_bootstrap_key(layout: Layout) -> None:
    key, plaintext = BootstrapKey.generate()
    document = Provisioning(name="lab-server", bootstrap_key=key)
    layout.source.write_text(document.text())

    message = first_boot(layout, lambda _: None)

    assert Provisioning.load(layout.target) == document
    assert plaintext not in layout.target.read_text()
    assert stat.S_IMODE(layout.target.stat().st_mode) == 0o600
    assert layout.env_file.read_text() == f"KVL_FLEET__PROVISIONING_FILE={layout.target}\n"
    assert f"bootstrap admin key {key.prefix} of account admin" in message
    assert "no hub" in message


def test_no_file_leaves_the_appliance_serving_its_lan_alone(layout: Layout) -> None:
    named: list[str] = []
    message = first_boot(layout, named.append)
    assert "without a hub" in message
    assert not layout.target.exists()
    assert not layout.env_file.exists()
    assert named == []
    assert main(layout) == 0


def test_a_file_copied_at_an_earlier_boot_stays_when_the_esp_has_none(layout: Layout) -> None:
    layout.source.write_text(provisioning().model_dump_json())
    first_boot(layout, lambda _: None)
    layout.source.unlink()

    message = first_boot(layout, lambda _: None)

    assert "stays in force" in message
    assert Provisioning.load(layout.target) == provisioning()
    assert layout.env_file.is_file()


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ('{"hub_url": "https://hub:8443"', "(file)"),  # not JSON
        (provisioning().model_dump_json().replace(FINGERPRINT, "sha256:00"), "hub_fingerprint"),
        (provisioning().model_dump_json().replace("https://", "http://"), "hub_url"),
        ('{"extra": 1}', "name"),
        # A hub's fields come together: a missing one is named, never a node left hubless.
        (provisioning().model_dump_json(exclude={"token"}), "missing: token"),
        ('{"name": "n"}', "bootstrap_key"),  # neither a hub nor a bootstrap key
        (
            provisioning()
            .model_copy(update={"bootstrap_key": BootstrapKey.generate()[0]})
            .model_dump_json(),
            "bootstrap_key is for a site without a hub",
        ),
    ],
)
def test_a_wrong_file_fails_closed_and_changes_nothing(
    layout: Layout, content: str, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    layout.source.write_text(content)
    with caplog.at_level(logging.ERROR, logger="kovenlab-firstboot"):
        assert main(layout) == 1
    assert not layout.target.exists()
    assert not layout.env_file.exists()
    assert not (layout.etc / "hostname").exists()
    assert named in caplog.text
    assert "Failing closed" in caplog.text


def test_a_wrong_file_does_not_replace_a_good_one(layout: Layout) -> None:
    layout.source.write_text(provisioning().model_dump_json())
    first_boot(layout, lambda _: None)
    layout.source.write_text("not json")
    assert main(layout) == 1
    assert Provisioning.load(layout.target) == provisioning()


def test_an_oversized_file_is_refused(layout: Layout) -> None:
    layout.source.write_text(" " * 70_000 + provisioning().model_dump_json())
    assert main(layout) == 1
    assert not layout.target.exists()


@pytest.mark.parametrize(
    ("name", "hostname"),
    [
        ("lab-server", "lab-server"),
        ("Lab_Server.1", "lab-server-1"),
        ("node..A__b", "node-a-b"),
        ("x" * 63, "x" * 63),
        ("_._", None),
    ],
)
def test_host_names_are_one_dns_label(name: str, hostname: str | None) -> None:
    assert hostname_for(name) == hostname
