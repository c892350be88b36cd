"""The appliance image booted as a site server would boot it: QEMU with OVMF (UEFI), the image
as its one disk, a NIC on QEMU's user-mode network with the LAN API's port forwarded to this
machine's loopback; and a real hub in its own network namespace, which the guest reaches
through that network (QEMU opens its connections from this machine, which routes them over
a veth pair to the namespace). The `image` test and `just bench image` share this.

KVM where it can run a stock kernel; TCG (emulation: minutes, not seconds) where it cannot,
for example under PVM, whose KVM runs only guests built for it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from image import netns
from image.configure import DATA_LABEL, ESP_LABEL, ROOT_A_LABEL, ROOT_B_LABEL, partitions
from tests.conftest import free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from concurrent.futures import Future

REPO = Path(__file__).resolve().parents[2]
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
QEMU = "qemu-system-x86_64"
NODE_NAME = "image-node"
SITE = "lab"
HUB_PORT = 8443
WG_PORT = 51820
# Inside the hub's namespace and the guest only: never routed on this machine.
OVERLAY = "198.18.192.0/24"
# How long a boot may take to answer /readyz: the target under KVM is 30 s (the benchmark
# measures it); TCG emulates every instruction on two cores.
READY_BOUND_S = {"kvm": 180.0, "tcg": 1200.0}
ENROLLED_BOUND_S = {"kvm": 120.0, "tcg": 600.0}
# A flashed disk is this much larger than the image (a real disk is): the data partition grows.
GROW = 2 * 1024**3
# The guest's LAN under QEMU's user-mode network (its own default is a private range).
LAN = "198.18.7.0/24"


def accelerator() -> str:
    """`kvm` where /dev/kvm runs a stock guest, else `tcg`; $KVL_IMAGE_ACCEL overrides."""
    forced = os.environ.get("KVL_IMAGE_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    # PVM (the kvm_pvm module) is KVM for guest kernels built for it: OVMF and Debian's
    # kernel stop with an emulation failure in their first instructions.
    if Path("/sys/module/kvm_pvm").exists():
        return "tcg"
    return "kvm"


def unavailable() -> str | None:
    """Why the image cannot be built and booted here, or None."""
    from image.build import missing_tools  # noqa: PLC0415

    if os.geteuid() != 0:
        return "building the image and the hub's namespace need root"
    missing = missing_tools()
    if missing:
        return f"missing build tools ({', '.join(missing)}): run `just setup-image`"
    if shutil.which(QEMU) is None or not OVMF_CODE.is_file():
        return f"{QEMU} or OVMF is not installed: run `just setup-image`"
    return netns.available()


def build_image(timeout_s: float = 3600) -> dict[str, Any]:
    """`python -m image.build` (kept when its inputs have not changed); its manifest."""
    result = subprocess.run(
        [sys.executable, "-m", "image.build"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s,
    )
    if result.returncode != 0:
        raise AssertionError(f"the image build failed:\n{result.stderr[-4000:]}")
    from image.build import DEFAULT_BUILD_DIR, MANIFEST_NAME  # noqa: PLC0415

    manifest: dict[str, Any] = json.loads((DEFAULT_BUILD_DIR / MANIFEST_NAME).read_text())
    return manifest


def copy_image(source: Path, target: Path, grow_bytes: int) -> Path:
    """A sparse copy of the image on a disk `grow_bytes` larger than it (a real disk is)."""
    subprocess.run(["cp", "--sparse=always", str(source), str(target)], check=True)
    with target.open("r+b") as f:
        f.truncate(source.stat().st_size + grow_bytes)
    return target


def kvl(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "shared.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    if result.returncode != 0:
        raise AssertionError(f"kvl {' '.join(args[:3])} failed:\n{result.stderr}")
    return result.stdout


@dataclass
class Hub:
    """`kvl hub serve` in namespace `namespace`, at `address`, with its WireGuard overlay."""

    data: Path
    namespace: str
    address: str
    env: dict[str, str]
    provisioning: Path
    process: subprocess.Popen[bytes] | None = None
    veth: str = ""  # the namespace's end of its link

    def sent_bytes(self) -> int:
        """Bytes the hub's namespace has sent over its link: all it sent the node (WireGuard,
        TLS and HTTP included)."""
        done = subprocess.run(
            netns.argv(self.namespace, "cat", f"/sys/class/net/{self.veth}/statistics/tx_bytes"),
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        return int(done.stdout)

    @property
    def url(self) -> str:
        return f"https://{self.address}:{HUB_PORT}"

    @property
    def ca(self) -> Path:
        return self.data / "pki" / "ca.crt"

    def nodes(self) -> list[dict[str, Any]]:
        out = kvl("hub", "nodes", "list", "--json", "--data-dir", str(self.data), env=self.env)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def cli(self, *args: str) -> str:
        """`kvl hub ARGS` on this hub's data directory (its store, as the running hub's)."""
        return kvl("hub", *args, "--data-dir", str(self.data), env=self.env)

    def rollout(self, rollout_id: str) -> dict[str, Any]:
        view: dict[str, Any] = json.loads(self.cli("rollouts", "show", rollout_id, "--json"))
        return view

    def log_tail(self) -> str:
        path = self.data.parent / "hub.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-20:])


@contextmanager
def hub_in_namespace(folder: Path) -> Iterator[Hub]:
    """A hub in a namespace of its own on a veth link from a random /30 of 198.19.0.0/16,
    and a provisioning file for one node (`NODE_NAME`, site `SITE`)."""
    suffix = secrets.token_hex(2)
    namespace = f"kvl-img-{suffix}"
    outside, inside = f"kvi{suffix}h", f"kvi{suffix}n"
    third, fourth = secrets.randbelow(256), secrets.randbelow(64) * 4
    host_address, address = f"198.19.{third}.{fourth + 1}", f"198.19.{third}.{fourth + 2}"
    data = folder / "hub"
    data.mkdir(parents=True)
    env = {
        "KVL_HUB_SERVER__NAMES": json.dumps([address]),
        "KVL_HUB_SERVER__PORT": str(HUB_PORT),
        "KVL_HUB_OVERLAY__PREFIX": OVERLAY,
        "KVL_HUB_OVERLAY__ENDPOINT": f"{address}:{WG_PORT}",
        "KVL_HUB_OVERLAY__LISTEN_PORT": str(WG_PORT),
        "KVL_HUB_OVERLAY__INTERFACE": f"kvi{suffix}w",
        # Rollouts move on within a second of what a node reports (5 s by default).
        "KVL_HUB_FLEET__ROLLOUT_EVERY_S": "1",
    }
    hub = Hub(data, namespace, address, env, folder / "kovenlab.json", veth=inside)
    provision = ["--site", SITE, "--name", NODE_NAME, "--url", hub.url, "--expires", "2h"]
    kvl("hub", "provision", *provision, "--output", str(hub.provisioning), "--data-dir", str(data),
        env=env)  # fmt: skip
    try:
        netns.ip("netns", "add", namespace)
        netns.veth_into(namespace, outside, inside, f"{host_address}/30", f"{address}/30")
        with (folder / "hub.log").open("ab") as log:
            hub.process = subprocess.Popen(
                netns.argv(namespace, sys.executable, "-m", "shared.cli", "hub", "serve",
                           "--data-dir", str(data), "--host", address),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, **env},
            )  # fmt: skip
        wait_for(lambda: _listening(address, HUB_PORT), "the hub to listen", 60, hub.log_tail)
        yield hub
    finally:
        if hub.process is not None and hub.process.poll() is None:
            hub.process.send_signal(signal.SIGINT)
            try:
                hub.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                hub.process.kill()
                hub.process.wait()
        netns.delete(namespace)
        netns.delete_link(outside)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def wait_for(
    condition: Callable[[], bool], what: str, bound_s: float, why: Callable[[], str]
) -> float:
    """Seconds until `condition()`; past `bound_s`, an AssertionError with `why()`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > bound_s:
            raise AssertionError(f"timed out after {bound_s:g} s waiting for {what}\n{why()}")
        time.sleep(0.5)
    return time.monotonic() - started


@dataclass
class Machine:
    """The image booted under QEMU; `port` on 127.0.0.1 reaches the guest's LAN API."""

    disk: Path
    folder: Path
    accel: str = field(default_factory=accelerator)
    memory_mib: int = 3072
    cpus: int = 2
    port: int = field(default_factory=free_port)
    qmp_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    # QEMU's user-mode network: the guest's LAN, where this machine's loopback is its .2
    # (its DHCP server gives .15 onwards, its DNS is .3)
    lan: str = LAN
    # The address the LAN API is forwarded to: a static one the guest must have taken, or
    # (None) whichever DHCP gave it.
    guest: str | None = None
    # More of the guest's addresses forwarded, each from a port of its own (`ports`).
    more_guests: tuple[str, ...] = ()
    ports: dict[str, int] = field(default_factory=dict)
    # A raw disk image plugged in as a USB stick (a file system, no partition table).
    usb: Path | None = None

    def __post_init__(self) -> None:
        self.ports = {guest: free_port() for guest in self.more_guests}

    @property
    def host_address(self) -> str:
        return str(ipaddress.ip_network(self.lan)[2])

    @property
    def serial_log(self) -> Path:
        return self.folder / "serial.log"

    def start(self) -> Machine:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.accel == "tcg":
            add_boot_options(self.disk, EMULATED_OPTIONS)
        variables = self.folder / "OVMF_VARS.fd"
        shutil.copyfile(OVMF_VARS, variables)
        accel, cpu = ("kvm", "host") if self.accel == "kvm" else ("tcg,thread=multi", "max")
        argv = [
            QEMU, "-machine", "q35", "-accel", accel, "-cpu", cpu,
            "-smp", str(self.cpus), "-m", str(self.memory_mib), "-nodefaults", "-display", "none",
            "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
            "-drive", f"if=pflash,format=raw,file={variables}",
            "-drive", f"file={self.disk},format=raw,if=virtio",
            # No option ROM on the NIC: the firmware boots the disk without trying the network.
            "-netdev", f"user,id=lan,net={self.lan},"
                       f"hostfwd=tcp:127.0.0.1:{self.port}-{self.guest or ''}:8080"
                       + "".join(f",hostfwd=tcp:127.0.0.1:{port}-{guest}:8080"
                                 for guest, port in self.ports.items()),
            "-device", "virtio-net-pci,netdev=lan,romfile=",
            *(
                ["-device", "qemu-xhci,id=xhci",
                 "-drive", f"if=none,id=stick,format=raw,file={self.usb}",
                 "-device", "usb-storage,bus=xhci.0,drive=stick,removable=on"]
                if self.usb is not None else []
            ),
            "-object", "rng-random,id=rng,filename=/dev/urandom",
            "-device", "virtio-rng-pci,rng=rng",
            "-serial", f"file:{self.serial_log}",
            "-qmp", f"tcp:127.0.0.1:{self.qmp_port},server=on,wait=off",
        ]  # fmt: skip
        with (self.folder / "qemu.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()
        return self

    def console(self) -> str:
        return self.serial_log.read_text(errors="replace") if self.serial_log.is_file() else ""

    def wait_console(self, text: str, count: int = 1, bound_s: float | None = None) -> None:
        """Until the serial console has shown `text` `count` times (the image's services log
        to it: kovenlab-health says which slot it marked, and how)."""
        bound = bound_s if bound_s is not None else READY_BOUND_S[self.accel]

        def shown() -> bool:
            if not self.running():
                raise AssertionError(f"QEMU exited\n{self.diagnostics()}")
            return self.console().count(text) >= count

        wait_for(shown, f"{text!r} x{count} on the console", bound, self.diagnostics)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def answers(self, url: str, context: ssl.SSLContext | None = None) -> bool:
        if not self.running():
            raise AssertionError(f"QEMU exited ({self.process and self.process.returncode})\n"
                                 f"{self.diagnostics()}")  # fmt: skip
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as answer:
                return int(answer.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, scheme: str = "http", context: ssl.SSLContext | None = None) -> float:
        """Seconds from the power button to `/readyz` answering 200."""
        host = "localhost" if scheme == "https" else "127.0.0.1"
        url = f"{scheme}://{host}:{self.port}/readyz"
        bound = READY_BOUND_S[self.accel]
        wait_for(lambda: self.answers(url, context), f"{url} ({self.accel})", bound,
                 self.diagnostics)  # fmt: skip
        return time.monotonic() - self.started

    def _qmp(self, command: str) -> None:
        with socket.create_connection(("127.0.0.1", self.qmp_port), timeout=10) as s:
            stream = s.makefile("rw")
            stream.readline()  # the greeting
            for execute in ("qmp_capabilities", command):
                stream.write(json.dumps({"execute": execute}) + "\n")
                stream.flush()
                stream.readline()

    def power_off(self) -> None:
        """The power button (ACPI): systemd stops the appliance and syncs; killed past a bound."""
        if not self.running() or self.process is None:
            return
        with suppress(OSError):
            self._qmp("system_powerdown")
        try:
            self.process.wait(timeout=60 if self.accel == "kvm" else 300)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Machine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def diagnostics(self) -> str:
        """The end of the serial console and of the appliance's journal, read from the disk."""
        serial = self.serial_log.read_text(errors="replace") if self.serial_log.is_file() else ""
        return (
            f"--- serial console (last lines) ---\n{serial[-3000:]}\n"
            f"--- journal of the kovenlab units ---\n{journal(self.disk)}"
        )


DEBUGFS = "debugfs"
VENV = "/opt/kovenlab/venv"  # the appliance's environment in the image (image/build.py)
UNITS = (
    "kovenlab-network", "kovenlab-network-apply", "kovenlab-firstboot", "kovenlab-appliance",
    "kovenlab-health", "rauc",
)  # fmt: skip


def _debugfs() -> str:
    found = shutil.which(DEBUGFS, path="/usr/sbin:/sbin:/usr/bin")
    if found is None:
        raise AssertionError("debugfs (e2fsprogs) is missing: run `just setup-image`")
    return found


def _partition(disk: Path, label: str) -> Any:
    found = next((p for p in partitions(disk) if p.name == label), None)
    if found is None:
        raise AssertionError(f"{disk} has no partition {label}")
    return found


def usb_stick(path: Path, files: list[Path], size_mib: int = 64) -> Path:
    """A raw FAT file system holding `files` at its top, to plug in as a USB stick."""
    with path.open("wb") as out:
        out.truncate(size_mib << 20)
    subprocess.run(["/usr/sbin/mkfs.vfat", "-n", "KVLSTICK", str(path)], check=True,
                   capture_output=True)  # fmt: skip
    env = {**os.environ, "MTOOLS_SKIP_CHECK": "1"}
    for file in files:
        subprocess.run(["mcopy", "-i", str(path), str(file), f"::/{file.name}"], check=True,
                       capture_output=True, env=env)  # fmt: skip
    return path


def journal(disk: Path, lines: int = 60) -> str:
    """The guest's journal for the image's units, read from the image file, from each root
    slot that has one (debugfs copies it out of the file system; nothing is mounted)."""
    journalctl = shutil.which("journalctl")
    if journalctl is None or shutil.which(DEBUGFS, path="/usr/sbin:/sbin:/usr/bin") is None:
        return "(debugfs or journalctl missing: no journal)"
    shown_all = []
    for label in (ROOT_A_LABEL, ROOT_B_LABEL):
        root = _partition(disk, label)
        with tempfile.TemporaryDirectory(prefix="kvl-journal-") as out:
            subprocess.run(
                [_debugfs(), "-R", f"rdump /var/log/journal {out}", f"{disk}?offset={root.offset}"],
                capture_output=True,
                check=False,
                timeout=120,
            )
            if not (Path(out) / "journal").is_dir():
                continue
            units = [arg for unit in UNITS for arg in ("-u", unit)]
            shown = subprocess.run(
                [journalctl, "-D", f"{out}/journal", "--no-pager", "-o", "short-monotonic",
                 *units, "-n", str(lines)],
                capture_output=True,
                text=True,
                check=False,
                timeout=60,
            )  # fmt: skip
            shown_all.append(f"[{label}]\n{shown.stdout or shown.stderr}")
    return "\n".join(shown_all) or "(no journal in either slot)"


def read_file(disk: Path, label: str, path: str) -> str:
    """A file of an ext4 partition of the disk image (debugfs; nothing is mounted)."""
    part = _partition(disk, label)
    shown = subprocess.run(
        [_debugfs(), "-R", f"cat {path}", f"{disk}?offset={part.offset}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    return shown.stdout


def write_files(image: Path, files: dict[str, bytes], offset: int = 0) -> None:
    """Files into an ext4 file system image (folders made on the way), with debugfs -w."""
    with tempfile.TemporaryDirectory(prefix="kvl-debugfs-") as work:
        commands = []
        for number, (target, content) in enumerate(sorted(files.items())):
            local = Path(work) / str(number)
            local.write_bytes(content)
            local.chmod(0o755 if content.startswith(b"#!") else 0o644)
            parts = target.strip("/").split("/")
            commands += [f"mkdir /{'/'.join(parts[:n])}" for n in range(1, len(parts))]
            # debugfs writes a name into its current folder, not a path
            commands += [f"cd /{'/'.join(parts[:-1])}", f"rm {parts[-1]}",
                         f"write {local} {parts[-1]}"]  # fmt: skip
        script = Path(work) / "commands"
        script.write_text("\n".join(commands) + "\n")
        # mkdir of a folder that exists and rm of a file that does not only complain, and
        # debugfs exits 0 whatever a command did: each file is read back
        subprocess.run(
            [_debugfs(), "-w", "-f", str(script), f"{image}?offset={offset}"],
            capture_output=True,
            check=True,
            timeout=120,
        )
    for target, content in files.items():
        shown = subprocess.run(
            [_debugfs(), "-R", f"cat {target}", f"{image}?offset={offset}"],
            capture_output=True,
            check=True,
            timeout=60,
        )
        assert shown.stdout == content, f"debugfs did not write {target} into {image}"


def symlink(image: Path, link: str, target: str, offset: int = 0) -> None:
    subprocess.run(
        [_debugfs(), "-w", "-R", f"symlink {link} {target}", f"{image}?offset={offset}"],
        capture_output=True,
        check=True,
        timeout=60,
    )


def extract_partition(disk: Path, label: str, target: Path) -> Path:
    """One partition of the disk image as a file of its own (sparse)."""
    part = _partition(disk, label)
    with disk.open("rb") as source, target.open("wb") as out:
        out.truncate(part.size)
        copied = 0
        while copied < part.size:
            try:
                data = os.lseek(source.fileno(), part.offset + copied, os.SEEK_DATA)
            except OSError:  # only holes left
                break
            if data >= part.offset + part.size:
                break
            hole = min(os.lseek(source.fileno(), data, os.SEEK_HOLE), part.offset + part.size)
            source.seek(data)
            out.seek(data - part.offset)
            remaining = hole - data
            while remaining:
                chunk = source.read(min(remaining, 8 * 1024 * 1024))
                out.write(chunk)
                remaining -= len(chunk)
            copied = hole - part.offset
    return target


# Under TCG, QEMU 7.2 runs the AVX paths of OpenSSL several times slower than its SSE ones
# (measured with qemu-user, -cpu max: SHA-256 14 against 49 MB/s, ChaCha20-Poly1305 10 against
# 43, AES-256-GCM 21 against 34): the guest's hashing of its models and of a fetched bundle,
# and TLS through its tunnel. An emulated guest's services are told (systemd.setenv on the
# kernel command line) to leave OpenSSL's AVX, AVX2 and SHA-NI paths aside, and its kernel to
# leave AVX2 aside (clearcpuid: its own use only, so WireGuard's ChaCha20 and dm-verity's
# SHA-256 under a RAUC install take other paths; programs still see AVX2, and llama.cpp uses
# it): the same code and results, on the paths the emulator runs fastest. Under KVM the image
# boots its own options.
EMULATED_OPTIONS = "systemd.setenv=OPENSSL_ia32cap=~0x1000000000000000:~0x20000020 clearcpuid=avx2"


def _mtools(disk: Path, *argv: str) -> str:
    esp = _partition(disk, ESP_LABEL)
    done = subprocess.run(
        [argv[0], "-i", f"{disk}@@{esp.offset}", *argv[1:]],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MTOOLS_SKIP_CHECK": "1"},
        timeout=60,
    )
    return done.stdout


def add_boot_options(disk: Path, options: str) -> None:
    """`options` appended to the kernel command line of every loader entry on the disk's EFI
    system partition (once)."""
    for name in loader_entries(disk):
        path = f"::/loader/entries/{name}"
        lines = _mtools(disk, "mtype", path).splitlines()
        edited = [
            f"{line} {options}" if line.startswith("options ") and options not in line else line
            for line in lines
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".conf") as entry:
            entry.write("\n".join(edited) + "\n")
            entry.flush()
            _mtools(disk, "mcopy", "-o", entry.name, path)


def loader_entries(disk: Path) -> list[str]:
    """The names in /loader/entries of the disk image's EFI system partition (mtools)."""
    esp = _partition(disk, ESP_LABEL)
    shown = subprocess.run(
        ["mdir", "-b", "-i", f"{disk}@@{esp.offset}", "::/loader/entries"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MTOOLS_SKIP_CHECK": "1"},
        timeout=60,
    )
    return sorted(line.rsplit("/", 1)[-1] for line in shown.stdout.split())


def data_partition_end(disk: Path) -> tuple[int, int]:
    """(the data partition's last byte, the disk's size): equal, less the backup GPT and
    alignment, once the first boot has grown it."""
    data = next(p for p in partitions(disk) if p.name == DATA_LABEL)
    return data.offset + data.size, disk.stat().st_size


# A release whose appliance exits at once: its trial boot never becomes ready.
BROKEN_DROP_IN = b"[Service]\nExecStart=\nExecStart=/bin/false\n"


def package_files(image: Path, distribution: str) -> dict[str, bytes]:
    """Every file of one Python distribution in the image's venv (its RECORD), by path: what
    a release that upgrades that one package writes again."""

    def ask(command: str) -> str:
        done = subprocess.run([_debugfs(), "-R", command, str(image)], capture_output=True,
                              text=True, check=True, timeout=60)  # fmt: skip
        return done.stdout

    def names(folder: str) -> list[str]:  # `ls -p`: /inode/mode/uid/gid/name/size/
        return [row.split("/")[5] for row in ask(f"ls -p {folder}").splitlines()
                if row.count("/") > 5]  # fmt: skip

    python = next(n for n in names(f"{VENV}/lib") if n.startswith("python"))
    site = f"{VENV}/lib/{python}/site-packages"
    prefix = distribution.replace("-", "_") + "-"
    info = next(n for n in names(site) if n.startswith(prefix) and n.endswith(".dist-info"))
    record = ask(f"cat {site}/{info}/RECORD")
    paths = [f"{site}/{row.split(',')[0]}" for row in record.splitlines()
             if row and not row.startswith("../")]  # fmt: skip
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="kvl-debugfs-") as work:
        script = Path(work) / "commands"
        script.write_text("".join(f"dump {path} {work}/{n}\n" for n, path in enumerate(paths)))
        subprocess.run([_debugfs(), "-f", str(script), str(image)], capture_output=True,
                       check=True, timeout=300)  # fmt: skip
        for n, path in enumerate(paths):
            dumped = Path(work) / str(n)
            if dumped.is_file():
                files[path] = dumped.read_bytes()
    return files


def release_bundles(
    manifest: dict[str, Any],
    folder: Path,
    releases: dict[str, bool],
    *,
    upgraded: frozenset[str] = frozenset(),
    level: int = 1,
) -> dict[str, Path]:
    """A bundle per release version (`releases`: version -> whether it is broken), each the
    image's own root with that version in its description, signed as `just image` signs;
    zstd -1 by default, as a bundle read once over the tunnel needs no more. A version in
    `upgraded` also upgrades one package, the appliance's own: every file of it written
    again with the version in it (the rest of the root as it was)."""
    from image.build import DEFAULT_BUILD_DIR, Paths, image_description  # noqa: PLC0415
    from image.bundle import development_signing, make_bundle  # noqa: PLC0415

    def run(argv: list[str]) -> None:
        subprocess.run(argv, check=True, capture_output=True, timeout=1200)

    folder.mkdir(parents=True, exist_ok=True)
    signing = development_signing(Paths(DEFAULT_BUILD_DIR).signing)
    rootfs = extract_partition(Path(manifest["image"]), ROOT_A_LABEL, folder / "rootfs.ext4")
    made: dict[str, Path] = {}
    for n, (version, broken) in enumerate(releases.items()):
        root = folder / f"release-{n}.ext4"
        subprocess.run(["cp", "--sparse=always", str(rootfs), str(root)], check=True)
        description = image_description()
        if accelerator() == "tcg":  # the slot's entry gets the flashed one's EMULATED_OPTIONS
            for slot in description["slots"].values():
                slot["options"] = f"{slot['options']} {EMULATED_OPTIONS}"
        files = {
            "/usr/lib/kovenlab/image.json": json.dumps({**description, "version": version}).encode()
        }
        if broken:
            drop_in = "/etc/systemd/system/kovenlab-appliance.service.d/broken.conf"
            files[drop_in] = BROKEN_DROP_IN
        if version in upgraded:
            marker = f"\n# {version}\n".encode()
            package = package_files(root, "kovenlab-edge")
            files |= {path: content + marker for path, content in package.items()}
        write_files(root, files)
        made[version] = folder / f"release-{n}.raucb"
        make_bundle(run, folder / "work", root, made[version], version=version,
                    build="test", signing=signing, level=level)  # fmt: skip
        root.unlink()
    rootfs.unlink()
    return made


def heartbeat_after(hub: Hub, seen: float) -> bool:
    """The one node is online, with a heartbeat later than `seen` (through its tunnel: the
    hub takes heartbeats only from a node's overlay address)."""
    nodes = hub.nodes()
    assert len(nodes) <= 1, nodes
    return bool(nodes) and nodes[0]["status"] == "online" and nodes[0]["last_seen"] > seen


@dataclass
class Enrolled:
    """A node after its first boot, and the bounds its test waits within."""

    node_id: str
    bound_s: float  # a heartbeat, a rollout's step
    update_bound_s: float  # a fetch, an install, a boot
    why: Callable[[], str]  # what a failure quotes


def first_boot(machine: Machine, hub: Hub, bundles: Future[dict[str, Path]]) -> Enrolled:
    """Slot A's first boot: ready, enrolled, heartbeating through its tunnel, marked good;
    the release bundles (made meanwhile) added to the hub."""
    machine.wait_ready()
    for version, bundle in bundles.result().items():
        hub.cli("releases", "add", str(bundle), "--version", version)
    bound = ENROLLED_BOUND_S[machine.accel]
    why = lambda: f"{hub.nodes()}\n{hub.log_tail()}\n{machine.diagnostics()}"  # noqa: E731
    wait_for(lambda: heartbeat_after(hub, 0.0), "a heartbeat", bound, why)
    node = hub.nodes()[0]
    assert (node["name"], node["site"]) == (NODE_NAME, SITE)
    machine.wait_console("slot A marked good")
    return Enrolled(node["id"], bound, 2 * READY_BOUND_S[machine.accel], why)


def start_rollout(hub: Hub, version: str, node_id: str, soak: str = "2h") -> str:
    """A rollout of release `version` with `node_id` as its canary; its id. The node may be
    unheard for as long as it soaks (reboots under TCG take minutes)."""
    out = hub.cli("rollouts", "start", "--release", version, "--canary-node", node_id,
                  "--soak", soak, "--offline-after", "2h", "--no-burn-gate")  # fmt: skip
    words = out.split()
    assert words[:1] == ["rollout"], out
    return words[1]


def reported(view: dict[str, Any]) -> dict[str, Any]:
    """What a rollout's one node last reported of its image."""
    [wave] = view["waves"]
    [node] = wave["nodes"]
    image: dict[str, Any] = node.get("image") or {}
    return image
