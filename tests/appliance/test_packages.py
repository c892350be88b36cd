"""Content packages end to end: a package asked for, generated, validated, narrated,
cached, served (ETag, Range, digests) and exported; the same request again is a cache hit;
a corrupted blob is never served. The items come from a scripted model that answers each
item type's request with a valid item (the packages are the subject); the job path makes
its package on the real model, the one check that the real model can make a package."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
import zipfile
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree as ET

import pytest

from appliance.app import create_app
from appliance.gateway.appkeys import REGISTRY
from appliance.gateway.packages import PACKAGES
from appliance.packages.voice import Espeak
from appliance.state.store import Store
from tests.conftest import make_settings
from tests.gateway import auth
from tests.packages import package_model

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from appliance.state.records import ModelRecord
    from tests.conftest import Client

pytestmark = pytest.mark.skipif(not Espeak.available(), reason="espeak-ng: run `just setup`")

ASK = {
    "topic": "The Solar System",
    "level": "beginner",
    "spec": {"items": 3, "item_types": ["single_choice", "true_false", "short_answer"],
             "narration": True},
}  # fmt: skip


async def _client(
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    record: ModelRecord,
    **packages: Any,
) -> tuple[Client, str, Any]:
    settings = make_settings(
        tmp_path / "data",
        model={"default": record.name, "chat_default": record.name},
        embeddings={"enabled": False},
        packages={"max_attempts": 5, **packages},
    )
    store = Store(settings.db_path)
    store.add_model(record)
    key = store.create_key("teacher").plaintext
    store.close()
    app = create_app(settings)
    client: Client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    return client, key, app


async def test_a_package_is_generated_validated_cached_served_and_exported(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    model = package_model(tmp_path)
    client, key, app = await _client(aiohttp_client, tmp_path, model)
    response = await client.post("/v1/packages", headers=auth(key), json={**ASK, "wait": True})
    package = await response.json()
    assert response.status == 200, package
    manifest = package["manifest"]
    assert manifest["validation"]["passed"] is True
    assert all(c["passed"] for c in manifest["validation"]["checks"])
    assert [i["type"] for i in manifest["items"]] == ["single_choice", "true_false", "short_answer"]
    assert manifest["lineage"]["model"]["sha256"] == model.sha256
    assert manifest["lineage"]["voice"]["engine"] == "espeak-ng"
    paths = {f["path"] for f in manifest["files"]}
    assert {"items.json", "cover.svg", "audio/intro.wav"} <= paths
    assert {f"audio/{i['id']}.wav" for i in manifest["items"]} <= paths

    # Every file is served as the manifest describes it.
    base = f"/v1/packages/{package['id']}"
    for entry in manifest["files"]:
        got = await client.get(f"{base}/files/{entry['path']}", headers=auth(key))
        data = await got.read()
        assert got.status == 200
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (entry["sha256"], entry["size"])
        assert got.headers["Content-Type"].startswith(entry["media_type"])
    audio = next(f for f in manifest["files"] if f["path"] == "audio/intro.wav")
    ranged = await client.get(
        f"{base}/files/audio/intro.wav", headers={**auth(key), "Range": "bytes=10-99"}
    )
    assert ranged.status == 206
    assert len(await ranged.read()) == 90
    assert ranged.headers["Content-Range"] == f"bytes 10-99/{audio['size']}"

    # The manifest has an ETag; asked again with it, nothing is sent.
    fetched = await client.get(base, headers=auth(key))
    etag = fetched.headers["ETag"]
    again = await client.get(base, headers={**auth(key), "If-None-Match": etag})
    assert again.status == 304

    # The same request, worded with other case and spaces: a cache hit, at once.
    started = time.monotonic()
    hit = await client.post(
        "/v1/packages",
        headers=auth(key),
        json={**ASK, "topic": "  the   solar SYSTEM ", "wait": True},
    )
    assert hit.status == 200
    assert ((await hit.json())["id"], (await hit.json())["version"]) == (
        package["id"], package["version"])  # fmt: skip
    assert time.monotonic() - started < 2
    listed = await (await client.get("/v1/packages?q=solar", headers=auth(key))).json()
    assert [p["id"] for p in listed["data"]] == [package["id"]]

    # Exports an LMS imports.
    h5p = await client.get(f"{base}/exports/h5p", headers=auth(key))
    assert h5p.status == 200
    with zipfile.ZipFile(io.BytesIO(await h5p.read())) as archive:
        meta = json.loads(archive.read("h5p.json"))
        assert meta["mainLibrary"] == "H5P.QuestionSet"
        content = json.loads(archive.read("content/content.json"))
        assert len(content["questions"]) == 3
    moodle = await client.get(f"{base}/exports/moodle-xml", headers=auth(key))
    questions = ET.fromstring(await moodle.read()).findall("question")  # noqa: S314 - ours
    # the introduction's narration first (a description question), then the items, each
    # with its own
    assert [q.get("type") for q in questions] == [
        "category", "description", "multichoice", "truefalse", "shortanswer"]  # fmt: skip
    assert [len(q.findall("questiontext/file")) for q in questions] == [0, 1, 1, 1, 1]
    unknown = await client.get(f"{base}/exports/scorm", headers=auth(key))
    assert (await unknown.json())["error"]["param"] == "format"

    # A blob damaged on disk is detected by its digest and never served.
    cache = app[PACKAGES].cache
    _, blob = cache.open_file(package["id"], None, "items.json")
    blob.write_bytes(b"[]")
    damaged = await client.get(f"{base}/files/items.json", headers=auth(key))
    assert damaged.status == 503
    assert (await damaged.json())["error"]["code"] == "package_corrupt"
    missing = await client.get("/v1/packages/pkg_nope", headers=auth(key))
    assert (await missing.json())["error"]["code"] == "package_not_found"


@pytest.mark.model
async def test_a_package_job_ends_with_the_package(
    aiohttp_client: AiohttpClient, tmp_path: Path, default_model: ModelRecord
) -> None:
    client, key, _ = await _client(aiohttp_client, tmp_path, default_model)
    ask = {**ASK, "spec": {"items": 2, "item_types": ["true_false"], "narration": False}}
    created = await client.post("/v1/packages", headers=auth(key), json=ask)
    job = await created.json()
    assert created.status == 202, job
    for _ in range(600):
        job = await (await client.get(f"/v1/jobs/{job['id']}", headers=auth(key))).json()
        if job["status"] in {"completed", "failed"}:
            break
        await asyncio.sleep(0.2)
    assert job["status"] == "completed", job
    results = await (await client.get(f"/v1/jobs/{job['id']}/results", headers=auth(key))).json()
    [result] = results["data"]
    assert result["status_code"] == 200
    package = result["body"]
    assert package["manifest"]["validation"]["passed"] is True
    assert not any(f["path"].startswith("audio/") for f in package["manifest"]["files"])


async def test_a_package_narrated_by_the_neural_voice(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    model = package_model(tmp_path)
    client, key, _ = await _client(aiohttp_client, tmp_path, model, voice="neural")
    ask = {"topic": "Bees", "level": "beginner", "wait": True,
           "spec": {"items": 1, "item_types": ["true_false"], "narration": True}}  # fmt: skip
    response = await client.post("/v1/packages", headers=auth(key), json=ask)
    english = await response.json()
    assert response.status == 200, english
    voice = english["manifest"]["lineage"]["voice"]
    assert (voice["engine"], voice["voice"]) == ("onnx-vits", "en_US-joe")
    audio = next(f for f in english["manifest"]["files"] if f["path"] == "audio/intro.wav")
    url = f"/v1/packages/{english['id']}/files/audio/intro.wav"
    wav = await (await client.get(url, headers=auth(key))).read()
    assert hashlib.sha256(wav).hexdigest() == audio["sha256"]
    assert wav[22:24] == (1).to_bytes(2, "little")  # mono
    assert int.from_bytes(wav[24:28], "little") == 22050  # the voice's rate, not espeak's
