"""Split GGUF files joined into one (shared/gguf_split.py), on the embedded chat model: the
parts (split here as llama.cpp's `llama-gguf-split` splits, and loaded by llama.cpp itself
to show they are what it reads) join into the very bytes of the whole file; parts out of
order, missing, of another file or cut short are refused, saying why."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import llama_cpp
import pytest

from appliance.serving.catalog import CHAT_MODEL_NAME, EMBEDDED
from shared.gguf import GGUFError, read_gguf
from shared.gguf_split import merge
from tests.hfhub import split_gguf, tiny_gguf

if TYPE_CHECKING:
    from pathlib import Path


def _write(folder: Path, parts: list[bytes], stem: str = "smol") -> list[Path]:
    paths = []
    for number, data in enumerate(parts, 1):
        path = folder / f"{stem}-{number:05d}-of-{len(parts):05d}.gguf"
        path.write_bytes(data)
        paths.append(path)
    return paths


def _joined(paths: list[Path]) -> bytes:
    pieces: list[bytes] = []
    merge(paths, pieces.append)
    return b"".join(pieces)


def _parameters(path: Path) -> int:
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp did not load {path.name}"
    try:
        return int(llama_cpp.llama_model_n_params(model))
    finally:
        llama_cpp.llama_model_free(model)


def test_the_parts_join_into_the_whole_file(tmp_path: Path) -> None:
    whole = EMBEDDED[CHAT_MODEL_NAME].sources()[0]
    data = whole.read_bytes()
    paths = _write(tmp_path, split_gguf(data, 3))
    assert {read_gguf(p).metadata["split.count"] for p in paths} == {3}
    # llama.cpp reads the parts as a split model (given the first, it finds the others).
    assert _parameters(paths[0]) == _parameters(whole) == 134_515_008
    joined = _joined(paths)
    assert hashlib.sha256(joined).hexdigest() == hashlib.sha256(data).hexdigest()


def test_parts_that_are_not_one_files_are_refused(tmp_path: Path) -> None:
    data = EMBEDDED[CHAT_MODEL_NAME].sources()[0].read_bytes()
    parts = split_gguf(data, 3)
    paths = _write(tmp_path, parts)
    with pytest.raises(GGUFError, match=r"split\.count 3, not 2 parts"):
        _joined(paths[:2])
    with pytest.raises(GGUFError, match="part 2 is not part 2 of 3"):
        _joined([paths[0], paths[2], paths[1]])
    other = _write(tmp_path, split_gguf(data, 2), stem="other")
    with pytest.raises(GGUFError, match="not part 2 of 3"):
        _joined([paths[0], other[1], paths[2]])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(parts[1][:40])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        _joined([paths[0], cut, paths[2]])
    short = tmp_path / "short.gguf"
    short.write_bytes(parts[1][: len(parts[1]) // 2])  # the header whole, the data cut
    with pytest.raises(GGUFError, match="offset lies outside"):
        _joined([paths[0], short, paths[2]])
    plain = tmp_path / "plain.gguf"
    plain.write_bytes(tiny_gguf("plain", 4096))
    with pytest.raises(GGUFError, match=r"split\.count None"):
        _joined([plain])
