"""RAUC with HTTP streaming: Debian 12's own package (1.8), built again from Debian's source
with streaming on, for the image.

Debian builds RAUC without libnl-genl, so its `rauc` cannot stream a bundle: given a URL it
downloads the whole bundle first. Streaming is what makes adaptive updates pay: RAUC reads
the bundle's block-hash index, finds the blocks the node has already (in either root slot),
and fetches only the others, by HTTP Range, checking each against the bundle's hash tree
(dm-verity) as it is read. A release that changes one package then costs a node a small part
of its bundle instead of all of it.

The build is Debian's packaging unchanged but for three lines: `--enable-streaming`, the
library it needs in Build-Depends, and a changelog entry for the version (`VERSION`, above
Debian's, so apt keeps it). It runs in a throwaway Debian 12 build chroot (mmdebstrap
`--variant=buildd`, as root, like the image's own tree), once per machine: the source is
pinned by the sha256 sums of Debian's .dsc, and the packages are kept in the cache folder the
build gives (about a minute on two cores).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

POOL = "http://deb.debian.org/debian/pool/main/r/rauc"
# Debian's rauc_1.8-2.dsc: the upstream tarball and Debian's packaging, by sha256
SOURCES = {
    "rauc_1.8.orig.tar.xz": "d233247c1763b1c56c851d0adef2094b7aa2fcd72decf524a8ac0419188e0978",
    "rauc_1.8-2.debian.tar.xz": "a092ec1b58710111b0e845c3a7376f0080170fe5377bd052808926405d203e8b",
}
UPSTREAM = "rauc-1.8"
VERSION = "1.8-2+kvl1"
PACKAGES = ("rauc", "rauc-service")  # the binary packages the image installs from here
# Debian's Build-Depends without those its tests need (built with nocheck), and libnl-genl
BUILD_DEPENDS = (
    "debhelper",
    "dh-autoreconf",
    "libcurl4-gnutls-dev",
    "libdbus-1-dev",
    "libfdisk-dev",
    "libglib2.0-dev",
    "libjson-glib-dev",
    "libssl-dev",
    "libtool",
    "pkg-config",
    "systemd",
    "libnl-genl-3-dev",
)
CHANGELOG = (
    f"rauc ({VERSION}) bookworm; urgency=medium\n\n"
    "  * Built with libnl-genl: HTTP streaming and adaptive updates.\n\n"
    " -- Kovenlab Edge <edge@kovenlab.invalid>  Mon, 07 Dec 2026 00:00:00 +0000\n\n"
)
# Run in the build chroot (mmdebstrap's customize hook; $1 is the chroot), from /build
# holding the sources and the changelog entry.
BUILD = f"""set -eu
cd /build
mkdir {UPSTREAM}
tar -xf rauc_1.8.orig.tar.xz
cd {UPSTREAM}
tar -xf ../rauc_1.8-2.debian.tar.xz
grep -q -- '--enable-gpt$' debian/rules
sed -i 's/--enable-gpt$/--enable-gpt --enable-streaming/' debian/rules
sed -i 's/^Build-Depends: /Build-Depends: libnl-genl-3-dev, /' debian/control
cat ../changelog debian/changelog > debian/changelog.new
mv debian/changelog.new debian/changelog
DEB_BUILD_OPTIONS="nocheck parallel=2" DEB_BUILD_PROFILES=nocheck dpkg-buildpackage -b -uc -us
"""


class RaucBuildError(RuntimeError):
    """The source did not match its pinned digest, or its build failed."""


def key() -> str:
    parts = (SOURCES, VERSION, BUILD_DEPENDS, CHANGELOG, BUILD)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def debs(
    cache: Path,
    suite: str,
    mirrors: Sequence[str],
    run: Callable[[list[str]], object],
    fetch: Callable[[str, Path], None] | None = None,
) -> list[Path]:
    """The image's RAUC packages (`PACKAGES`), built once into `cache`; `run` runs a build
    command (as root), `fetch` downloads a URL to a file."""
    folder = cache / f"rauc-{key()[:16]}"
    if (folder / ".complete").is_file():
        return _packages(folder)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    if partial.exists():
        shutil.rmtree(partial)
    try:
        _build(partial, suite, mirrors, run, fetch or _download)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        partial.rename(folder)
    except OSError:  # another build on this machine made it first: take that one
        if not (folder / ".complete").is_file():
            raise
        shutil.rmtree(partial)
    return _packages(folder)


def _build(
    partial: Path,
    suite: str,
    mirrors: Sequence[str],
    run: Callable[[list[str]], object],
    fetch: Callable[[str, Path], None],
) -> None:
    source = partial / "source"
    source.mkdir(parents=True)
    for name, sha256 in SOURCES.items():
        fetch(f"{POOL}/{name}", source / name)
        got = hashlib.sha256((source / name).read_bytes()).hexdigest()
        if got != sha256:
            raise RaucBuildError(f"{name} from {POOL} has sha256 {got}, not {sha256}")
    (source / "changelog").write_text(CHANGELOG)
    (source / "build.sh").write_text(BUILD)
    out = partial / "out"
    out.mkdir()
    hook = (
        f'mkdir "$1/build" && cp -a {shlex.quote(str(source))}/. "$1/build/" && '
        'chroot "$1" sh /build/build.sh && '
        f'cp "$1"/build/*.deb {shlex.quote(str(out))}/'
    )
    run(
        ["mmdebstrap", "--mode=root", "--variant=buildd",
         f"--include={','.join(BUILD_DEPENDS)}", f"--customize-hook={hook}",
         suite, "/dev/null", *mirrors]
    )  # fmt: skip
    for deb in out.glob("*.deb"):
        if deb.name.split("_")[0] in PACKAGES:
            deb.rename(partial / deb.name)
    shutil.rmtree(source)
    shutil.rmtree(out)
    if len(_packages(partial)) != len(PACKAGES):
        raise RaucBuildError(f"the build made {_packages(partial)}, not {PACKAGES}")
    (partial / ".complete").write_text(VERSION + "\n")


def _packages(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*_{VERSION}_*.deb"))


def _download(url: str, target: Path) -> None:
    with urllib.request.urlopen(url, timeout=120) as answer, target.open("wb") as out:  # noqa: S310 - a pinned http URL, checked by digest
        shutil.copyfileobj(answer, out)
