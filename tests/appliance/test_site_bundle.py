"""Site bundles (shared/site_bundle.py, appliance/bundles.py): made by `kvl bundle create`,
signed by the image build's release signer, uploaded in pieces through a node's admin API
(resumed after a cut), checked offline against the node's keyring, and applied as the
hub's path applies the same things: the real default model under a new name, answering
through the official OpenAI client afterwards; a content package, cached and pinned; a
settings overlay (a model alias). Every hostile bundle is refused naming what failed, with
nothing of the node changed: an altered part, an altered manifest, a signer the keyring
does not trust or whose certificate had lapsed, a truncated file, a part out of place, a
member more than listed."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import io
import json
import shutil
import tarfile
from typing import TYPE_CHECKING, Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from openai import AsyncOpenAI

from appliance.app import create_app
from appliance.packages.cache import PackageCache
from appliance.state.store import Store
from image.bundle import Signing, development_signing
from shared import site_bundle
from tests.bundles import upload_bundle
from tests.conftest import REAL_MODELS, kvl, make_settings
from tests.packages import package

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from appliance.settings import ApplianceSettings
    from appliance.state.records import ModelRecord


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> Signing:
    """A release signer as the image build makes one (its CA is the image's keyring)."""
    return development_signing(tmp_path_factory.mktemp("signing") / "signing")


def _make(
    out: Path, signing: Signing, sources: list[site_bundle.Source], **more: Any
) -> site_bundle.BundleManifest:
    return site_bundle.create(
        out, sources, certificate=signing.cert.read_bytes(), key=signing.key.read_bytes(), **more
    )


def _package_archive(tmp_path: Path) -> tuple[Path, str]:
    cache = PackageCache(tmp_path / "source-cache", max_bytes=10**9)
    manifest, files = package(7)
    stored = cache.put(manifest, files, "key-7")
    archive = tmp_path / "lesson.tar"
    archive.write_bytes(cache.bundle(manifest.id))
    return archive, stored.ref


def _members(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(bundle) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]


def _rewrite(bundle: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _other_signer(folder: Path, *, lapsed: bool = False) -> Signing:
    """A signer of a CA the node does not trust (or, `lapsed`, one of the node's own CA
    whose certificate had ended before the bundle was made)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "someone else")])
    days = datetime.timedelta(days=1)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - 3 * days)
        .not_valid_after(now - 2 * days if lapsed else now + days)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    signing = Signing(folder / "cert.pem", folder / "key.pem", folder / "ca.pem")
    pem = serialization.Encoding.PEM
    signing.cert.write_bytes(cert.public_bytes(pem))
    signing.keyring.write_bytes(cert.public_bytes(pem))  # a signer placed in a keyring whole
    signing.key.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return signing


def test_a_bundle_is_refused_for_anything_wrong_with_it_and_writes_nothing_else(
    tmp_path: Path, signing: Signing
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\x01" * 300_000)
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"aliases": {"site-chat": "m@1"}}))
    good = tmp_path / "good.kvlbundle"
    made = _make(
        good, signing,
        [site_bundle.Source("model", model, "m", "1"), site_bundle.Source("settings", settings)],
        note="week 49",
    )  # fmt: skip
    keyring = signing.keyring.read_bytes()
    staging = tmp_path / "staging"
    staging.mkdir()
    verified = site_bundle.read(good, staging, keyring)
    assert verified.manifest == made
    assert verified.signer == "CN=Kovenlab Edge bundle signer"
    part = made.parts[0].path
    assert verified.files[part].read_bytes() == model.read_bytes()

    members = _members(good)
    cases: dict[str, tuple[list[tuple[tarfile.TarInfo, bytes]], str, str | None]] = {}
    altered = bytearray(members[2][1])
    altered[1000] ^= 1
    cases["an altered part"] = (
        [*members[:2], (members[2][0], bytes(altered)), members[3]],
        "does not match its sha256", part,
    )  # fmt: skip
    manifest = json.loads(members[0][1])
    manifest["note"] = "week 50"
    cases["an altered manifest"] = (
        [(members[0][0], json.dumps(manifest).encode()), *members[1:]],
        "does not match its manifest", None,
    )  # fmt: skip
    cases["a truncated bundle"] = (members[:3], "settings.json is missing", "settings.json")
    cases["parts out of order"] = (
        [members[0], members[1], members[3], members[2]],
        "not the part its manifest lists next", part,
    )  # fmt: skip
    extra = tarfile.TarInfo("models/" + "0" * 64)
    cases["a member more"] = ([*members, (extra, b"x")], "more than its manifest lists", None)
    cases["no signature"] = ([members[0], *members[2:]], "does not hold bundle.sig", None)
    big = json.dumps({**manifest, "note": "x" * (2 << 20)}).encode()
    cases["a huge manifest"] = ([(members[0][0], big), *members[1:]], "at most", None)
    for what, (content, said, failed) in cases.items():
        hostile = tmp_path / f"{what}.kvlbundle"
        _rewrite(hostile, content)
        folder = tmp_path / f"staging-{what}"
        folder.mkdir()
        with pytest.raises(site_bundle.BundleError, match=said) as refused:
            site_bundle.read(hostile, folder, keyring)
        assert refused.value.part == failed, what

    stranger = _other_signer(tmp_path / "stranger")
    foreign = tmp_path / "foreign.kvlbundle"
    _make(foreign, stranger, [site_bundle.Source("model", model, "m", "1")])
    with pytest.raises(site_bundle.BundleError, match="keyring does not trust"):
        site_bundle.read(foreign, tmp_path, keyring)
    # A site's own signer placed in the keyring whole is trusted; one whose certificate
    # had lapsed when the bundle was made is not.
    trusted = tmp_path / "staging-trusted"
    trusted.mkdir()
    assert site_bundle.read(foreign, trusted, stranger.keyring.read_bytes()).signer
    lapsed = _other_signer(tmp_path / "lapsed", lapsed=True)
    old = tmp_path / "lapsed.kvlbundle"
    _make(old, lapsed, [site_bundle.Source("model", model, "m", "1")])
    with pytest.raises(site_bundle.BundleError, match="not valid when the bundle was made"):
        site_bundle.read(old, tmp_path, lapsed.keyring.read_bytes())

    bad_settings = tmp_path / "bad.json"
    bad_settings.write_text('{"no_such_setting": 1}')
    with pytest.raises(site_bundle.BundleError, match="not node settings"):
        _make(tmp_path / "x.kvlbundle", signing, [site_bundle.Source("settings", bad_settings)])


def _admin(settings: ApplianceSettings) -> str:
    store = Store(settings.db_path)
    try:
        return store.create_key("ops", admin=True).plaintext
    finally:
        store.close()


@pytest.mark.model
async def test_a_node_without_a_hub_takes_a_model_a_package_and_settings_from_a_bundle(
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    signing: Signing,
    default_model: ModelRecord,
) -> None:
    settings = make_settings(
        tmp_path / "data",
        model=REAL_MODELS,
        update={"keyring": str(signing.keyring), "rauc": "no-rauc-here"},
    )
    store = Store(settings.db_path)
    store.add_model(default_model)
    store.close()
    admin = _admin(settings)
    archive, package_ref = _package_archive(tmp_path)
    overlay = tmp_path / "settings.json"
    overlay.write_text(json.dumps({"aliases": {"site-chat": "site-gemma@1"}}))
    bundle = tmp_path / "site.kvlbundle"
    # `kvl bundle create`, as an operator makes one on any connected machine.
    kvl(
        "bundle", "create", str(bundle),
        "--model", f"site-gemma@1={default_model.path}",
        "--package", str(archive), "--settings", str(overlay),
        "--signing-cert", str(signing.cert), "--signing-key", str(signing.key),
        "--note", "term 2",
    )  # fmt: skip
    listed = kvl("bundle", "verify", str(bundle), "--keyring", str(signing.keyring))
    assert "site-gemma@1" in listed.stdout
    data = bundle.read_bytes()

    app = create_app(settings)
    client = await aiohttp_client(app)
    headers = {"Authorization": f"Bearer {admin}"}
    # A tampered copy first: refused, naming the part; nothing registered.
    tampered = bytearray(data)
    tampered[len(data) // 2] ^= 1
    refused = await upload_bundle(client, admin, bytes(tampered))
    assert refused["state"] == "failed"
    assert refused["part"].startswith("models/")
    assert "sha256" in refused["error"]
    models = await (await client.get("/v1/models", headers=headers)).json()
    assert "site-gemma@1" not in json.dumps(models)

    done = await upload_bundle(client, admin, data, cut_at=len(data) // 3)
    assert done["state"] == "applied", done
    assert done["applied"] == {
        "package": [package_ref], "model": ["site-gemma@1"], "settings": ["settings.json"],
    }  # fmt: skip
    assert done["signer"] == "CN=Kovenlab Edge bundle signer"
    assert not list((settings.data_dir / "bundles").glob("*.part"))

    # The model answers through the official client, by its name and by the alias.
    port = client.server.port
    openai = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=admin)
    for name in ("site-gemma@1", "site-chat"):
        answer = await openai.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
        assert answer.choices[0].message.content is not None
        assert answer.model.startswith("site-gemma"), answer.model
    listed = await (await client.get("/v1/models", headers=headers)).json()
    assert "site-gemma" in {m["id"] for m in listed["data"]}
    packages = await (await client.get("/v1/packages", headers=headers)).json()
    assert any(p["id"] == package_ref.split("@")[0] for p in packages["data"])


async def test_a_bundle_left_in_the_inbox_is_applied_once(
    aiohttp_client: AiohttpClient, tmp_path: Path, signing: Signing
) -> None:
    """What the image does with a bundle on a USB stick (image/usb_import.py copies it into
    the inbox): taken, checked and applied as an upload; the same file again is removed,
    not applied twice; a tampered one is refused, naming its part."""
    settings = make_settings(tmp_path / "data", update={"keyring": str(signing.keyring)})
    admin = _admin(settings)
    archive, package_ref = _package_archive(tmp_path)
    bundle = tmp_path / "site.kvlbundle"
    _make(bundle, signing, [site_bundle.Source("package", archive)])
    app = create_app(settings)
    client = await aiohttp_client(app)
    headers = {"Authorization": f"Bearer {admin}"}
    inbox = settings.data_dir / "bundles" / "inbox"

    async def listed() -> list[dict[str, Any]]:
        answer = await client.get("/v1/admin/bundles", headers=headers)
        assert answer.status == 200
        data: list[dict[str, Any]] = (await answer.json())["data"]
        return data

    async def settled(count: int) -> list[dict[str, Any]]:
        for _ in range(300):
            uploads = await listed()
            if len(uploads) == count and all(u["state"] in {"applied", "failed"} for u in uploads):
                return uploads
            await asyncio.sleep(0.1)
        raise AssertionError(await listed())

    inbox.mkdir(parents=True, exist_ok=True)
    shutil.copy(bundle, inbox / "term-2.kvlbundle")
    [taken] = await settled(1)
    assert taken["state"] == "applied", taken
    assert taken["source"] == "usb term-2.kvlbundle"
    assert taken["applied"] == {"package": [package_ref]}
    assert taken["sha256"] == hashlib.sha256(bundle.read_bytes()).hexdigest()

    shutil.copy(bundle, inbox / "term-2-again.kvlbundle")  # the stick at the next boot
    for _ in range(300):
        if not (inbox / "term-2-again.kvlbundle").exists():
            break
        await asyncio.sleep(0.1)
    assert not (inbox / "term-2-again.kvlbundle").exists()
    assert len(await listed()) == 1  # not applied again

    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 1
    (inbox / "tampered.kvlbundle").write_bytes(bytes(data))
    uploads = await settled(2)
    [failed] = [u for u in uploads if u["source"] == "usb tampered.kvlbundle"]
    assert failed["state"] == "failed", failed
    assert failed["part"], failed
    assert not list(inbox.iterdir())
