"""WireGuard: keys, configuration, the UAPI protocol, and real tunnels between namespaces.

The netns tests put a hub in namespace A and an appliance in namespace B, joined by a veth
pair on 198.18.0.0/15; the tunnel's overlay is 100.64.0.0/10. The HTTP server binds only
the hub's overlay address, so an answer in B can only have come through the tunnel.
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_interface, ip_network
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.wireguard import (
    UAPI_GET,
    Backend,
    ConfigError,
    DeviceState,
    Endpoint,
    InterfaceConfig,
    KeyPair,
    Peer,
    Tunnel,
    UapiError,
    WireGuardError,
    WireGuardUnavailableError,
    ensure_keypair,
    generate_keypair,
    kernel_has_wireguard,
    netlink_state,
    parse_uapi_get,
    public_key_of,
    read_private_key,
    uapi_configure,
    uapi_errno,
    uapi_remove_peer,
    uapi_set_peer,
    uapi_socket,
    write_private_key,
)
from tests.netns import A_ADDR, B_ADDR, Link, linked_namespaces, pids_in

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

DEADLINE_S = 60.0
HUB_PORT = 51820
HTTP_PORT = 8080
HUB_OVERLAY = ip_interface("100.64.0.1/10")
NODE_OVERLAY = ip_interface("100.64.0.2/10")

# Fixed keys for exact UAPI messages: 32 bytes of 0x01 … and their hex.
KEY_A = base64.b64encode(bytes([1] * 32)).decode()
KEY_B = base64.b64encode(bytes([2] * 32)).decode()
KEY_C = base64.b64encode(bytes([3] * 32)).decode()
HEX_A, HEX_B, HEX_C = "01" * 32, "02" * 32, "03" * 32
ZERO_HEX = "00" * 32


# --- keys ---------------------------------------------------------------------------------


def test_generated_keypair_is_consistent_and_hides_its_private_key() -> None:
    pair = generate_keypair()
    assert public_key_of(pair.private_key) == pair.public_key
    for key in (pair.private_key, pair.public_key):
        assert len(base64.b64decode(key, validate=True)) == 32
    assert pair.private_key not in repr(pair)
    assert generate_keypair().private_key != pair.private_key
    # Curve25519 clamping, as `wg genkey` does it.
    raw = base64.b64decode(pair.private_key)
    assert raw[0] & 7 == 0
    assert raw[31] & 0x80 == 0
    assert raw[31] & 0x40


def test_public_key_matches_wireguards_own_derivation() -> None:
    # RFC 7748 §6.1: Alice's private key and public key (X25519 is what WireGuard uses).
    private = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    public = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    assert public_key_of(base64.b64encode(private).decode()) == base64.b64encode(public).decode()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_private_key_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    pair = generate_keypair()
    path = tmp_path / "node.key"
    old = os.umask(0)  # the most permissive umask: the file must still be 0600
    try:
        write_private_key(path, pair.private_key)
    finally:
        os.umask(old)
    assert _mode(path) == 0o600
    assert path.read_text() == f"{pair.private_key}\n"
    assert read_private_key(path) == pair
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left beside it


def test_rewriting_a_readable_key_file_makes_it_0600(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    path.write_text("old\n")
    path.chmod(0o644)
    pair = generate_keypair()
    write_private_key(path, pair.private_key)
    assert _mode(path) == 0o600
    assert read_private_key(path) == pair


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    pair = generate_keypair()
    path = tmp_path / "node.key"
    write_private_key(path, pair.private_key)
    path.chmod(0o640)
    with pytest.raises(WireGuardError) as caught:
        read_private_key(path)
    assert caught.value.fix is not None
    assert "chmod 600" in caught.value.fix
    assert pair.private_key not in str(caught.value)


def test_ensure_keypair_makes_the_key_once(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    first = ensure_keypair(path)
    assert _mode(path) == 0o600
    assert ensure_keypair(path) == first


def test_a_file_without_a_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    path.write_text("not a key\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="does not hold a WireGuard private key"):
        read_private_key(path)
    with pytest.raises(WireGuardError, match="cannot read"):
        read_private_key(tmp_path / "missing.key")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "not base64!",
        base64.b64encode(bytes(31)).decode(),  # a byte short
        base64.b64encode(bytes(33)).decode(),
        base64.b64encode(bytes(32)).decode().rstrip("="),  # not as `wg` prints it
        base64.urlsafe_b64encode(bytes([0xFF] * 32)).decode(),  # urlsafe alphabet
        HEX_A,  # hex is for UAPI, not for people
    ],
)
def test_malformed_keys_are_refused_and_secrets_never_echoed(bad: str) -> None:
    with pytest.raises(ConfigError) as caught:
        public_key_of(bad)
    if bad:
        assert bad not in str(caught.value)  # a private key
    with pytest.raises(ConfigError) as caught:
        Peer(public_key=bad, allowed_ips=())
    assert caught.value.fix is not None


# --- configuration ------------------------------------------------------------------------


def _config(**overrides: Any) -> InterfaceConfig:
    values: dict[str, Any] = {
        "name": "kvl0",
        "private_key": KEY_A,
        "addresses": (NODE_OVERLAY,),
    }
    values.update(overrides)
    return InterfaceConfig(**values)


def test_a_valid_config_hides_its_private_key() -> None:
    config = _config(listen_port=HUB_PORT, peers=(Peer(KEY_B, (ip_network("100.64.0.1/32"),)),))
    assert KEY_A not in repr(config)
    assert config.public_key == public_key_of(KEY_A)
    psk = Peer(KEY_B, (), preshared_key=KEY_C)
    assert KEY_C not in repr(psk)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"name": "a-name-of-16-chr"}, "not a valid Linux interface name"),
        ({"name": "wg/0"}, "not a valid Linux interface name"),
        ({"name": ""}, "not a valid Linux interface name"),
        ({"name": ".."}, "not a valid Linux interface name"),
        ({"private_key": "short"}, "private key is not"),
        ({"addresses": ()}, "has no address"),
        ({"listen_port": 0}, "listen port 0 is out of range"),
        ({"listen_port": 65536}, "listen port 65536 is out of range"),
        ({"mtu": 1000}, "MTU 1000 is out of range"),
        (
            {"peers": (Peer(KEY_B, ()), Peer(KEY_C, ()), Peer(KEY_B, ()))},
            f"lists peer(s) {KEY_B} more than once",
        ),
    ],
)
def test_invalid_configs_are_refused_naming_the_problem(
    overrides: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(**overrides)
    assert words in str(caught.value)
    assert caught.value.fix
    assert isinstance(caught.value, ValueError)  # what a dataclass' caller expects


@pytest.mark.parametrize("keepalive", [0, 65536, -1])
def test_keepalive_out_of_range_is_refused(keepalive: int) -> None:
    with pytest.raises(ConfigError, match="keepalive"):
        Peer(KEY_B, (), persistent_keepalive_s=keepalive)


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [
        ("198.18.0.1:51820", Endpoint(IPv4Address("198.18.0.1"), 51820)),
        ("[2001:db8::1]:1", Endpoint(IPv6Address("2001:db8::1"), 1)),
    ],
)
def test_endpoint_parses_and_prints_as_wg_shows_it(text: str, endpoint: Endpoint) -> None:
    assert Endpoint.parse(text) == endpoint
    assert str(endpoint) == text


@pytest.mark.parametrize(
    "text",
    ["198.18.0.1", "198.18.0.1:", "hub.example:51820", "2001:db8::1:51820", "[::1]:x", ":1"],
)
def test_endpoint_refuses_what_is_not_address_and_port(text: str) -> None:
    with pytest.raises(ConfigError, match="is not ADDRESS:PORT"):
        Endpoint.parse(text)


def test_endpoint_port_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="endpoint port 70000 is out of range"):
        Endpoint.parse("198.18.0.1:70000")
    with pytest.raises(ConfigError, match="endpoint port 0 is out of range"):
        Endpoint(IPv4Address("198.18.0.1"), 0)


@given(
    host=st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)),
    port=st.integers(min_value=1, max_value=65535),
)
def test_endpoint_round_trips(host: IPv4Address | IPv6Address, port: int) -> None:
    endpoint = Endpoint(host, port)
    assert Endpoint.parse(str(endpoint)) == endpoint


# --- the UAPI protocol --------------------------------------------------------------------


def test_configure_message_sets_key_port_and_replaces_peers() -> None:
    hub_peer = Peer(
        public_key=KEY_B,
        allowed_ips=(ip_network("100.64.0.0/10"), ip_network("fd00:6b76::/48")),
        endpoint=Endpoint(IPv4Address("198.18.0.1"), HUB_PORT),
        persistent_keepalive_s=25,
        preshared_key=KEY_C,
    )
    config = _config(listen_port=51821, peers=(hub_peer,))
    assert uapi_configure(config) == (
        "set=1\n"
        f"private_key={HEX_A}\n"
        "listen_port=51821\n"
        "replace_peers=true\n"
        f"public_key={HEX_B}\n"
        f"preshared_key={HEX_C}\n"
        "endpoint=198.18.0.1:51820\n"
        "persistent_keepalive_interval=25\n"
        "replace_allowed_ips=true\n"
        "allowed_ip=100.64.0.0/10\n"
        "allowed_ip=fd00:6b76::/48\n"
        "\n"
    )
    # No port: none sent, so the system picks one.
    assert "listen_port" not in uapi_configure(_config())


def test_set_peer_message_sets_the_peer_exactly() -> None:
    # A peer with no endpoint (the hub's view of a node) leaves the learnt endpoint alone,
    # and clears a keepalive or preshared key an earlier version of the peer had.
    peer = Peer(KEY_B, (ip_network("100.64.0.2/32"),))
    assert uapi_set_peer(peer) == (
        "set=1\n"
        f"public_key={HEX_B}\n"
        f"preshared_key={ZERO_HEX}\n"
        "persistent_keepalive_interval=0\n"
        "replace_allowed_ips=true\n"
        "allowed_ip=100.64.0.2/32\n"
        "\n"
    )
    v6 = Peer(KEY_B, (), endpoint=Endpoint(IPv6Address("2001:db8::1"), 9))
    assert "endpoint=[2001:db8::1]:9\n" in uapi_set_peer(v6)


def test_remove_peer_message() -> None:
    assert uapi_remove_peer(KEY_C) == f"set=1\npublic_key={HEX_C}\nremove=true\n\n"
    with pytest.raises(ConfigError):
        uapi_remove_peer("nope")


# As wireguard-go 0.0.20220316 answers `get=1` (keys replaced by the fixed ones).
GET_ANSWER = (
    f"private_key={HEX_A}\n"
    "listen_port=51820\n"
    f"public_key={HEX_B}\n"
    f"preshared_key={HEX_C}\n"
    "protocol_version=1\n"
    "endpoint=198.18.0.2:37866\n"
    "last_handshake_time_sec=1796000000\n"
    "last_handshake_time_nsec=500000000\n"
    "tx_bytes=92\n"
    "rx_bytes=148\n"
    "persistent_keepalive_interval=0\n"
    "allowed_ip=100.64.0.2/32\n"
    "allowed_ip=fd00:1::2/128\n"
    f"public_key={HEX_C}\n"
    f"preshared_key={ZERO_HEX}\n"
    "protocol_version=1\n"
    "last_handshake_time_sec=0\n"
    "last_handshake_time_nsec=0\n"
    "tx_bytes=0\n"
    "rx_bytes=0\n"
    "persistent_keepalive_interval=25\n"
    "errno=0\n"
    "\n"
)


def test_get_answer_is_parsed_into_peer_state() -> None:
    assert UAPI_GET == "get=1\n\n"
    state = parse_uapi_get(GET_ANSWER)
    assert state.listen_port == HUB_PORT
    node = state.peer(KEY_B)
    assert node is not None
    assert node.endpoint == Endpoint(IPv4Address("198.18.0.2"), 37866)
    assert node.allowed_ips == (ip_network("100.64.0.2/32"), ip_network("fd00:1::2/128"))
    assert node.latest_handshake == datetime(2026, 11, 30, 0, 53, 20, 500000, tzinfo=UTC)
    assert (node.rx_bytes, node.tx_bytes) == (148, 92)
    assert node.persistent_keepalive_s is None
    quiet = state.peer(KEY_C)
    assert quiet is not None
    assert quiet.latest_handshake is None
    assert quiet.endpoint is None
    assert quiet.allowed_ips == ()
    assert quiet.persistent_keepalive_s == 25
    assert state.peer(KEY_A) is None
    # The private and preshared keys were on the wire; they are not in the state.
    assert HEX_A not in repr(state)
    assert KEY_A not in repr(state)


def test_get_answer_of_a_fresh_interface() -> None:
    assert parse_uapi_get("listen_port=44855\nerrno=0\n\n") == DeviceState(44855, ())


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ("errno=-22\n\n", "errno -22"),
        ("listen_port=1\n\n", "no errno"),
        ("listen_port\nerrno=0\n\n", "malformed UAPI answer line"),
        ("listen_port=x\nerrno=0\n\n", "malformed UAPI value"),
        ("public_key=abcd\nerrno=0\n\n", "malformed UAPI peer"),
        (f"public_key={HEX_B}\nendpoint=nowhere\nerrno=0\n\n", "malformed UAPI peer"),
        (f"public_key={HEX_B}\nrx_bytes=many\nerrno=0\n\n", "malformed UAPI value"),
    ],
)
def test_bad_get_answers_raise_uapi_errors(answer: str, words: str) -> None:
    with pytest.raises(UapiError, match=words):
        parse_uapi_get(answer)


def test_errno_of_a_set_answer() -> None:
    assert uapi_errno("errno=0\n\n") == 0
    assert uapi_errno("errno=-98\n\n") == -98
    with pytest.raises(UapiError, match="malformed UAPI errno"):
        uapi_errno("errno=zero\n\n")


@dataclass
class _FakeNla:
    """Shaped as pyroute2 hands WireGuard.info() back: `["attrs"]` of (name, value) pairs."""

    attrs: list[tuple[str, Any]] = field(default_factory=list)

    def __getitem__(self, key: str) -> list[tuple[str, Any]]:
        assert key == "attrs"
        return self.attrs


def test_netlink_state_merges_a_peer_split_across_messages() -> None:
    node_key = KEY_B.encode()  # pyroute2 gives keys as base64 bytes
    first = _FakeNla(
        [
            ("WGDEVICE_A_LISTEN_PORT", HUB_PORT),
            ("WGDEVICE_A_PRIVATE_KEY", KEY_A.encode()),
            (
                "WGDEVICE_A_PEERS",
                [
                    _FakeNla(
                        [
                            ("WGPEER_A_PUBLIC_KEY", node_key),
                            ("WGPEER_A_PRESHARED_KEY", KEY_C.encode()),
                            ("WGPEER_A_ENDPOINT", {"addr": "198.18.0.2", "port": 40000}),
                            (
                                "WGPEER_A_LAST_HANDSHAKE_TIME",
                                {"tv_sec": 1796000000, "tv_nsec": 0},
                            ),
                            ("WGPEER_A_RX_BYTES", 10),
                            ("WGPEER_A_TX_BYTES", 20),
                            ("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL", 0),
                            ("WGPEER_A_ALLOWEDIPS", [{"addr": "100.64.0.2/32"}]),
                        ]
                    )
                ],
            ),
        ]
    )
    rest = _FakeNla(
        [
            (
                "WGDEVICE_A_PEERS",
                [
                    _FakeNla(
                        [
                            ("WGPEER_A_PUBLIC_KEY", node_key),
                            ("WGPEER_A_ALLOWEDIPS", [{"addr": "fd00:1::2/128"}]),
                        ]
                    ),
                    _FakeNla(
                        [
                            ("WGPEER_A_PUBLIC_KEY", KEY_C.encode()),
                            ("WGPEER_A_LAST_HANDSHAKE_TIME", {"tv_sec": 0, "tv_nsec": 0}),
                            ("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL", 25),
                        ]
                    ),
                ],
            )
        ]
    )
    state = netlink_state([first, rest])
    assert state.listen_port == HUB_PORT
    node = state.peer(KEY_B)
    assert node is not None
    assert node.endpoint == Endpoint(IPv4Address("198.18.0.2"), 40000)
    assert node.allowed_ips == (ip_network("100.64.0.2/32"), ip_network("fd00:1::2/128"))
    assert node.latest_handshake == datetime.fromtimestamp(1796000000, UTC)
    assert (node.rx_bytes, node.tx_bytes, node.persistent_keepalive_s) == (10, 20, None)
    other = state.peer(KEY_C)
    assert other is not None
    assert (other.endpoint, other.latest_handshake, other.persistent_keepalive_s) == (
        None,
        None,
        25,
    )
    assert KEY_A not in repr(state)


# --- errors that need no namespace --------------------------------------------------------


def test_missing_wireguard_go_says_to_run_setup() -> None:
    name = f"kvm{secrets.token_hex(4)}"
    tunnel = Tunnel(
        _config(name=name), backend=Backend.userspace, wireguard_go="kvl-no-such-wireguard-go"
    )
    with pytest.raises(WireGuardUnavailableError) as caught:
        tunnel.up()
    assert "kvl-no-such-wireguard-go` is not installed" in str(caught.value)
    assert caught.value.fix is not None
    assert "just setup" in caught.value.fix
    assert tunnel.backend is None


def test_a_tunnel_that_is_not_up_says_so() -> None:
    tunnel = Tunnel(_config())
    for call in (tunnel.state, lambda: tunnel.remove_peer(KEY_B)):
        with pytest.raises(WireGuardError, match="kvl0 is not up"):
            call()
    tunnel.down()  # nothing to do, no error
    assert repr(tunnel) == "Tunnel('kvl0', down)"


# --- real tunnels in two namespaces -------------------------------------------------------

# GET a URL with a timeout; prints the body, or exits non-zero.
FETCH = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as response:
    sys.stdout.write(response.read().decode())
"""


@pytest.fixture
def link() -> Iterator[Link]:
    with linked_namespaces() as made:
        yield made


@pytest.fixture(params=[Backend.userspace, Backend.kernel])
def backend(request: pytest.FixtureRequest, link: Link) -> Backend:
    wanted: Backend = request.param
    if wanted is Backend.kernel and not kernel_has_wireguard(link.a):
        pytest.skip("kernel backend: this kernel has no WireGuard (the userspace one runs)")
    return wanted


@dataclass
class Side:
    """A tunnel, what it was started with, and what `down` must have removed."""

    tunnel: Tunnel
    keys: KeyPair
    ns: str
    pid: int | None = None


def link_exists(ns: str, name: str) -> bool:
    probe = subprocess.run(
        ["ip", "-n", ns, "link", "show", "dev", name], capture_output=True, check=False
    )
    return probe.returncode == 0


def running(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_gone(side: Side) -> None:
    name = side.tunnel.name
    assert not link_exists(side.ns, name), f"{name} is still there"
    assert not uapi_socket(name).exists(), f"{uapi_socket(name)} is still there"
    if side.pid is not None:
        assert not Path(f"/proc/{side.pid}").exists(), f"wireguard-go ({side.pid}) still runs"


@pytest.fixture
def start(link: Link, tmp_path: Path) -> Iterator[Callable[..., Side]]:
    """Bring a tunnel up in a namespace; every one is taken down after the test, pass or fail,
    and must then have left no interface, process or socket behind."""
    sides: list[Side] = []
    if shutil.which("wireguard-go") is None:
        pytest.skip("netns test: wireguard-go is not installed; run `just setup`")

    def bring_up(
        ns: str,
        role: str,
        address: Any,
        *,
        backend: Backend = Backend.userspace,
        listen_port: int | None = None,
        peers: tuple[Peer, ...] = (),
        name: str | None = None,
    ) -> Side:
        keys = ensure_keypair(tmp_path / f"{role}.key")
        config = InterfaceConfig(
            name=name or f"kw{role[0]}{link.suffix}",
            private_key=keys.private_key,
            addresses=(address,),
            listen_port=listen_port,
            peers=peers,
        )
        tunnel = Tunnel(config, netns=ns, backend=backend, log_path=tmp_path / f"{role}.log")
        side = Side(tunnel, keys, ns)
        tunnel.up()
        side.pid = tunnel.pid
        sides.append(side)
        return side

    yield bring_up
    for side in sides:
        side.tunnel.down()
    for side in sides:
        assert_gone(side)


def fetch(link: Link, ns: str, url: str, timeout_s: float) -> str | None:
    result = subprocess.run(
        link.argv(ns, sys.executable, "-c", FETCH, url, str(timeout_s)),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s + 30,
    )
    return result.stdout if result.returncode == 0 else None


def fetch_until(link: Link, ns: str, url: str) -> str:
    """Wait on the condition (an answer), retrying: the first handshake may be a retry away."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        body = fetch(link, ns, url, timeout_s=2.0)
        if body is not None:
            return body
    raise AssertionError(f"{url} never answered from {ns}")


@dataclass
class Site:
    """A web server on the hub's overlay address, in A: reachable only through the tunnel."""

    url: str
    token: str


@pytest.fixture
def hub_web(link: Link, tmp_path: Path) -> Iterator[Callable[[], Site]]:
    """Start it once the hub's tunnel (hence its address) is up; stopped after the test."""
    servers: list[subprocess.Popen[bytes]] = []

    def serve() -> Site:
        token = secrets.token_hex(16)
        www = tmp_path / "www"
        www.mkdir()
        (www / "token").write_text(token)
        argv = [sys.executable, "-m", "http.server", str(HTTP_PORT)]
        server = subprocess.Popen(
            link.argv(link.a, *argv, "--bind", str(HUB_OVERLAY.ip), "--directory", str(www)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        servers.append(server)
        site = Site(f"http://{HUB_OVERLAY.ip}:{HTTP_PORT}/token", token)
        assert fetch_until(link, link.a, site.url) == token  # up, seen from its own side
        return site

    yield serve
    for server in servers:
        server.kill()
        server.wait()


def node_peer(keys: KeyPair) -> Peer:
    """The hub's peer for an enrolled node: its overlay address only, no endpoint."""
    return Peer(keys.public_key, (ip_network(f"{NODE_OVERLAY.ip}/32"),))


def hub_peer(keys: KeyPair) -> Peer:
    """The node's peer for the hub: the whole overlay, at the hub's address, kept open."""
    return Peer(
        keys.public_key,
        (HUB_OVERLAY.network,),
        endpoint=Endpoint(ip_address(A_ADDR), HUB_PORT),
        persistent_keepalive_s=25,
    )


@pytest.mark.netns
def test_http_crosses_the_tunnel_once_the_hub_adds_the_node(
    link: Link,
    backend: Backend,
    start: Callable[..., Side],
    hub_web: Callable[[], Site],
    tmp_path: Path,
) -> None:
    before = datetime.now(UTC)
    hub = start(link.a, "hub", HUB_OVERLAY, backend=backend, listen_port=HUB_PORT)
    node = start(link.b, "node", NODE_OVERLAY, backend=backend, peers=(hub_peer(hub.keys),))
    assert hub.tunnel.backend is node.tunnel.backend is backend
    for key_file in ("hub.key", "node.key"):
        assert _mode(tmp_path / key_file) == 0o600
    site = hub_web()

    # The hub does not know the node yet: its handshakes are dropped, nothing gets through.
    assert fetch(link, link.b, site.url, timeout_s=3.0) is None
    assert hub.tunnel.state().peers == ()

    hub.tunnel.add_peer(node_peer(node.keys))  # enrollment, on the running interface
    assert fetch_until(link, link.b, site.url) == site.token

    after = datetime.now(UTC)
    hub_state, node_state = hub.tunnel.state(), node.tunnel.state()
    assert hub_state.listen_port == HUB_PORT
    seen_by_hub = hub_state.peer(node.keys.public_key)
    assert seen_by_hub is not None
    assert seen_by_hub.latest_handshake is not None
    assert before - timedelta(seconds=1) <= seen_by_hub.latest_handshake <= after
    # The hub learnt where the node is from its authenticated packets.
    assert seen_by_hub.endpoint == Endpoint(ip_address(B_ADDR), node_state.listen_port)
    assert seen_by_hub.rx_bytes > 0
    assert seen_by_hub.tx_bytes > 0
    assert seen_by_hub.allowed_ips == (ip_network("100.64.0.2/32"),)
    seen_by_node = node_state.peer(hub.keys.public_key)
    assert seen_by_node is not None
    assert seen_by_node.latest_handshake is not None
    assert seen_by_node.endpoint == Endpoint(ip_address(A_ADDR), HUB_PORT)
    assert seen_by_node.persistent_keepalive_s == 25
    assert seen_by_node.rx_bytes > 0


@pytest.mark.netns
def test_removing_the_peer_cuts_the_node_off(
    link: Link,
    backend: Backend,
    start: Callable[..., Side],
    hub_web: Callable[[], Site],
    tmp_path: Path,
) -> None:
    node_keys = ensure_keypair(tmp_path / "node.key")
    hub = start(
        link.a,
        "hub",
        HUB_OVERLAY,
        backend=backend,
        listen_port=HUB_PORT,
        peers=(node_peer(node_keys),),
    )
    start(link.b, "node", NODE_OVERLAY, backend=backend, peers=(hub_peer(hub.keys),))
    site = hub_web()
    assert fetch_until(link, link.b, site.url) == site.token

    hub.tunnel.remove_peer(node_keys.public_key)  # revocation
    assert hub.tunnel.state().peer(node_keys.public_key) is None
    assert fetch(link, link.b, site.url, timeout_s=3.0) is None
    hub.tunnel.remove_peer(node_keys.public_key)  # again: nothing to do


@pytest.mark.netns
def test_down_leaves_no_interface_process_or_socket(link: Link, start: Callable[..., Side]) -> None:
    side = start(link.a, "hub", HUB_OVERLAY)
    assert side.pid is not None
    assert Path(f"/proc/{side.pid}").exists()
    assert uapi_socket(side.tunnel.name).is_socket()
    assert link_exists(link.a, side.tunnel.name)
    assert pids_in(link.a) == [side.pid]
    side.tunnel.down()
    assert_gone(side)
    side.tunnel.down()  # idempotent
    assert side.tunnel.backend is None


@pytest.mark.netns
def test_down_cleans_up_after_a_killed_wireguard_go(link: Link, start: Callable[..., Side]) -> None:
    side = start(link.a, "hub", HUB_OVERLAY)
    assert side.pid is not None
    os.kill(side.pid, signal.SIGKILL)  # no chance to remove its socket
    with pytest.raises(UapiError):
        side.tunnel.state()
    side.tunnel.down()
    assert_gone(side)


@pytest.mark.netns
def test_a_tunnel_that_fails_to_configure_leaves_nothing_behind(
    link: Link, start: Callable[..., Side]
) -> None:
    start(link.a, "hub", HUB_OVERLAY, listen_port=HUB_PORT)
    clash = InterfaceConfig(
        name=f"kwc{link.suffix}",
        private_key=generate_keypair().private_key,
        addresses=(NODE_OVERLAY,),
        listen_port=HUB_PORT,  # taken by the hub's tunnel in the same namespace
    )
    tunnel = Tunnel(clash, netns=link.a, backend=Backend.userspace)
    with pytest.raises(UapiError) as caught:
        tunnel.up()
    assert caught.value.errno is not None
    assert "refused to configure the interface" in str(caught.value)
    assert clash.private_key not in str(caught.value)
    assert tunnel.backend is None
    assert not link_exists(link.a, clash.name)
    assert not uapi_socket(clash.name).exists()


@pytest.mark.netns
def test_interface_names_must_be_unique_on_the_host(link: Link, start: Callable[..., Side]) -> None:
    first = start(link.a, "hub", HUB_OVERLAY)
    again = InterfaceConfig(
        name=first.tunnel.name,
        private_key=generate_keypair().private_key,
        addresses=(NODE_OVERLAY,),
    )
    with pytest.raises(WireGuardError, match="already exists in network namespace") as caught:
        Tunnel(again, netns=link.a, backend=Backend.userspace).up()
    assert caught.value.fix is not None
    # Another namespace has no such link, but wireguard-go's socket folder is shared.
    elsewhere = Tunnel(again, netns=link.b, backend=Backend.userspace)
    with pytest.raises(WireGuardError, match="another wireguard-go already runs"):
        elsewhere.up()
    assert not link_exists(link.b, again.name)
    assert first.tunnel.state().listen_port > 0  # the first one is untouched


@pytest.mark.netns
def test_take_over_removes_the_wireguard_interface_a_dead_owner_left_and_nothing_else(
    link: Link, start: Callable[..., Side], tmp_path: Path
) -> None:
    """An appliance killed with its tunnel up leaves the interface (the kernel's outlives
    the process; a wireguard-go child may too): its next run takes the name over. A link of
    that name that is not WireGuard's is still refused, and left as it is."""
    left = start(link.a, "hub", HUB_OVERLAY)
    old_pid = left.pid
    config = InterfaceConfig(
        name=left.tunnel.name,
        private_key=generate_keypair().private_key,
        addresses=(NODE_OVERLAY,),
    )
    again = Tunnel(config, netns=link.a, backend=Backend.userspace)
    with pytest.raises(WireGuardError, match="already exists"):
        again.up()  # without take_over, the rule stands
    again.up(take_over=True)
    try:
        assert again.pid != old_pid
        assert old_pid is not None
        assert not running(old_pid), "the old wireguard-go still runs"
        assert again.state().listen_port > 0
    finally:
        again.down()
    left.tunnel.down()  # its owner's handle: nothing is left to remove
    assert_gone(Side(again, left.keys, link.a, again.pid))

    name = f"kwv{link.suffix}"
    subprocess.run(
        link.argv(link.a, "ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"),
        check=True,
    )
    other = InterfaceConfig(
        name=name, private_key=generate_keypair().private_key, addresses=(NODE_OVERLAY,)
    )
    with pytest.raises(WireGuardError, match="already exists"):
        Tunnel(other, netns=link.a, backend=Backend.userspace).up(take_over=True)
    assert link_exists(link.a, name)


@pytest.mark.netns
def test_kernel_backend_without_wireguard_is_a_clear_error(link: Link) -> None:
    if kernel_has_wireguard(link.a):
        pytest.skip("this kernel has WireGuard: the kernel backend tests run instead")
    config = _config(name=f"kwk{link.suffix}")
    with pytest.raises(WireGuardUnavailableError) as caught:
        Tunnel(config, netns=link.a, backend=Backend.kernel).up()
    assert caught.value.fix is not None
    assert "modprobe wireguard" in caught.value.fix
    assert not link_exists(link.a, config.name)
    # `auto` falls back to wireguard-go on such a kernel.
    if shutil.which("wireguard-go") is not None:
        with Tunnel(config, netns=link.a) as tunnel:
            assert tunnel.backend is Backend.userspace
        assert not link_exists(link.a, config.name)
        assert not uapi_socket(config.name).exists()
