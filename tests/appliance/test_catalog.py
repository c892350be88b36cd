from __future__ import annotations

import io
from pathlib import Path

import pytest

from appliance.serving.catalog import (
    DEFAULT_MODEL_NAME,
    ModelFileError,
    ensure_default_model,
    register_gguf,
    verify,
)
from appliance.serving.chat import GEMMA_TEMPLATE, ChatTemplateError, select_template
from appliance.serving.progress import ProgressBar
from appliance.state.store import ConflictError, ModelRecord, Store


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
    record = register_gguf(store, Path(default_model.path), "mine", "2026.1")
    assert record.sha256 == default_model.sha256
    assert record.quantization == "Q4_K_M"
    with pytest.raises(ConflictError):
        register_gguf(store, Path(default_model.path), "mine", "2026.1")
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"hello")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        register_gguf(store, not_gguf, "x", "1")


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
