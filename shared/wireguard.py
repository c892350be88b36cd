"""WireGuard for the fleet link: keys, interface configuration, tunnels brought up and down.

A tunnel is a kernel interface configured over netlink where the kernel has WireGuard, and
otherwise a `wireguard-go` process configured through its UAPI socket
(`/var/run/wireguard/<name>.sock`, the key=value protocol that `wg` speaks). Addresses and
link state go through `ip` (iproute2). All of it can happen inside a named network
namespace. The UAPI socket folder is shared by every namespace, so an interface name must
be unique on the host, not only in its namespace.

Keys are base64 strings, as `wg` prints them and the enrollment protocol carries them. No
private key is ever logged, put in an error message, a repr or a command line.

Every call blocks (processes, sockets, netlink): async callers run them in a thread.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
    ip_address,
    ip_network,
)
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeAlias

from shared.files import write_private

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

log = logging.getLogger(__name__)

IPAddress: TypeAlias = IPv4Address | IPv6Address
IPNetwork: TypeAlias = IPv4Network | IPv6Network
IPInterface: TypeAlias = IPv4Interface | IPv6Interface

UAPI_DIR = Path("/var/run/wireguard")
DEFAULT_MTU = 1420  # what wg-quick and wireguard-go use: 1500 less the WireGuard overhead
KEY_BYTES = 32
_NAME_RE = re.compile(r"^[A-Za-z0-9_=+.-]{1,15}$")  # Linux: 15 characters, no slash
_ZERO_KEY = base64.b64encode(bytes(KEY_BYTES)).decode()  # "no preshared key" to both APIs
_INSTALL_FIX = "run `just setup` (it installs the Debian packages wireguard-go and iproute2)"


# --- errors -------------------------------------------------------------------------------


class WireGuardError(Exception):
    """A WireGuard operation failed: the message says what, and `fix` how to fix it."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        super().__init__(f"{what}; fix: {fix}" if fix else what)
        self.what = what
        self.fix = fix


class WireGuardUnavailableError(WireGuardError):
    """Neither the kernel nor wireguard-go can make a tunnel on this machine."""


class ConfigError(WireGuardError, ValueError):
    """A key, name, port, address or value that WireGuard cannot take."""


class UapiError(WireGuardError):
    """wireguard-go refused a UAPI request, answered nonsense, or did not answer."""

    def __init__(self, what: str, fix: str | None = None, *, errno: int | None = None) -> None:
        super().__init__(what, fix)
        self.errno = errno


class CommandError(WireGuardError):
    """A command failed; it carries the command line, exit status and error output."""

    def __init__(
        self, what: str, fix: str | None, *, argv: Sequence[str], returncode: int, stderr: str
    ) -> None:
        super().__init__(f"{what}: `{' '.join(argv)}` exited with {returncode}: {stderr}", fix)
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr


# --- keys ---------------------------------------------------------------------------------


def _key_bytes(value: str, what: str, *, secret: bool = False) -> bytes:
    """The 32 bytes of a base64 key, refusing anything `wg` would not print."""
    shown = "" if secret else f" {value!r}"
    fix = "give the key as `wg genkey` / `wg pubkey` print it: 44 characters of base64"
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ConfigError(f"{what}{shown} is not base64", fix) from err
    if len(raw) != KEY_BYTES or base64.b64encode(raw).decode() != value:
        raise ConfigError(f"{what}{shown} is not a {KEY_BYTES}-byte key", fix)
    return raw


def _key_hex(value: str) -> str:
    """UAPI speaks keys in hex; the model keeps base64 (already validated)."""
    return base64.b64decode(value).hex()


@dataclass(frozen=True)
class KeyPair:
    """A node's WireGuard identity. The private key stays out of the repr."""

    private_key: str = field(repr=False)
    public_key: str


def generate_keypair() -> KeyPair:
    """A fresh Curve25519 key pair (wireguard-tools clamps the private key as `wg` does)."""
    # wireguard_tools (with segno, its QR codes: about 13 MiB) only for the keys, which a
    # node makes once: not in every process that imports this module.
    from wireguard_tools import WireguardKey  # noqa: PLC0415

    private = WireguardKey.generate()
    return KeyPair(private_key=str(private), public_key=str(private.public_key()))


def public_key_of(private_key: str) -> str:
    """The public key that goes with `private_key`."""
    from wireguard_tools import WireguardKey  # noqa: PLC0415 - see generate_keypair

    raw = _key_bytes(private_key, "private key", secret=True)
    return str(WireguardKey(raw).public_key())


def write_private_key(path: Path, private_key: str) -> None:
    """Write the key alone on one line, mode 0600 from the first byte; replaces atomically.

    The key never passes through a file another user could read, not even for a moment: a
    temporary file made 0600 is renamed over `path`.
    """
    _key_bytes(private_key, "private key", secret=True)
    try:
        write_private(path, f"{private_key}\n")
    except OSError as err:
        raise WireGuardError(
            f"cannot write the private key to {path}: {err.strerror}",
            "make its folder exist and be writable by this user",
        ) from err


def read_private_key(path: Path) -> KeyPair:
    """The key pair whose private key `write_private_key` wrote to `path`.

    Refuses a file that group or others may read, as ssh does: the key may have leaked.
    """
    try:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise WireGuardError(
                f"private key file {path} can be read by other users (mode {mode:o})",
                f"`chmod 600 {path}`, and replace the key if others may have read it",
            )
        private_key = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise WireGuardError(
            f"cannot read the private key file {path}: {err}",
            "check the path; a new node makes its key with `ensure_keypair`",
        ) from err
    try:
        return KeyPair(private_key=private_key, public_key=public_key_of(private_key))
    except ConfigError as err:
        raise ConfigError(f"{path} does not hold a WireGuard private key", err.fix) from err


def ensure_keypair(path: Path) -> KeyPair:
    """The key pair kept at `path`, generated and written (0600) the first time."""
    if path.exists():
        return read_private_key(path)
    pair = generate_keypair()
    write_private_key(path, pair.private_key)
    return pair


# --- configuration ------------------------------------------------------------------------


def _check_port(value: int, what: str) -> None:
    if not 1 <= value <= 65535:
        raise ConfigError(f"{what} {value} is out of range", "use a port from 1 to 65535")


@dataclass(frozen=True)
class Endpoint:
    """Where a peer's UDP packets go: an IP address and port (resolve names beforehand)."""

    host: IPAddress
    port: int

    def __post_init__(self) -> None:
        _check_port(self.port, "endpoint port")

    def __str__(self) -> str:
        if isinstance(self.host, IPv6Address):
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """`198.18.0.1:51820` or `[2001:db8::1]:51820`, as `wg` shows endpoints."""
        host, _, port = text.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        if bracketed:
            host = host[1:-1]
        bad = ConfigError(
            f"endpoint {text!r} is not ADDRESS:PORT",
            "give an IP address and a port, `[…]` around an IPv6 address; resolve names first",
        )
        if not (port.isascii() and port.isdigit()) or (":" in host and not bracketed):
            raise bad
        try:
            address = ip_address(host)
        except ValueError as err:
            raise bad from err
        return cls(address, int(port))


@dataclass(frozen=True)
class Peer:
    """A peer as configured: who it is, what it may send from, and where to reach it.

    `allowed_ips` both filters what the peer may send and routes what is sent to it. A
    peer without an endpoint (the hub's view of a node behind NAT) is reached at the
    address its last authenticated packet came from.
    """

    public_key: str
    allowed_ips: tuple[IPNetwork, ...]
    endpoint: Endpoint | None = None
    persistent_keepalive_s: int | None = None
    preshared_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _key_bytes(self.public_key, "peer public key")
        if self.preshared_key is not None:
            _key_bytes(self.preshared_key, "preshared key", secret=True)
        keepalive = self.persistent_keepalive_s
        if keepalive is not None and not 1 <= keepalive <= 65535:
            raise ConfigError(
                f"persistent keepalive {keepalive} s is out of range",
                "use 1 to 65535 seconds (25 keeps most NAT mappings open), or None for off",
            )


@dataclass(frozen=True)
class InterfaceConfig:
    """One WireGuard interface: its identity, its overlay addresses, its peers.

    The addresses' prefixes give the routes (`100.64.0.2/10` routes all of 100.64.0.0/10
    into the tunnel); peers' allowed IPs outside them need routes of the caller's.
    `listen_port` None lets the system pick one (read it back from `Tunnel.state()`).
    """

    name: str
    private_key: str = field(repr=False)
    addresses: tuple[IPInterface, ...]
    listen_port: int | None = None
    peers: tuple[Peer, ...] = ()
    mtu: int = DEFAULT_MTU

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name) or self.name in {".", ".."}:
            raise ConfigError(
                f"interface name {self.name!r} is not a valid Linux interface name",
                "use 1 to 15 letters, digits or `_=+.-`",
            )
        _key_bytes(self.private_key, "private key", secret=True)
        if not self.addresses:
            raise ConfigError(
                f"interface {self.name} has no address", "give it its overlay address"
            )
        if self.listen_port is not None:
            _check_port(self.listen_port, "listen port")
        if not 1280 <= self.mtu <= 65535:
            raise ConfigError(f"MTU {self.mtu} is out of range", "use 1280 (IPv6's least) or more")
        keys = [peer.public_key for peer in self.peers]
        if len(set(keys)) != len(keys):
            twice = sorted({key for key in keys if keys.count(key) > 1})
            raise ConfigError(
                f"interface {self.name} lists peer(s) {', '.join(twice)} more than once",
                "give each peer once, with all of its allowed IPs",
            )

    @property
    def public_key(self) -> str:
        return public_key_of(self.private_key)


# --- state --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerState:
    """A peer as the running interface sees it."""

    public_key: str
    endpoint: Endpoint | None
    allowed_ips: tuple[IPNetwork, ...]
    latest_handshake: datetime | None  # None: never
    rx_bytes: int
    tx_bytes: int
    persistent_keepalive_s: int | None


@dataclass(frozen=True)
class DeviceState:
    """A running interface: the port it listens on and its peers."""

    listen_port: int
    peers: tuple[PeerState, ...]

    def peer(self, public_key: str) -> PeerState | None:
        return next((p for p in self.peers if p.public_key == public_key), None)


def _handshake(seconds: int, nanoseconds: int) -> datetime | None:
    if seconds == 0 and nanoseconds == 0:
        return None
    return datetime.fromtimestamp(seconds + nanoseconds / 1e9, UTC)


# --- the UAPI protocol (pure) -------------------------------------------------------------
# https://www.wireguard.com/xplatform/#configuration-protocol: a request is `set=1` or
# `get=1` then key=value lines and an empty line; the answer is key=value lines ending in
# `errno=N` and an empty line. Keys travel in hex.

UAPI_GET = "get=1\n\n"


def _message(lines: Iterable[str]) -> str:
    return "\n".join(lines) + "\n\n"


def _peer_lines(peer: Peer) -> list[str]:
    # Every setting is sent, so that this sets the peer to exactly `peer` whether it is new
    # or already there; only the endpoint is left alone when None (the last one seen stays).
    lines = [
        f"public_key={_key_hex(peer.public_key)}",
        f"preshared_key={_key_hex(peer.preshared_key or _ZERO_KEY)}",
    ]
    if peer.endpoint is not None:
        lines.append(f"endpoint={peer.endpoint}")
    lines.append(f"persistent_keepalive_interval={peer.persistent_keepalive_s or 0}")
    lines.append("replace_allowed_ips=true")
    lines.extend(f"allowed_ip={network}" for network in peer.allowed_ips)
    return lines


def uapi_configure(config: InterfaceConfig) -> str:
    """The `set` request that gives a fresh interface its key, port and peers."""
    lines = ["set=1", f"private_key={_key_hex(config.private_key)}"]
    if config.listen_port is not None:
        lines.append(f"listen_port={config.listen_port}")
    lines.append("replace_peers=true")
    for peer in config.peers:
        lines.extend(_peer_lines(peer))
    return _message(lines)


def uapi_set_peer(peer: Peer) -> str:
    """The `set` request that adds `peer`, or makes an existing peer with its key match it."""
    return _message(["set=1", *_peer_lines(peer)])


def uapi_remove_peer(public_key: str) -> str:
    """The `set` request that removes a peer (a no-op when there is none with that key)."""
    _key_bytes(public_key, "peer public key")
    return _message(["set=1", f"public_key={_key_hex(public_key)}", "remove=true"])


def _pairs(response: str) -> list[tuple[str, str]]:
    pairs = []
    for line in response.split("\n"):
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise UapiError(f"malformed UAPI answer line {line!r}")
        pairs.append((key, value))
    return pairs


def uapi_errno(response: str) -> int:
    """The `errno` of a UAPI answer; 0 is success, wireguard-go sends negative errnos."""
    values = [value for key, value in _pairs(response) if key == "errno"]
    if not values:
        raise UapiError("the UAPI answer has no errno line")
    try:
        return int(values[-1])
    except ValueError as err:
        raise UapiError(f"malformed UAPI errno {values[-1]!r}") from err


def parse_uapi_get(response: str) -> DeviceState:
    """The answer to `get=1`. Secret lines (private and preshared keys) are dropped."""
    errno = uapi_errno(response)
    if errno != 0:
        raise UapiError(f"the UAPI get failed with errno {errno}", errno=errno)
    listen_port = 0
    peers: list[dict[str, list[str]]] = []
    for key, value in _pairs(response):
        if key == "public_key":
            peers.append({})
        if key in {"private_key", "preshared_key"}:
            continue
        if key == "listen_port":
            listen_port = _int(key, value)
        elif peers:
            peers[-1].setdefault(key, []).append(value)
    return DeviceState(listen_port=listen_port, peers=tuple(_uapi_peer(p) for p in peers))


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError as err:
        raise UapiError(f"malformed UAPI value {key}={value!r}") from err


def _uapi_peer(fields: dict[str, list[str]]) -> PeerState:
    def one(key: str) -> str | None:
        values = fields.get(key)
        return values[-1] if values else None

    def number(key: str) -> int:
        value = one(key)
        return 0 if value is None else _int(key, value)

    public_hex = one("public_key") or ""
    try:
        public_key = base64.b64encode(bytes.fromhex(public_hex)).decode()
        _key_bytes(public_key, "peer public key")
        endpoint = one("endpoint")
        allowed = tuple(ip_network(value) for value in fields.get("allowed_ip", []))
        return PeerState(
            public_key=public_key,
            endpoint=Endpoint.parse(endpoint) if endpoint else None,
            allowed_ips=allowed,
            latest_handshake=_handshake(
                number("last_handshake_time_sec"), number("last_handshake_time_nsec")
            ),
            rx_bytes=number("rx_bytes"),
            tx_bytes=number("tx_bytes"),
            persistent_keepalive_s=number("persistent_keepalive_interval") or None,
        )
    except ValueError as err:  # ConfigError included: a bad key, endpoint or network
        raise UapiError(f"malformed UAPI peer {public_hex!r}: {err}") from err


# --- netlink answers (pure) ---------------------------------------------------------------


def netlink_state(messages: Iterable[Any]) -> DeviceState:
    """A device state from pyroute2's `WireGuard.info()` messages.

    A device with many peers comes in several messages, a peer's allowed IPs possibly
    split across two, so peers are merged by key. Secret attributes are never read.
    """
    listen_port = 0
    merged: dict[str, dict[str, Any]] = {}
    allowed: dict[str, list[str]] = {}
    for message in messages:
        attrs = dict(message["attrs"])
        listen_port = attrs.get("WGDEVICE_A_LISTEN_PORT") or listen_port
        for peer in attrs.get("WGDEVICE_A_PEERS") or []:
            peer_attrs = dict(peer["attrs"])
            key = peer_attrs["WGPEER_A_PUBLIC_KEY"].decode()
            merged.setdefault(key, {}).update(peer_attrs)
            allowed.setdefault(key, []).extend(
                ip["addr"] for ip in peer_attrs.get("WGPEER_A_ALLOWEDIPS") or []
            )
    peers = []
    for key, attrs in merged.items():
        endpoint = attrs.get("WGPEER_A_ENDPOINT")
        handshake = attrs.get("WGPEER_A_LAST_HANDSHAKE_TIME") or {}
        peers.append(
            PeerState(
                public_key=key,
                endpoint=(
                    Endpoint(ip_address(endpoint["addr"]), endpoint["port"])
                    if endpoint and endpoint.get("port")
                    else None
                ),
                allowed_ips=tuple(ip_network(a) for a in allowed[key]),
                latest_handshake=_handshake(
                    handshake.get("tv_sec", 0), handshake.get("tv_nsec", 0)
                ),
                rx_bytes=attrs.get("WGPEER_A_RX_BYTES") or 0,
                tx_bytes=attrs.get("WGPEER_A_TX_BYTES") or 0,
                persistent_keepalive_s=attrs.get("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") or None,
            )
        )
    return DeviceState(listen_port=listen_port, peers=tuple(peers))


# --- commands, namespaces -----------------------------------------------------------------


def _tool(name: str) -> str:
    # Non-root users often lack the sbin folders on PATH, where Debian puts `ip`.
    found = shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    if found is None:
        raise WireGuardUnavailableError(f"`{name}` is not installed", _INSTALL_FIX)
    return found


@dataclass(frozen=True)
class _Namespace:
    """Command lines for the network namespace `name`, or the caller's own when None."""

    name: str | None

    def ip(self, *args: str) -> list[str]:
        return [_tool("ip"), *(("-n", self.name) if self.name else ()), *args]

    def exec(self, *argv: str) -> list[str]:
        return [_tool("ip"), "netns", "exec", self.name, *argv] if self.name else list(argv)

    def where(self) -> str:
        return f" in network namespace {self.name}" if self.name else ""


def _run(argv: list[str], what: str, fix: str | None = None) -> subprocess.CompletedProcess[str]:
    # argv is built in this module from validated names and addresses, never through a shell.
    result = subprocess.run(  # noqa: S603
        argv, capture_output=True, text=True, check=False, timeout=30
    )
    if result.returncode != 0:
        raise CommandError(
            what,
            fix,
            argv=argv,
            returncode=result.returncode,
            stderr=result.stderr.strip(),
        )
    return result


def _link_exists(ns: _Namespace, name: str) -> bool:
    probe = subprocess.run(  # noqa: S603 - see _run
        ns.ip("link", "show", "dev", name), capture_output=True, check=False, timeout=30
    )
    return probe.returncode == 0


def _link_kind(ns: _Namespace, name: str) -> str | None:
    """The link's kind as `ip -d` names it (`wireguard`, `tun`, `veth`, …); None when there is
    no such link or it has no kind (a physical interface)."""
    probe = subprocess.run(  # noqa: S603 - see _run
        ns.ip("-d", "-j", "link", "show", "dev", name),
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if probe.returncode != 0:
        return None
    try:
        links = json.loads(probe.stdout)
        kind = links[0].get("linkinfo", {}).get("info_kind")
    except (ValueError, LookupError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def kernel_has_wireguard(netns: str | None = None) -> bool:
    """Whether the kernel makes WireGuard interfaces here (probed with a throwaway link).

    Needs CAP_NET_ADMIN, as every tunnel does; without it the answer is False.
    """
    ns = _Namespace(netns)
    probe = f"kvlprobe{secrets.token_hex(3)}"
    made = subprocess.run(  # noqa: S603 - see _run
        ns.ip("link", "add", probe, "type", "wireguard"),
        capture_output=True,
        check=False,
        timeout=30,
    )
    if made.returncode != 0:
        return False
    _run(ns.ip("link", "del", probe), "cannot remove the probe interface")
    return True


# --- devices: one per backend -------------------------------------------------------------


class Backend(StrEnum):
    """What runs the interface: the kernel, or wireguard-go; `auto` prefers the kernel."""

    auto = "auto"
    kernel = "kernel"
    userspace = "userspace"


class _Device(Protocol):
    backend: Backend

    def configure(self, config: InterfaceConfig) -> None: ...
    def set_peer(self, peer: Peer) -> None: ...
    def remove_peer(self, public_key: str) -> None: ...
    def state(self) -> DeviceState: ...
    def close(self) -> None: ...


def uapi_socket(name: str) -> Path:
    """Where wireguard-go serves the UAPI of interface `name`, whatever its namespace."""
    return UAPI_DIR / f"{name}.sock"


def _uapi_request(path: Path, request: str, timeout_s: float = 5.0) -> str:
    """Send one request, return the answer (up to its empty line). Requests may hold keys:
    they never go into an error message."""
    answer = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            sock.sendall(request.encode())
            while not answer.endswith(b"\n\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    raise UapiError(f"{path} closed the connection before answering in full")
                answer += chunk
    except (FileNotFoundError, ConnectionRefusedError) as err:
        raise UapiError(
            f"no wireguard-go answers at {path}",
            "bring the tunnel up first; if it was up, wireguard-go has died (see its log)",
        ) from err
    except OSError as err:  # TimeoutError included
        raise UapiError(f"UAPI request to {path} failed: {err}") from err
    return answer.decode()


def _answers(path: Path) -> bool:
    try:
        _uapi_request(path, UAPI_GET, timeout_s=2.0)
    except UapiError:
        return False
    return True


class _UserspaceDevice:
    """A `wireguard-go -f NAME` child process, driven through its UAPI socket."""

    backend = Backend.userspace

    def __init__(
        self, name: str, ns: _Namespace, process: subprocess.Popen[bytes], log_file: IO[bytes]
    ) -> None:
        self.name = name
        self.socket = uapi_socket(name)
        self._ns = ns
        self._process = process
        self._log = log_file

    @property
    def pid(self) -> int:
        return self._process.pid

    @classmethod
    def start(
        cls,
        name: str,
        ns: _Namespace,
        *,
        wireguard_go: str,
        log_path: Path | None,
        timeout_s: float,
        kernel_tried: bool,
    ) -> _UserspaceDevice:
        executable = shutil.which(wireguard_go)
        if executable is None:
            and_kernel = ", and the kernel has no WireGuard" if kernel_tried else ""
            raise WireGuardUnavailableError(
                f"`{wireguard_go}` is not installed{and_kernel}", _INSTALL_FIX
            )
        if not Path("/dev/net/tun").exists():
            raise WireGuardUnavailableError(
                "/dev/net/tun does not exist, so wireguard-go cannot make an interface",
                "`modprobe tun`, or give the container the device (`--device /dev/net/tun`)",
            )
        if _answers(uapi_socket(name)):
            raise WireGuardError(
                f"another wireguard-go already runs an interface named {name} "
                f"({uapi_socket(name)}; that folder is shared by every network namespace)",
                "give each interface a name unique on this host",
            )
        # Read back for the error message should it fail; the device closes it.
        log_file: IO[bytes] = (
            log_path.open("a+b") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
        )
        try:
            process = subprocess.Popen(  # noqa: S603 - see _run
                ns.exec(executable, "-f", name),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # Set by wireguard-go for its own daemonised child: no banner about the kernel.
                env={**os.environ, "WG_PROCESS_FOREGROUND": "1"},
            )
        except OSError as err:
            log_file.close()
            raise WireGuardError(f"cannot start {executable}: {err}", _INSTALL_FIX) from err
        device = cls(name, ns, process, log_file)
        try:
            device._wait_ready(timeout_s)
        except BaseException:
            device.close()
            raise
        return device

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait for the condition (the UAPI socket answering), failing early if it died."""
        deadline = time.monotonic() + timeout_s
        while not _answers(self.socket):
            if self._process.poll() is not None:
                raise WireGuardError(
                    f"wireguard-go exited with {self._process.returncode} before serving "
                    f"{self.name}{self._ns.where()}: {self.log_tail()}",
                    "wireguard-go's output is quoted: it needs root (CAP_NET_ADMIN), "
                    "/dev/net/tun, and the network namespace to exist",
                )
            if time.monotonic() > deadline:
                raise WireGuardError(
                    f"wireguard-go did not open {self.socket} within {timeout_s:g} s: "
                    f"{self.log_tail()}",
                    "wireguard-go's output is quoted; /var/run/wireguard must be writable",
                )
            time.sleep(0.02)

    def log_tail(self, limit: int = 2000) -> str:
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - limit))
        text = self._log.read().decode(errors="replace").strip()
        return text or "(no output)"

    def _set(self, request: str, what: str) -> None:
        errno = uapi_errno(_uapi_request(self.socket, request))
        if errno != 0:
            reason = os.strerror(abs(errno))
            raise UapiError(
                f"wireguard-go refused to {what} on {self.name}: errno {errno} ({reason})",
                "check the keys, port and addresses (a port in use? an endpoint of the wrong "
                "address family?)",
                errno=errno,
            )

    def configure(self, config: InterfaceConfig) -> None:
        self._set(uapi_configure(config), "configure the interface")

    def set_peer(self, peer: Peer) -> None:
        self._set(uapi_set_peer(peer), f"set peer {peer.public_key}")

    def remove_peer(self, public_key: str) -> None:
        self._set(uapi_remove_peer(public_key), f"remove peer {public_key}")

    def state(self) -> DeviceState:
        return parse_uapi_get(_uapi_request(self.socket, UAPI_GET))

    def close(self) -> None:
        """Stop wireguard-go, then remove whatever it could not (a killed one leaves its socket)."""
        try:
            if self._process.poll() is None:
                self._process.terminate()  # it removes its interface and socket on SIGTERM
                try:
                    self._process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            if _link_exists(self._ns, self.name):
                _run(self._ns.ip("link", "del", "dev", self.name), f"cannot remove {self.name}")
            self.socket.unlink(missing_ok=True)
        finally:
            self._log.close()


class _KernelDevice:
    """A kernel interface (already made by `ip link add`), configured over netlink."""

    backend = Backend.kernel

    def __init__(self, name: str, ns: _Namespace) -> None:
        # pyroute2 only when the kernel path is taken: it is heavy, and wireguard-go hosts
        # never need it.
        from pyroute2 import WireGuard  # noqa: PLC0415
        from pyroute2.netlink.exceptions import NetlinkError  # noqa: PLC0415

        self.name = name
        self._ns = ns
        # What pyroute2 raises: the kernel's refusals, and ValueErrors from its argument checks.
        self._errors = (NetlinkError, OSError, ValueError)
        try:
            # flags=0: open the namespace, never create it.
            self._wg: Any = WireGuard(netns=ns.name, flags=0)
        except self._errors as err:
            self._delete_link()
            raise WireGuardUnavailableError(
                f"cannot open WireGuard's netlink family{ns.where()}: {err}",
                "load the module (`modprobe wireguard`), or use the userspace backend",
            ) from err

    def _call(self, what: str, **kwargs: Any) -> None:
        try:
            self._wg.set(self.name, **kwargs)
        except self._errors as err:
            raise WireGuardError(
                f"the kernel refused to {what} on {self.name}: {err}",
                "check the keys, port and addresses (a port in use?)",
            ) from err

    def configure(self, config: InterfaceConfig) -> None:
        self._call(
            "configure the interface",
            private_key=config.private_key,
            listen_port=config.listen_port,
        )
        for peer in config.peers:
            self.set_peer(peer)

    def set_peer(self, peer: Peer) -> None:
        spec: dict[str, Any] = {
            "public_key": peer.public_key,
            "preshared_key": peer.preshared_key or _ZERO_KEY,
            "persistent_keepalive": peer.persistent_keepalive_s or 0,
            "replace_allowed_ips": True,
            "allowed_ips": [str(network) for network in peer.allowed_ips],
        }
        if peer.endpoint is not None:
            spec["endpoint_addr"] = str(peer.endpoint.host)
            spec["endpoint_port"] = peer.endpoint.port
        self._call(f"set peer {peer.public_key}", peer=spec)

    def remove_peer(self, public_key: str) -> None:
        _key_bytes(public_key, "peer public key")
        self._call(f"remove peer {public_key}", peer={"public_key": public_key, "remove": True})

    def state(self) -> DeviceState:
        try:
            messages = self._wg.info(self.name)
        except self._errors as err:
            raise WireGuardError(f"cannot read the state of {self.name}: {err}") from err
        return netlink_state(messages)

    def _delete_link(self) -> None:
        if _link_exists(self._ns, self.name):
            _run(self._ns.ip("link", "del", "dev", self.name), f"cannot remove {self.name}")

    def close(self) -> None:
        try:
            self._delete_link()
        finally:
            self._wg.close()


# --- the tunnel ---------------------------------------------------------------------------


class Tunnel:
    """One WireGuard interface: `up()` (or `with`) makes and configures it, `down()` removes it.

    With `netns`, everything happens in that network namespace (which must exist); the
    interface name must still be unique on the host. Peers change while it runs with
    `add_peer` and `remove_peer`; `state()` is the truth (`config` stays as given). Calls
    from several threads take turns.
    """

    def __init__(
        self,
        config: InterfaceConfig,
        *,
        netns: str | None = None,
        backend: Backend = Backend.auto,
        wireguard_go: str = "wireguard-go",
        log_path: Path | None = None,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.config = config
        self.netns = netns
        self._ns = _Namespace(netns)
        self._requested = backend
        self._wireguard_go = wireguard_go
        self._log_path = log_path
        self._start_timeout_s = start_timeout_s
        self._device: _Device | None = None
        # Reentrant: a failed `up` calls `down`. pyroute2's socket is not for two threads.
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        state = self._device.backend.value if self._device else "down"
        return f"Tunnel({self.name!r}{self._ns.where()}, {state})"

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def public_key(self) -> str:
        return self.config.public_key

    @property
    def backend(self) -> Backend | None:
        """The backend running the interface; None while it is down."""
        return self._device.backend if self._device else None

    @property
    def pid(self) -> int | None:
        """wireguard-go's process id, with the userspace backend."""
        return self._device.pid if isinstance(self._device, _UserspaceDevice) else None

    def up(self, *, take_over: bool = False) -> Tunnel:
        """Make and configure the interface. With `take_over`, a WireGuard interface of the
        same name is one the caller left behind (an appliance restarted after a crash finds
        the kernel interface its last run made): it is removed first. Any other link of that
        name is never touched."""
        with self._lock:
            if take_over and self._device is None:
                self._remove_leftover()
            self._up()
        return self

    def _remove_leftover(self) -> None:
        kind = _link_kind(self._ns, self.name)
        socket_path = uapi_socket(self.name)
        if kind == "wireguard" or (kind == "tun" and _answers(socket_path)):
            log.warning(
                "removing the WireGuard interface %s%s an earlier run left behind",
                self.name,
                self._ns.where(),
            )
            _run(self._ns.ip("link", "del", "dev", self.name), f"cannot remove {self.name}")
        if kind in {"tun", None} and socket_path.exists():
            # wireguard-go exits once its interface is gone, removing its socket; a killed
            # one left the socket.
            deadline = time.monotonic() + self._start_timeout_s
            while _answers(socket_path) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _answers(socket_path):
                socket_path.unlink(missing_ok=True)

    def _up(self) -> None:
        if self._device is not None:
            raise WireGuardError(f"{self.name} is already up")
        if _link_exists(self._ns, self.name):
            raise WireGuardError(
                f"an interface named {self.name} already exists{self._ns.where()}",
                f"give each tunnel a name unique on this host, or remove the old one "
                f"(`ip link del {self.name}`)",
            )
        self._device = self._create()
        try:
            self._device.configure(self.config)
            for address in self.config.addresses:
                _run(
                    self._ns.ip("address", "add", str(address), "dev", self.name),
                    f"cannot give {self.name} the address {address}",
                    "is that address already in use on another interface?",
                )
            _run(
                self._ns.ip("link", "set", "dev", self.name, "mtu", str(self.config.mtu), "up"),
                f"cannot set {self.name} up",
            )
        except BaseException:
            try:
                self.down()
            except WireGuardError:  # the first failure is the one to report; this one is logged
                log.exception("cleaning up %s after it failed to come up", self.name)
            raise
        log.info(
            "WireGuard interface %s up%s (%s, %d peer(s))",
            self.name,
            self._ns.where(),
            self._device.backend.value,
            len(self.config.peers),
        )

    def _create(self) -> _Device:
        if self._requested in {Backend.auto, Backend.kernel}:
            # Trying is the test, as wg-quick does: `ip` loads the module if there is one.
            made = subprocess.run(  # noqa: S603 - see _run
                self._ns.ip("link", "add", "dev", self.name, "type", "wireguard"),
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
            if made.returncode == 0:
                return _KernelDevice(self.name, self._ns)
            if self._requested is Backend.kernel:
                raise WireGuardUnavailableError(
                    f"the kernel cannot make a WireGuard interface{self._ns.where()}: "
                    f"{made.stderr.strip()}",
                    "load the module (`modprobe wireguard`), or use the userspace backend "
                    "(wireguard-go)",
                )
        return _UserspaceDevice.start(
            self.name,
            self._ns,
            wireguard_go=self._wireguard_go,
            log_path=self._log_path,
            timeout_s=self._start_timeout_s,
            kernel_tried=self._requested is Backend.auto,
        )

    def _running(self) -> _Device:
        if self._device is None:
            raise WireGuardError(f"{self.name} is not up", "call `up()` first")
        return self._device

    def add_peer(self, peer: Peer) -> None:
        """Add `peer`, or set an existing peer with its key to exactly `peer`."""
        with self._lock:
            self._running().set_peer(peer)

    def remove_peer(self, public_key: str) -> None:
        """Remove the peer: its packets are dropped from now on. No peer, nothing to do."""
        with self._lock:
            self._running().remove_peer(public_key)

    def state(self) -> DeviceState:
        """The listen port and each peer's endpoint, latest handshake and byte counters."""
        with self._lock:
            return self._running().state()

    def down(self) -> None:
        """Remove the interface (and stop wireguard-go, remove its socket). Idempotent."""
        with self._lock:
            device, self._device = self._device, None
            if device is None:
                return
            device.close()
            log.info("WireGuard interface %s down%s", self.name, self._ns.where())

    def __enter__(self) -> Tunnel:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()
