"""A site without a hub, on the appliance image booted under QEMU: a module of its own, so
that it boots on another worker while `test_image.py`'s four boots run."""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from openai import OpenAI

from appliance.packages.cache import PackageCache
from image.configure import DATA_LABEL, ROOT_A_LABEL, partitions
from shared import __version__
from tests.conftest import PATIENT_S1
from tests.image.vm import (
    GROW,
    LAN,
    READY_BOUND_S,
    Machine,
    accelerator,
    copy_image,
    kvl,
    read_file,
    release_bundles,
    usb_stick,
    write_files,
)
from tests.packages import package
from tests.waiting import until_sync

if TYPE_CHECKING:
    from appliance.state.records import ModelRecord

pytestmark = pytest.mark.image


@pytest.mark.timeout(3600)
def test_a_hubless_image_takes_a_key_made_over_the_lan_and_a_site_bundle(
    manifest: dict[str, Any], tmp_path: Path, default_model: ModelRecord
) -> None:
    """A site without a hub: `kvl image configure --no-hub` writes a bootstrap admin key's
    hash into a copy; booted, the node serves its LAN alone, and that key makes an account
    and a key over the LAN, which the node then serves. Then it takes a site bundle
    (`kvl bundle create`, signed as `just image` signs releases) through its admin API: a
    tampered copy is refused with nothing changed; the bundle's model is served (as the
    official client lists it), and its package is cached; so is the package of a bundle on a
    USB stick left in at boot. Releases come the same way: one in a site bundle is installed
    into slot B and rebooted into, marked good once it serves; a broken one after it is
    installed into slot A, fails its trial and the node falls back to B by itself. Its
    network is the provisioning file's static address from the first boot (every boot);
    moved through the admin API and confirmed there, it is kept, and a change nobody
    confirms is rolled back."""
    disk = copy_image(Path(manifest["image"]), tmp_path / "disk.img", GROW)
    admin = kvl(
        "image", "configure", str(disk), "--no-hub", "--name", "lab-server",
        "--address", f"{STATIC}/24", "--gateway", GATEWAY, "--dns", DNS,
    ).strip()  # fmt: skip
    if accelerator() == "tcg":
        root = next(p for p in partitions(disk) if p.name == ROOT_A_LABEL)
        write_files(disk, {PATIENCE: PATIENT}, root.offset)
    # The LAN API is forwarded to the static address alone: it answers only if the node
    # took the provisioning file's network at its first boot.
    # A USB stick left in at boot, with a bundle of another package on it.
    stick = usb_stick(tmp_path / "stick.img", [stick_bundle_of(tmp_path)])
    # The releases' site bundles, made while the machine boots (minutes each).
    pool = ThreadPoolExecutor(max_workers=1)
    releases = pool.submit(release_site_bundles, manifest, tmp_path / "releases")
    pool.shutdown(wait=False)
    with Machine(disk, tmp_path / "vm", guest=STATIC, more_guests=(MOVED,), usb=stick) as machine:
        machine.wait_ready()
        base = f"http://127.0.0.1:{machine.port}"
        made = lan_call(base, "/v1/admin/accounts", admin, {"name": "class-7b"})
        assert made["name"] == "class-7b", made
        key = lan_call(base, "/v1/admin/keys", admin, {"account": "class-7b"})["key"]
        models = lan_call(base, "/v1/models", key)
        assert models["object"] == "list", models
        assert models["data"], models  # the embedded models, served to the new key
        with pytest.raises(urllib.error.HTTPError) as refused:  # not an admin key
            lan_call(base, "/v1/admin/keys", key, {"account": "class-7b"})
        assert refused.value.code == 403
        refused.value.close()  # the error holds the answer's connection

        bundle = site_bundle_of(tmp_path, default_model)
        data = bundle.read_bytes()
        tampered = bytearray(data)
        tampered[len(data) // 2] ^= 1
        failed = upload_bundle(base, admin, bytes(tampered))
        assert failed["state"] == "failed", failed
        assert failed["part"].startswith("models/"), failed
        served = json.dumps(lan_call(base, "/v1/models", key))
        assert "site-gemma" not in served

        applied = upload_bundle(base, admin, data)
        assert applied["state"] == "applied", applied
        assert applied["applied"]["model"] == ["site-gemma@1"], applied
        # The official client sees the model served. Not asked for a token here: emulated
        # beside the other image tests' machines, one token of a one-word prompt took more
        # than ten minutes in CI; tests/appliance/test_site_bundle.py has the same bundle's
        # model answer through the official client, by its name and by the alias.
        client = OpenAI(base_url=f"{base}/v1", api_key=key, timeout=300, max_retries=0)
        assert "site-gemma" in {m.id for m in client.models.list()}
        from_stick: list[dict[str, Any]] = []

        def stick_done() -> bool:
            from_stick[:] = [
                u for u in lan_call(base, "/v1/admin/bundles", admin)["data"]
                if u["source"] == "usb term-3.kvlbundle"
            ]  # fmt: skip
            return bool(from_stick) and from_stick[0]["state"] in {"applied", "failed"}

        until_sync(stick_done, "the USB stick's bundle applied", 600, every_s=2)
        assert [u["state"] for u in from_stick] == ["applied"], from_stick
        packages = lan_call(base, "/v1/packages", key)
        assert sorted(p["id"] for p in packages["data"]) == [PACKAGE_ID, STICK_PACKAGE_ID]

        for version, site in releases.result().items():
            applied = upload_bundle(base, admin, site)
            assert (applied["state"], applied["applied"]) == ("applied", {"release": [version]})
            site.unlink()
            if version == UPDATE:  # installed into slot B, rebooted into, on trial
                machine.wait_console("slot B marked good", bound_s=UPDATE_BOUND_S)
            else:  # installed into slot A, its trial failed: back to B
                machine.wait_console("slot A marked bad", bound_s=UPDATE_BOUND_S)
                machine.wait_console("slot B marked good", count=2, bound_s=UPDATE_BOUND_S)
            machine.wait_ready()

        network_changes(base, f"http://127.0.0.1:{machine.ports[MOVED]}", admin)
        machine.power_off()

    reports = [
        json.loads(line)
        for line in read_file(disk, DATA_LABEL, "/update/health.jsonl").splitlines()
    ]
    assert [(r["slot"], r["version"], r["trial"], r["result"]) for r in reports] == [
        ("A", __version__, False, "good"),
        ("B", UPDATE, True, "good"),
        ("A", BROKEN, True, "bad"),
        ("B", UPDATE, False, "good"),
    ], reports


def network_changes(base: str, moved: str, admin: str) -> None:
    """The node moved to another address through its admin API, confirmed over the new
    one and kept; then a change nobody can confirm (an address nothing reaches), rolled
    back to the last working one by itself."""
    state = lan_call(base, "/v1/admin/network", admin)
    assert state["managed"] is True, state
    assert state["applied"]["addresses"] == [f"{STATIC}/24"], state
    assert "provisioning file" in state["source"], state
    change = {"addresses": [f"{MOVED}/24"], "gateways": [GATEWAY], "confirm_within_s": 600}
    asked = lan_call(base, "/v1/admin/network", admin, change, method="PUT")
    assert asked["outcome"] == "requested", asked
    # networkd has it once the node answers at the new address.
    until_sync(lambda: answers(moved, admin), "the node at its new address", 600, every_s=2)
    lan_call(moved, "/v1/admin/network/confirm", admin, {"id": asked["id"]})
    kept: dict[str, Any] = {}

    def settled() -> bool:
        kept.update(lan_call(moved, "/v1/admin/network", admin))
        last = kept["last"] or {}
        return bool(last.get("id") == asked["id"] and last.get("outcome") != "trying")

    until_sync(settled, "the confirmed change kept", 300, every_s=1)
    assert kept["last"]["outcome"] == "applied", kept
    assert kept["applied"]["addresses"] == [f"{MOVED}/24"], kept

    lost = {"addresses": [f"{NOWHERE}/24"], "gateways": [GATEWAY], "confirm_within_s": 30}
    asked = lan_call(moved, "/v1/admin/network", admin, lost, method="PUT")
    ended: dict[str, Any] = {}

    def back() -> bool:
        if not answers(moved, admin):
            return False
        ended.update(lan_call(moved, "/v1/admin/network", admin))
        last = ended["last"]  # the agent takes the change a moment after the answer
        return bool(last["id"] == asked["id"] and last["outcome"] != "trying")

    until_sync(back, "the unconfirmed change rolled back", 900, every_s=2)
    assert ended["last"]["id"] == asked["id"], ended
    assert ended["last"]["outcome"] == "rolled_back", ended
    assert "not confirmed within 30 s" in ended["last"]["reason"], ended
    assert ended["applied"]["addresses"] == [f"{MOVED}/24"], ended


def answers(base: str, admin: str) -> bool:
    try:
        lan_call(base, "/v1/admin/network", admin, timeout=10)
    except (OSError, ValueError):  # refused, reset, timed out, or cut mid-answer
        return False
    return True


# The guest's LAN (tests/image/vm.py): QEMU's user-mode network, this machine at .2.
GATEWAY, DNS, STATIC, MOVED, NOWHERE = (
    str(ipaddress.ip_network(LAN)[n]) for n in (2, 3, 20, 30, 40)
)
PATIENCE = "/etc/systemd/system/kovenlab-appliance.service.d/emulated.conf"
# Emulated, a prompt takes minutes without a token: past the worker's hang bound (60 s),
# which would restart it mid-prompt, and past S1's first-token objective, which would shed
# it (the host's speed, not the code's: as the tests' patient S1 does for the real model).
PATIENT = (
    "[Service]\nEnvironment=KVL_MODEL__WORKER_HANG_TIMEOUT_S=1800\n"
    + "".join(f"Environment=KVL_CLASSES__S1__{k.upper()}={v}\n" for k, v in PATIENT_S1.items())
).encode()
PACKAGE_ID = f"pkg_{7:024x}"
STICK_PACKAGE_ID = f"pkg_{8:024x}"
PIECE = 16 << 20


UPDATE, BROKEN = f"{__version__}+site", f"{__version__}+site-broken"
UPDATE_BOUND_S = 2 * READY_BOUND_S[accelerator()]  # an install and a boot, or two boots


def release_site_bundles(manifest: dict[str, Any], folder: Path) -> dict[str, Path]:
    """A site bundle for each of two releases of the image's own root (tests/image/vm.py):
    UPDATE, and BROKEN after it (its appliance exits at once)."""
    # zstd -6, as `just image` compresses: made in a thread while the machine boots (off the
    # test's path), they are half the bytes of -1 for the emulated node to take in, hash,
    # and read through RAUC's hash tree
    made = release_bundles(manifest, folder, {UPDATE: False, BROKEN: True}, level=6)
    sites = {}
    for version, release in made.items():
        sites[version] = _signed_bundle(
            folder / f"{version}.kvlbundle", "--release", f"{version}={release}"
        )
        release.unlink()
    return sites


def site_bundle_of(tmp_path: Path, model: ModelRecord) -> Path:
    """A site bundle of the default model under another name, a content package and a
    settings overlay (an alias), signed by the image build's release signer."""
    overlay = tmp_path / "site.json"
    overlay.write_text(json.dumps({"aliases": {"site-chat": "site-gemma@1"}}))
    return _signed_bundle(
        tmp_path / "site.kvlbundle",
        "--model", f"site-gemma@1={model.path}",
        "--package", str(_package_archive(tmp_path, 7)), "--settings", str(overlay),
    )  # fmt: skip


def stick_bundle_of(tmp_path: Path) -> Path:
    """A site bundle of another content package, for a USB stick."""
    (tmp_path / "stick").mkdir()
    return _signed_bundle(
        tmp_path / "stick" / "term-3.kvlbundle", "--package", str(_package_archive(tmp_path, 8))
    )


def _package_archive(tmp_path: Path, n: int) -> Path:
    """The archive of test package `n` (tests/packages.py), as GET /v1/packages/ID/archive."""
    cache = PackageCache(tmp_path / f"package-cache-{n}", max_bytes=10**9)
    manifest, files = package(n)
    cache.put(manifest, files, f"key-{n}")
    archive = tmp_path / f"lesson-{n}.tar"
    archive.write_bytes(cache.bundle(manifest.id))
    return archive


def _signed_bundle(out: Path, *parts: str) -> Path:
    """`kvl bundle create OUT PARTS…`, signed by the image build's release signer."""
    from image.build import DEFAULT_BUILD_DIR, Paths  # noqa: PLC0415
    from image.bundle import development_signing  # noqa: PLC0415

    signing = development_signing(Paths(DEFAULT_BUILD_DIR).signing)
    kvl("bundle", "create", str(out), *parts, "--signing-cert", str(signing.cert),
        "--signing-key", str(signing.key))  # fmt: skip
    return out


def upload_bundle(base: str, admin: str, bundle: bytes | Path) -> Any:
    """A bundle (its bytes, or its file) sent in pieces, then its upload once the node
    checked and applied it."""
    size = len(bundle) if isinstance(bundle, bytes) else bundle.stat().st_size
    made = lan_call(base, "/v1/admin/bundles", admin, {"size": size})
    path = f"/v1/admin/bundles/{made['id']}"
    for offset in range(0, size, PIECE):
        if isinstance(bundle, bytes):
            piece = bundle[offset : offset + PIECE]
        else:
            with bundle.open("rb") as f:
                f.seek(offset)
                piece = f.read(PIECE)
        request = urllib.request.Request(base + path, data=piece, method="PATCH")
        request.add_header("Authorization", f"Bearer {admin}")
        request.add_header("Upload-Offset", str(offset))
        request.add_header("Content-Type", "application/octet-stream")
        with urllib.request.urlopen(request, timeout=600) as answer:
            assert answer.status == 200
    ended: dict[str, Any] = {}

    def checked() -> bool:
        ended.update(lan_call(base, path, admin))
        return ended["state"] in {"applied", "failed"}

    until_sync(checked, "the bundle checked and applied", 1200, every_s=2)
    return ended


def lan_call(
    base: str,
    path: str,
    key: str,
    body: dict[str, Any] | None = None,
    *,
    method: str | None = None,
    timeout: float = 60,
) -> Any:
    """A call to the node's LAN API: POST (or `method`) `body` as JSON, or GET without one."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        base + path, data=data, method=method or ("GET" if body is None else "POST")
    )
    request.add_header("Authorization", f"Bearer {key}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())
