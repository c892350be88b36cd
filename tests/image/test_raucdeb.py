"""The image's RAUC packages (image/raucdeb.py) around their build: the source is taken only
at the digests Debian's .dsc names, a failed build leaves nothing in the cache, and a build
kept in the cache is used as it is. The build itself (Debian's packaging in a build chroot)
runs with every image build: the image tier boots what it made and streams a release."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import pytest

from image import raucdeb

if TYPE_CHECKING:
    from pathlib import Path


def _never(argv: list[str]) -> None:
    raise AssertionError(f"ran {argv}")


def test_a_source_that_is_not_debians_is_refused_before_any_build(tmp_path: Path) -> None:
    def fetch(url: str, target: Path) -> None:
        target.write_bytes(b"not the tarball " + url.encode())

    with pytest.raises(raucdeb.RaucBuildError, match=r"rauc_1\.8\.orig\.tar\.xz .* has sha256"):
        raucdeb.debs(tmp_path, "bookworm", (), _never, fetch)
    assert list(tmp_path.iterdir()) == []  # nothing half made is left


def test_a_build_that_makes_no_packages_fails_and_keeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sources pinned at these bytes here: the build step itself is what fails.
    served = {name: f"{name} here".encode() for name in raucdeb.SOURCES}
    pinned = {name: hashlib.sha256(data).hexdigest() for name, data in served.items()}
    monkeypatch.setattr(raucdeb, "SOURCES", pinned)

    def fetch(url: str, target: Path) -> None:
        target.write_bytes(served[url.rsplit("/", 1)[1]])

    ran: list[list[str]] = []
    mirrors = ("deb http://mirror bookworm main",)
    with pytest.raises(raucdeb.RaucBuildError, match="the build made"):
        raucdeb.debs(tmp_path, "bookworm", mirrors, ran.append, fetch)
    assert len(ran) == 1
    argv = ran[0]
    assert argv[:3] == ["mmdebstrap", "--mode=root", "--variant=buildd"]
    assert "libnl-genl-3-dev" in argv[3]
    assert argv[-3:] == ["bookworm", "/dev/null", *mirrors]
    assert list(tmp_path.iterdir()) == []


def test_a_kept_build_is_used_as_it_is(tmp_path: Path) -> None:
    folder = tmp_path / f"rauc-{raucdeb.key()[:16]}"
    folder.mkdir()
    debs = [folder / f"rauc_{raucdeb.VERSION}_amd64.deb",
            folder / f"rauc-service_{raucdeb.VERSION}_all.deb"]  # fmt: skip
    for deb in debs:
        deb.write_bytes(b"!<arch>\n")
    (folder / ".complete").write_text(raucdeb.VERSION)
    assert raucdeb.debs(tmp_path, "bookworm", (), _never) == sorted(debs)


def test_the_build_turns_streaming_on_in_debians_packaging() -> None:
    # dh_auto_configure's line in Debian's debian/rules is checked before it is changed: a
    # new Debian revision that moved it fails the build instead of building without streaming
    assert "grep -q -- '--enable-gpt$' debian/rules" in raucdeb.BUILD
    assert "--enable-gpt --enable-streaming" in raucdeb.BUILD
    assert raucdeb.VERSION.startswith("1.8-2+")  # above Debian's 1.8-2: apt keeps it
