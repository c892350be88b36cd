"""Sealed backups (shared/sealing.py) through the appliance's admin API: taken sealed with
age to a recipient or with a passphrase, opened by the age tool itself (Debian's `age`, as
an operator without kvl would), and put back through the API with the identity or the
passphrase in a header. A sealed file that is wrong or hostile is refused with nothing
staged: the wrong key, no key, an altered or truncated payload, a passphrase's key that
asks scrypt for more memory than a node gives it."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import pty
import re
import select
import subprocess
import sys
import tarfile
import time
from typing import TYPE_CHECKING, Any

import pytest
from pyrage import x25519

from appliance import backup as appliance_backup
from appliance.app import FLEET, create_app
from appliance.gateway.backups import IDENTITY_HEADER, PASSPHRASE_HEADER, RESTART, SCHEDULED
from appliance.state.store import Store
from hub.state.store import open_store
from shared import sealing
from tests.conftest import REPO, kvl, make_settings
from tests.hubs import settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from appliance.settings import ApplianceSettings
    from tests.conftest import Client

PASSPHRASE = "correct horse battery staple ✓"


def _keys(settings: ApplianceSettings) -> tuple[str, str]:
    store = Store(settings.db_path)
    try:
        return store.create_key("ops", admin=True).plaintext, store.create_key("lab-3").plaintext
    finally:
        store.close()


def _bearer(key: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **more}


async def _appliance(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings
) -> tuple[Client, list[float]]:
    app = create_app(settings)
    restarts: list[float] = []
    app[RESTART] = lambda: restarts.append(1.0)
    return await aiohttp_client(app), restarts


def _names(tar_bytes: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        return tar.getnames()


def _keygen(tmp_path: Path) -> tuple[Path, str]:
    """An identity file made by `age-keygen`, and its recipient."""
    tmp_path.mkdir(exist_ok=True)
    key = tmp_path / "key.txt"
    subprocess.run(["age-keygen", "-o", str(key)], check=True, capture_output=True, timeout=30)
    recipient = re.search(r"public key: (age1\S+)", key.read_text())
    assert recipient is not None
    return key, recipient.group(1)


async def test_a_backup_sealed_to_a_recipient_opens_with_age_and_is_put_back_with_its_identity(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, tmp_path: Path
) -> None:
    admin, user = _keys(settings)
    client, restarts = await _appliance(aiohttp_client, settings)
    key, recipient = _keygen(tmp_path)
    bad = await client.post(
        "/v1/admin/backup", headers=_bearer(admin), json={"recipients": ["age1nope"]}
    )
    assert bad.status == 400
    assert (await bad.json())["error"]["param"] == "recipients"
    # A body said to be JSON is one, empty or not; no body at all is the plain archive.
    empty = await client.post(
        "/v1/admin/backup",
        headers=_bearer(admin, **{"Content-Type": "application/json"}),
        data=b"",
    )
    assert empty.status == 400
    assert (await empty.json())["error"]["code"] == "invalid_json"

    taken = await client.post(
        "/v1/admin/backup?packages=false",
        headers=_bearer(admin),
        json={"recipients": [recipient, str(x25519.Identity.generate().to_public())]},
    )
    assert taken.status == 200, await taken.text()
    assert taken.headers["Content-Type"] == "application/octet-stream"
    assert re.search(r'filename="kvl-appliance-\d{8}T\d{6}Z\.tar\.age"', taken.headers[
        "Content-Disposition"
    ])  # fmt: skip
    sealed = await taken.read()
    assert sealed.startswith(sealing.AGE_MAGIC)
    assert b"appliance.db" not in sealed  # nothing of it in the clear
    # The age tool opens it, without kvl: the archive `kvl appliance backup` writes.
    (tmp_path / "b.tar.age").write_bytes(sealed)
    opened = await asyncio.to_thread(
        subprocess.run,
        ["age", "-d", "-i", str(key), str(tmp_path / "b.tar.age")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    assert _names(opened.stdout)[:2] == ["manifest.json", "appliance.db"]

    # Refused, nothing staged: no identity, another's, an altered byte, a truncated file,
    # a passphrase for a file sealed to a recipient.
    other, _ = _keygen(tmp_path / "other")
    altered = bytearray(sealed)
    altered[-100] ^= 0x01
    for headers, body in (
        ({}, sealed),
        ({IDENTITY_HEADER: _identity(other)}, sealed),
        ({IDENTITY_HEADER: _identity(key)}, bytes(altered)),
        ({IDENTITY_HEADER: _identity(key)}, sealed[: len(sealed) // 2]),
        ({IDENTITY_HEADER: "AGE-SECRET-KEY-1NOTAKEY"}, sealed),
        ({PASSPHRASE_HEADER: PASSPHRASE}, sealed),
    ):
        refused = await client.post(
            "/v1/admin/restore", headers=_bearer(admin, **headers), data=body
        )
        assert refused.status == 400, (headers.keys(), await refused.text())
        assert (await refused.json())["error"]["code"] == "bad_request"
    assert not (settings.data_dir / appliance_backup.PENDING).exists()
    assert not [p for p in settings.data_dir.iterdir() if p.name.startswith(".kvl-restore-")]
    assert restarts == []
    # A plain archive with a key is a mistake, said so; the user's key is not an admin's.
    plain = opened.stdout
    mistaken = await client.post(
        "/v1/admin/restore", headers=_bearer(admin, **{IDENTITY_HEADER: _identity(key)}), data=plain
    )
    assert mistaken.status == 400
    assert "not sealed" in (await mistaken.json())["error"]["message"]
    forbidden = await client.post(
        "/v1/admin/restore", headers=_bearer(user, **{IDENTITY_HEADER: _identity(key)}), data=sealed
    )
    assert forbidden.status == 403

    staged = await client.post(
        "/v1/admin/restore",
        headers=_bearer(admin, **{IDENTITY_HEADER: _identity(key)}),
        data=sealed,
    )
    assert staged.status == 202, await staged.text()
    assert restarts == [1.0]
    await client.close()
    restored = appliance_backup.apply_pending(settings)
    assert restored is not None
    store = Store(settings.db_path)
    try:
        assert store.authenticate(admin) is not None
    finally:
        store.close()


def _identity(path: Path) -> str:
    return next(line for line in path.read_text().splitlines() if line.startswith("AGE-SECRET"))


async def test_a_backup_sealed_with_a_passphrase_opens_with_age_and_is_put_back_with_it(
    aiohttp_client: AiohttpClient, settings: ApplianceSettings, tmp_path: Path
) -> None:
    admin, _ = _keys(settings)
    client, restarts = await _appliance(aiohttp_client, settings)
    taken = await client.post(
        "/v1/admin/backup", headers=_bearer(admin), json={"passphrase": PASSPHRASE}
    )
    assert taken.status == 200, await taken.text()
    assert taken.headers["Content-Type"] == "application/x-tar"
    assert ".age.tar" in taken.headers["Content-Disposition"]
    sealed = await taken.read()
    assert _names(sealed) == ["identity.age", "backup.tar.age"]

    # The age tool opens it as its docstring says: the one-time key with the passphrase
    # (age asks for it on the terminal), the backup with the key.
    folder = tmp_path / "by-age"
    folder.mkdir()
    with tarfile.open(fileobj=io.BytesIO(sealed)) as tar:
        tar.extractall(folder, filter="data")
    _age_with_passphrase(
        ["age", "-d", "-i", "identity.age", "-o", "backup.tar", "backup.tar.age"], folder
    )
    assert _names((folder / "backup.tar").read_bytes())[0] == "manifest.json"

    for headers in ({}, {PASSPHRASE_HEADER: "not it"}):
        refused = await client.post(
            "/v1/admin/restore", headers=_bearer(admin, **headers), data=sealed
        )
        assert refused.status == 400, await refused.text()
    assert not (settings.data_dir / appliance_backup.PENDING).exists()
    # A passphrase beyond ASCII goes as its UTF-8 bytes (as aiohttp and curl send it).
    staged = await client.post(
        "/v1/admin/restore", headers=_bearer(admin, **{PASSPHRASE_HEADER: PASSPHRASE}), data=sealed
    )
    assert staged.status == 202, await staged.text()
    assert restarts == [1.0]
    await client.close()


def _age_with_passphrase(argv: list[str], cwd: Path) -> None:
    """Run the age tool on a terminal of its own (it reads a passphrase from /dev/tty
    alone), answering its prompt."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.chdir(cwd)
        os.execvp(argv[0], argv)  # noqa: S606 - the age tool, on the terminal's far side
    said = b""
    deadline = time.monotonic() + 60
    answered = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 1024)
            except OSError:  # the child closed the terminal: it ended
                break
            if not chunk:
                break
            said += chunk
            if not answered and b"passphrase" in said.lower():
                os.write(fd, PASSPHRASE.encode() + b"\r")
                answered = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert answered, said
    assert os.waitstatus_to_exitcode(status) == 0, said


def _sealed_with_passphrase(tmp_path: Path) -> tuple[Path, bytes]:
    plain = tmp_path / "plain.tar"
    plain.write_bytes(os.urandom(200_000))
    out = tmp_path / "sealed.age.tar"
    sealing.seal(plain, out, sealing.Sealing(passphrase=PASSPHRASE))
    return out, plain.read_bytes()


def _rewrite(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_passphrase_sealed_file_that_is_wrong_or_hostile_is_refused(tmp_path: Path) -> None:
    sealed, plain = _sealed_with_passphrase(tmp_path)
    out = tmp_path / "out.tar"
    assert sealing.unseal(sealed, out, passphrase=PASSPHRASE) == "passphrase"
    assert out.read_bytes() == plain
    out.unlink()
    with tarfile.open(sealed) as tar:
        identity = tar.extractfile("identity.age").read()  # type: ignore[union-attr]
        payload = tar.extractfile("backup.tar.age").read()  # type: ignore[union-attr]

    # scrypt's work factor is the sealer's choice: one that would take 1 TiB is refused
    # before scrypt runs (it would take the node's memory, or hours).
    greedy = re.sub(rb"(-> scrypt \S+) \d+", rb"\1 33", identity, count=1)
    altered = bytearray(payload)
    altered[len(altered) // 2] ^= 0x01
    x25519_only = sealing.AGE_MAGIC + b"-> X25519 " + base64.b64encode(b"x" * 32) + b"\n"
    for members, expected in (
        ([("identity.age", greedy), ("backup.tar.age", payload)], "work factor of 33"),
        ([("identity.age", identity), ("backup.tar.age", bytes(altered))], "cannot be opened"),
        ([("identity.age", identity), ("backup.tar.age", payload[:-20])], "cannot be opened"),
        ([("identity.age", identity)], "holds no backup.tar.age"),
        ([("identity.age", identity), ("other", payload)], "holds no backup.tar.age"),
        ([("identity.age", b"x" * 5000), ("backup.tar.age", payload)], "not a sealed key"),
        ([("identity.age", x25519_only), ("backup.tar.age", payload)], "not sealed with a pass"),
        ([("identity.age", b"not age"), ("backup.tar.age", payload)], "not an age file"),
    ):
        hostile = tmp_path / "hostile.age.tar"
        _rewrite(hostile, members)
        with pytest.raises(sealing.SealError, match=expected):
            sealing.unseal(hostile, out, passphrase=PASSPHRASE)
        assert not out.exists()
    with pytest.raises(sealing.SealError, match="sealed with a passphrase: give it"):
        sealing.unseal(sealed, out)
    with pytest.raises(sealing.SealError, match="not a sealed backup"):
        sealing.unseal(tmp_path / "plain.tar", out, passphrase=PASSPHRASE)


def test_sealing_refuses_what_is_not_a_recipient_an_identity_or_a_passphrase() -> None:
    with pytest.raises(sealing.SealError, match="one of the two"):
        sealing.Sealing()
    with pytest.raises(sealing.SealError, match="one of the two"):
        sealing.Sealing(("age1x",), "both")
    with pytest.raises(sealing.SealError, match="not an age X25519 recipient"):
        sealing.Sealing(("age1" + "q" * 58,))  # the right shape, a bad checksum
    with pytest.raises(sealing.SealError, match="1 to 1024 bytes"):
        sealing.Sealing(passphrase="x" * 1025)
    with pytest.raises(sealing.SealError, match="UTF-8"):
        sealing.Sealing(passphrase="\ud800")
    assert "hunter2" not in repr(sealing.Sealing(passphrase="hunter2"))
    identity = x25519.Identity.generate()
    text = f"# created: now\n# public key: {identity.to_public()}\n{identity}\n"
    assert sealing.identities(text) == [str(identity)]
    with pytest.raises(sealing.SealError, match="no AGE-SECRET-KEY"):
        sealing.identities("# nothing\n")
    with pytest.raises(sealing.SealError, match="an identity is an AGE-SECRET-KEY"):
        sealing.identities("ssh-ed25519 AAAA")


def test_kvl_seals_a_backup_and_opens_it_to_restore_the_appliance_and_the_hub(
    tmp_path: Path, settings: ApplianceSettings
) -> None:
    """`kvl appliance backup --recipient` / `restore --identity`, and `kvl hub backup
    --passphrase-file` / `restore --passphrase-file -` (the passphrase on standard input)."""
    admin, _ = _keys(settings)
    key, recipient = _keygen(tmp_path / "keys")
    sealed = tmp_path / "appliance.tar.age"
    data = ("--data-dir", str(settings.data_dir))
    kvl("appliance", "backup", str(sealed), "--no-packages", "--recipient", recipient, *data)
    assert sealing.sealed_as(sealed) == "recipients"
    assert sealed.stat().st_mode & 0o777 == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kvl-seal-")]
    elsewhere = make_settings(tmp_path / "elsewhere")
    target = ("--data-dir", str(elsewhere.data_dir))
    refused = kvl("appliance", "restore", str(sealed), *target, check=False)
    assert refused.returncode == 1
    assert "give an identity" in refused.stderr
    kvl("appliance", "restore", str(sealed), "--identity", str(key), *target)
    store = Store(elsewhere.db_path)
    try:
        assert store.authenticate(admin) is not None
    finally:
        store.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kvl-opened-")]

    hub = settings_for(tmp_path / "hub")
    hub_store = open_store(hub)
    try:
        hub_store.accounts.put("acme", "S1")
    finally:
        hub_store.close()
    secret = tmp_path / "passphrase.txt"
    secret.write_text(f"{PASSPHRASE}\n")
    hub_sealed = tmp_path / "hub.age.tar"
    hub_data = ("--data-dir", str(hub.data_dir))
    kvl("hub", "backup", str(hub_sealed), "--passphrase-file", str(secret), *hub_data)
    assert sealing.sealed_as(hub_sealed) == "passphrase"
    restored = settings_for(tmp_path / "hub-restored")
    opened = subprocess.run(
        [sys.executable, "-m", "shared.cli", "hub", "restore", str(hub_sealed),
         "--passphrase-file", "-", "--data-dir", str(restored.data_dir)],
        input=f"{PASSPHRASE}\n", capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip
    assert opened.returncode == 0, opened.stderr
    hub_store = open_store(restored)
    try:
        assert [a["name"] for a in hub_store.accounts.all()] == ["acme"]
    finally:
        hub_store.close()


async def test_an_admin_key_lists_and_downloads_the_backups_the_schedule_keeps(
    aiohttp_client: AiohttpClient, tmp_path: Path, scripted_models: list[Any]
) -> None:
    """A hub-less node's scheduled backups stay on its disk: its admin key lists them (and
    how the schedule goes) and downloads each by its name, nothing else; its heartbeat
    carries the same report (protocol 9)."""
    settings = make_settings(tmp_path / "data", backups={"schedule": "30 2 * * *", "keep": 2})
    store = Store(settings.db_path)
    for record in scripted_models:
        store.add_model(record)
    store.close()
    admin, user = _keys(settings)
    app = create_app(settings)
    client = await aiohttp_client(app)
    listed = await client.get("/v1/admin/backups", headers=_bearer(admin))
    assert listed.status == 200
    body = await listed.json()
    assert body["data"] == []
    assert body["schedule"]["schedule"] == "30 2 * * *"
    assert body["schedule"]["last_good_at"] is None

    made = await app[SCHEDULED].take()
    listed = await client.get("/v1/admin/backups", headers=_bearer(admin))
    (entry,) = (await listed.json())["data"]
    assert entry["id"] == made.path.name
    assert (entry["bytes"], entry["sealed"]) == (made.size, False)
    got = await client.get(f"/v1/admin/backups/{entry['id']}", headers=_bearer(admin))
    assert got.status == 200
    assert await got.read() == made.path.read_bytes()
    for name in ("..%2Fappliance.db", "appliance.db", "kvl-appliance-x.tar"):
        missing = await client.get(f"/v1/admin/backups/{name}", headers=_bearer(admin))
        assert missing.status == 404, name
        assert (await missing.json())["error"]["code"] == "not_found"
    assert (await client.get("/v1/admin/backups", headers=_bearer(user))).status == 403

    capacity = await app[FLEET].capacity()
    assert capacity.backup is not None
    assert capacity.backup.last_good_at == made.created_at
    assert capacity.backup.kept == 1
