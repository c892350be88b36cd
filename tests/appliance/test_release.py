"""The image release the hub gives a node, on the node's side (appliance/fleet/release.py):
a real hub on loopback rolls a release out to the node (protocol 6), the node's updater
fetches the bundle through the node API (a cut download resumed, a damaged one refused),
and installs it with the real `rauc` (Debian's, which `just setup-system` installs) into
file-backed slots of a test system.conf (`bootloader=noop`), signed by a test CA; the
reboot is the test's (the boot id, and the slot the RAUC service is told is booted),
after which the node marks the new slot good, or reports the rollback. Where the updater
is absent the node refuses the release, saying why, and reports no image."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import subprocess
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from wireguard_tools import WireguardKey

from appliance.app import create_app
from appliance.cli import _update_summary
from appliance.fleet.client import HubClient
from appliance.fleet.release import Updater, image_version
from appliance.state.store import AsyncStore, Store
from appliance.update.installer import InstallerError, Rauc, parse_status
from hub.app import create_app as create_hub
from hub.identity import certificates, ssl_context
from hub.planning.rollout import Strategy
from hub.rollouts import begin
from hub.settings import HubSettings
from hub.state.store import open_store
from image.bundle import development_signing
from shared import pki, protocol, site_bundle
from shared.supervise import Failures
from tests.bundles import upload_bundle
from tests.conftest import make_settings
from tests.hubs import settings_for
from tests.releases import speak_releases
from tests.waiting import until, until_sync

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient, AiohttpServer


class Given:
    """A hub that has given this test's node release 1.1 (`bundle`), and the node's side:
    its client and its store, holding that desired state."""

    def __init__(self, hub: HubSettings, client: HubClient, store: AsyncStore, bundle: bytes):
        self.hub = hub
        self.client = client
        self.store = store
        self.bundle = bundle
        self.sha256 = hashlib.sha256(bundle).hexdigest()


def _targeted(hub: HubSettings) -> bool:
    store = open_store(hub)
    try:
        return bool(store.rollouts.node_release_versions())
    finally:
        store.close()


async def give_release(
    aiohttp_server: AiohttpServer, tmp_path: Path, bundle: bytes
) -> AsyncIterator[Given]:
    hub = settings_for(tmp_path, fleet={"rollout_every_s": 0.05})
    hub.artifacts_dir.mkdir(parents=True)
    sha256 = hashlib.sha256(bundle).hexdigest()
    (hub.artifacts_dir / sha256).write_bytes(bundle)
    store = open_store(hub)
    token = store.tokens.create("lab", uses=1, expires_in_s=60).plaintext
    node = store.nodes.enroll(token, name="edge",
                              wg_public_key=str(WireguardKey.generate().public_key()),
                              overlay_prefix="100.64.0.0/10", labels={}, versions={})  # fmt: skip
    store.rollouts.add_release("1.1", "", sha256, len(bundle))
    store.close()
    server = await aiohttp_server(create_hub(hub), ssl=ssl_context(hub))
    pin = aiohttp.Fingerprint(pki.fingerprint_bytes(certificates(hub)[1].fingerprint))
    client = HubClient(f"https://127.0.0.1:{server.port}", pin, node.node_token)
    local = AsyncStore(tmp_path / "node" / "appliance.db")
    await local.open()
    try:
        await client.heartbeat({}, protocol.Capacity())
        await until(lambda: speak_releases(hub), "the node's heartbeat stored")
        store = open_store(hub)
        begin(store, "release", {"release": "1.1"}, Strategy(max_burn_rate=None), "test")
        store.close()
        await until(lambda: _targeted(hub), "the release given to the node")
        state = await client.state(-1)
        assert state is not None
        assert state.release is not None
        assert (state.release.version, state.release.sha256) == ("1.1", sha256)
        await local.run(local.sync.apply_desired_state, state)
        yield Given(hub, client, local, bundle)
    finally:
        await client.close()
        await local.close()


@pytest.fixture
async def given(aiohttp_server: AiohttpServer, tmp_path: Path) -> AsyncIterator[Given]:
    async for g in give_release(aiohttp_server, tmp_path, b"not a real bundle" * 4096):
        yield g


async def test_a_node_without_the_updater_refuses_the_release_saying_why(
    given: Given, tmp_path: Path
) -> None:
    updater = Updater(
        given.store, Rauc("kvl-no-such-updater"), tmp_path / "updates",
        os_release=tmp_path / "os-release",
    )  # fmt: skip
    await updater.converge(given.client)
    assert updater.image is None
    assert updater.release_error is not None
    assert "no image updater" in updater.release_error
    assert "1.1" in updater.release_error
    assert not (tmp_path / "updates").exists()  # nothing fetched
    # No release given: nothing to refuse.
    await given.store.run(given.store.sync.set_meta, "desired_release", json.dumps(None))
    await updater.converge(given.client)
    assert _error(updater) is None
    # What the heartbeat carries, within the protocol's bounds.
    protocol.Capacity(image=updater.image, release_error=updater.release_error)


def _error(updater: Updater) -> str | None:
    """The updater's release error as it is now (read through a call: mypy narrows an
    attribute across the awaits that change it)."""
    return updater.release_error


def _image(updater: Updater) -> protocol.ImageStatus:
    image = updater.image
    assert image is not None
    return image


def test_the_updaters_status_is_read_from_raucs_json(tmp_path: Path) -> None:
    raw = {
        "compatible": "kovenlab-edge", "booted": "B", "boot_primary": "rootfs.1",
        "slots": [
            {"rootfs.0": {"class": "rootfs", "bootname": "A", "state": "inactive",
                          "boot_status": "good",
                          "slot_status": {"bundle": {"version": "1.0"}, "status": "ok"}}},
            {"rootfs.1": {"class": "rootfs", "bootname": "B", "state": "booted",
                          "boot_status": "good",
                          "slot_status": {"bundle": {"version": "1.1"}, "status": "ok"}}},
        ],
    }  # fmt: skip
    status = parse_status(raw)
    assert status.booted_slot is not None
    assert (status.booted_slot.name, status.booted_slot.version) == ("rootfs.1", "1.1")
    assert status.primary == "rootfs.1"
    os_release = tmp_path / "os-release"
    os_release.write_text('ID=debian\nIMAGE_ID=kovenlab-edge\nIMAGE_VERSION="1.0"\n')
    assert image_version(os_release) == "1.0"
    assert image_version(tmp_path / "missing") is None


# -- the real updater --------------------------------------------------------------------------


def _signer(folder: Path) -> tuple[Path, Path, Path]:
    """A test CA (the keyring) and a signing certificate it issued: (keyring, cert, key).
    No extended key usage on the signer, as RAUC's own test certificates."""
    ca = pki.new_ca("kvl test release CA")
    key = pki.new_key()
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    start = pki.now() - datetime.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvl test signer")]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = (folder / "keyring.pem", folder / "signer.pem", folder / "signer.key")
    paths[0].write_bytes(ca.cert_pem)
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(pki.key_pem(key))
    return paths


class RaucHost:
    """RAUC on this machine with a test system.conf: two file-backed raw slots (A and B),
    `bootloader=noop`, the test CA as keyring, its service on a D-Bus session bus of the
    test's own (how RAUC's own tests run it), told which slot is booted."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        for tool in ("rauc", "mksquashfs", "dbus-daemon"):
            assert shutil.which(tool), f"{tool} is missing: run `just setup-system`"
        folder.mkdir(parents=True, exist_ok=True)
        self.keyring, self.cert, self.key = _signer(folder)
        for slot in ("a", "b"):
            (folder / f"slot-{slot}.img").write_bytes(b"\0" * 65536)
        self.conf = folder / "system.conf"
        self.conf.write_text(
            "[system]\ncompatible=kovenlab-test\nbootloader=noop\n"
            f"statusfile={folder / 'rauc.status'}\nmountprefix={folder / 'mnt'}\n\n"
            f"[keyring]\npath={self.keyring}\n\n"
            f"[slot.rootfs.0]\ndevice={folder / 'slot-a.img'}\ntype=raw\nbootname=A\n\n"
            f"[slot.rootfs.1]\ndevice={folder / 'slot-b.img'}\ntype=raw\nbootname=B\n"
        )
        (folder / "mnt").mkdir(exist_ok=True)
        self.bus = subprocess.Popen(
            ["dbus-daemon", "--session", "--nofork", "--print-address=1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.bus.stdout is not None
        self.env = {"DBUS_SESSION_BUS_ADDRESS": self.bus.stdout.readline().strip(),
                    "DBUS_STARTER_BUS_TYPE": "session"}  # fmt: skip
        self.service: subprocess.Popen[bytes] | None = None

    def boot(self, bootname: str) -> None:
        """The RAUC service (re)started as if `bootname`'s slot had booted."""
        self.stop_service()
        self.service = subprocess.Popen(
            ["rauc", f"--conf={self.conf}", f"--override-boot-slot={bootname}", "service"],
            env={**os.environ, **self.env}, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        until_sync(self._answers, "the RAUC service answers", 30)

    def _answers(self) -> bool:
        done = subprocess.run(
            ["rauc", "status", "--output-format=json"], env={**os.environ, **self.env},
            capture_output=True, check=False,
        )  # fmt: skip
        return done.returncode == 0

    def bundle(self, version: str) -> bytes:
        content = self.folder / f"content-{version}"
        content.mkdir()
        (content / "rootfs.img").write_bytes(f"rootfs {version}\n".encode() * 1024)
        (content / "manifest.raucm").write_text(
            f"[update]\ncompatible=kovenlab-test\nversion={version}\n\n"
            "[bundle]\nformat=plain\n\n[image.rootfs]\nfilename=rootfs.img\n"
        )
        out = self.folder / f"{version}.raucb"
        subprocess.run(
            ["rauc", "bundle", f"--cert={self.cert}", f"--key={self.key}", str(content),
             str(out)], check=True, capture_output=True,
        )  # fmt: skip
        return out.read_bytes()

    def stop_service(self) -> None:
        if self.service is not None:
            self.service.terminate()
            self.service.wait(10)
            self.service = None

    def close(self) -> None:
        self.stop_service()
        self.bus.terminate()
        self.bus.wait(10)
        if self.bus.stdout is not None:
            self.bus.stdout.close()


@pytest.fixture
def rauc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RaucHost]:
    """RAUC on this machine, slot A booted; its D-Bus session bus in this test's
    environment, which the updater's commands inherit."""
    host = RaucHost(tmp_path / "rauc")
    try:
        host.boot("A")
        for name, value in host.env.items():
            monkeypatch.setenv(name, value)
        yield host
    finally:
        host.close()


class Watched(Rauc):
    """RAUC's CLI, noting what the updater reports (its heartbeat's image) as it installs."""

    def __init__(self, binary: str, options: list[str]) -> None:
        super().__init__(binary, options)
        self.updater: Updater | None = None
        self.seen: list[tuple[str, str | None]] = []

        self.asked: list[str] = []  # what each install was given: a file, or a URL

    def install(self, bundle: Path | str) -> None:
        image = self.updater.image if self.updater is not None else None
        self.seen.append((image.state, image.target) if image is not None else ("", None))
        self.asked.append(str(bundle))
        super().install(bundle)


class CannotStream(Watched):
    """RAUC that fails to stream (no network block device, say)."""

    def install(self, bundle: Path | str) -> None:
        if str(bundle).startswith("http"):
            self.asked.append(str(bundle))
            raise InstallerError("`rauc install` failed (1): Failed to stream bundle: no nbd")
        super().install(bundle)


async def test_a_release_is_installed_as_rauc_streams_it_through_the_node(
    aiohttp_server: AiohttpServer, tmp_path: Path, rauc: RaucHost
) -> None:
    """RAUC is given a loopback URL of the node's: every byte it reads is fetched from the hub
    through the node's client as it asks (this machine's RAUC, built without streaming,
    downloads it whole through that URL; the image's streams only the blocks it lacks), and
    the appliance never stores the bundle."""
    host = rauc
    bundle = host.bundle("1.1")
    async for given in give_release(aiohttp_server, tmp_path, bundle):
        updates = tmp_path / "node" / "updates"
        watched = Watched("rauc", [f"--conf={host.conf}"])
        updater = Updater(
            given.store, watched, updates, os_release=tmp_path / "os-release",
            boot=lambda: "boot-1",
        )  # fmt: skip
        watched.updater = updater
        (tmp_path / "os-release").write_text("IMAGE_VERSION=1.0\n")
        await updater.converge(given.client)
        assert len(watched.asked) == 1
        assert watched.asked[0].startswith("http://127.0.0.1:")
        assert watched.asked[0].endswith(f"/{given.sha256}.raucb")
        assert watched.seen == [("installing", "1.1")]
        assert (_image(updater).state, _image(updater).target) == (
            "installed-pending-reboot", "1.1")  # fmt: skip
        assert (tmp_path / "rauc" / "slot-b.img").read_bytes().startswith(b"rootfs 1.1")
        assert list(updates.iterdir()) == []
        # The URL is gone with the install: nothing else on the machine can read through it.
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as session:
                await session.get(watched.asked[0])


async def test_a_release_rauc_cannot_stream_is_fetched_whole_and_installed(
    aiohttp_server: AiohttpServer, tmp_path: Path, rauc: RaucHost
) -> None:
    host = rauc
    bundle = host.bundle("1.1")
    async for given in give_release(aiohttp_server, tmp_path, bundle):
        updates = tmp_path / "node" / "updates"
        refusing = CannotStream("rauc", [f"--conf={host.conf}"])
        updater = Updater(
            given.store, refusing, updates, os_release=tmp_path / "os-release",
            boot=lambda: "boot-1",
        )  # fmt: skip
        (tmp_path / "os-release").write_text("IMAGE_VERSION=1.0\n")
        await updater.converge(given.client)
        assert len(refusing.asked) == 2
        assert refusing.asked[0].startswith("http://127.0.0.1:")
        assert refusing.asked[1] == str(updates / f"{given.sha256}.raucb")
        assert _image(updater).state == "installed-pending-reboot"
        assert (tmp_path / "rauc" / "slot-b.img").read_bytes().startswith(b"rootfs 1.1")
        assert list(updates.iterdir()) == []
        # Off in the settings: fetched whole at once.
        await given.store.run(given.store.sync.set_meta, "image_update", "")
        host.boot("A")
        watched = Watched("rauc", [f"--conf={host.conf}"])
        updater = Updater(
            given.store, watched, updates, os_release=tmp_path / "os-release",
            boot=lambda: "boot-2", streaming=False,
        )  # fmt: skip
        await updater.converge(given.client)
        assert watched.asked == [str(updates / f"{given.sha256}.raucb")]


async def test_a_release_is_fetched_resumed_installed_by_rauc_and_marked_good_after_the_reboot(
    aiohttp_server: AiohttpServer, tmp_path: Path, rauc: RaucHost
) -> None:
    host = rauc
    bundle = host.bundle("1.1")
    current = {"id": "boot-1"}
    async for given in give_release(aiohttp_server, tmp_path, bundle):
        updates = tmp_path / "node" / "updates"
        watched = Watched("rauc", [f"--conf={host.conf}"])
        updater = Updater(
            given.store, watched, updates,
            os_release=tmp_path / "os-release", boot=lambda: current["id"],
        )  # fmt: skip
        watched.updater = updater
        (tmp_path / "os-release").write_text("IMAGE_VERSION=1.0\n")
        # A download cut after 1000 bytes resumes from there.
        updates.mkdir(parents=True)
        (updates / f"{given.sha256}.raucb.part").write_bytes(bundle[:1000])
        await updater.converge(given.client)
        assert updater.image is not None
        assert (_image(updater).version, _image(updater).slot) == ("1.0", "rootfs.0")
        assert (_image(updater).state, _image(updater).target) == (
            "installed-pending-reboot", "1.1")  # fmt: skip
        # A heartbeat sent while RAUC installed said so (not what the last refresh read).
        assert watched.seen == [("installing", "1.1")]
        assert list(updates.iterdir()) == []  # the bundle, installed, is gone
        assert (tmp_path / "rauc" / "slot-b.img").read_bytes().startswith(b"rootfs 1.1")
        # Asked again before the reboot: nothing is installed twice.
        await updater.converge(given.client)
        assert _image(updater).state == "installed-pending-reboot"

        # The reboot: slot B boots; the node reaches the hub, and marks it good.
        current["id"] = "boot-2"
        host.boot("B")
        await updater.converge(given.client)
        assert updater.image is not None
        assert (_image(updater).version, _image(updater).slot, _image(updater).state) == (
            "1.1", "rootfs.1", "good")  # fmt: skip
        # What `kvl appliance status` says of it.
        raw = await given.store.run(given.store.sync.meta, "image_update")
        assert _update_summary(raw) == "1.1: good"
        assert _update_summary("{not json") is None


async def test_a_damaged_bundle_fails_and_a_slot_that_never_booted_is_a_rollback(
    aiohttp_server: AiohttpServer, tmp_path: Path, rauc: RaucHost
) -> None:
    host = rauc
    bundle = host.bundle("1.1")
    current: dict[str, Any] = {"id": "boot-1", "now": 1000.0}
    async for given in give_release(aiohttp_server, tmp_path, bundle):
        updates = tmp_path / "node" / "updates"
        updater = Updater(
            given.store, Rauc("rauc", [f"--conf={host.conf}"]), updates,
            os_release=tmp_path / "os-release", boot=lambda: current["id"],
            clock=lambda: float(current["now"]), retry_s=60.0,
        )  # fmt: skip
        (tmp_path / "os-release").write_text("IMAGE_VERSION=1.0\n")
        # The hub's copy damaged: the node's check refuses it, nothing is installed.
        held = given.hub.artifacts_dir / given.sha256
        held.write_bytes(bundle[:-1] + bytes([bundle[-1] ^ 1]))
        await updater.converge(given.client)
        assert updater.image is not None
        assert _image(updater).state == "failed"
        assert "sha256" in (_image(updater).error or "")
        assert not list(updates.glob("*.raucb*"))
        # Not again before `retry_s`; then again, with the hub's copy whole.
        held.write_bytes(bundle)
        await updater.converge(given.client)
        assert _image(updater).state == "failed"
        current["now"] = 1100.0
        await updater.converge(given.client)
        assert _image(updater).state == "installed-pending-reboot"

        # The reboot comes back on slot A: the new slot never came up, a rollback.
        current["id"] = "boot-2"
        host.boot("A")
        await updater.converge(given.client)
        assert updater.image is not None
        assert (_image(updater).version, _image(updater).state) == ("1.0", "rolled-back")
        assert "booted the previous image (1.0)" in (_image(updater).error or "")
        # Never tried again by itself: it would reboot the site into it every `retry_s`.
        current["now"] = 1100.0 + 100 * 60.0
        await updater.converge(given.client)
        assert _image(updater).state == "rolled-back"
        assert not list(updates.glob("*.raucb*"))


async def test_the_reboot_after_an_install_stops_rauc_and_the_updater_takes_it_calmly(
    aiohttp_server: AiohttpServer, tmp_path: Path, rauc: RaucHost
) -> None:
    """On a node the reboot command stops RAUC's service at once, before the updater reads
    its status again: that read is refused, which is the reboot, not a failure of the loop
    (it was a logged traceback and a counted failure on every update)."""
    host = rauc
    bundle = host.bundle("1.1")
    async for given in give_release(aiohttp_server, tmp_path, bundle):
        assert host.service is not None
        failures = Failures()
        updater = Updater(
            given.store, Rauc("rauc", [f"--conf={host.conf}"]), tmp_path / "node" / "updates",
            os_release=tmp_path / "os-release", boot=lambda: "boot-1", failures=failures,
            reboot=["kill", str(host.service.pid)],
        )  # fmt: skip
        (tmp_path / "os-release").write_text("IMAGE_VERSION=1.0\n")
        updater.kick(given.client)
        assert updater._task is not None  # the background run kick started
        await updater._task
        assert host.service.wait(10) is not None  # the "reboot" stopped the service
        assert failures.count("fleet.release") == 0, failures.report()
        assert _image(updater).state == "installed-pending-reboot"
        assert (tmp_path / "rauc" / "slot-b.img").read_bytes().startswith(b"rootfs 1.1")


async def test_a_release_from_a_site_bundle_is_installed_as_one_from_the_hub(
    aiohttp_client: AiohttpClient, tmp_path: Path, rauc: RaucHost, scripted_models: list[Any]
) -> None:
    """A node without a hub takes a release from a site bundle (tests/appliance/
    test_site_bundle.py has the rest of its parts): kept where a fetched one is, installed
    into the other slot by RAUC, reported pending its reboot."""
    host = rauc
    release = tmp_path / "release.raucb"
    release.write_bytes(host.bundle("1.1"))
    signing = development_signing(tmp_path / "signing")
    site = tmp_path / "site.kvlbundle"
    site_bundle.create(
        site, [site_bundle.Source("release", release, version="1.1")],
        certificate=signing.cert.read_bytes(), key=signing.key.read_bytes(),
    )  # fmt: skip
    (tmp_path / "os-release").write_text("IMAGE_VERSION=1.0\n")
    settings = make_settings(
        tmp_path / "data",
        update={
            "keyring": str(signing.keyring), "rauc_options": [f"--conf={host.conf}"],
            "reboot_command": [], "os_release": str(tmp_path / "os-release"),
        },
    )  # fmt: skip
    store = Store(settings.db_path)
    for record in scripted_models:
        store.add_model(record)
    admin = store.create_key("ops", admin=True).plaintext
    store.close()
    client = await aiohttp_client(create_app(settings))
    done = await upload_bundle(client, admin, site.read_bytes())
    assert (done["state"], done["applied"]) == ("applied", {"release": ["1.1"]}), done

    def installed() -> bool:
        check = Store(settings.db_path)
        try:
            raw = check.meta("image_update")
        finally:
            check.close()
        return raw is not None and json.loads(raw)["state"] == "installed-pending-reboot"

    await until(installed, "the release to be installed", 60)
    assert (tmp_path / "rauc" / "slot-b.img").read_bytes().startswith(b"rootfs 1.1")
    assert not list(settings.updates_dir.glob("*.raucb"))  # installed, then removed
