from __future__ import annotations

import struct
from pathlib import Path

import pytest

from appliance.serving.gguf import GGUFError, read_gguf
from appliance.state.records import ModelRecord


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf(path: Path, kv: list[tuple[str, int, bytes]]) -> None:
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    body = b"".join(_string(k) + struct.pack("<I", t) + v for k, t, v in kv)
    path.write_bytes(header + body)


def test_reads_a_handmade_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    tokens = struct.pack("<IQ", 8, 2) + _string("a") + _string("bb")
    write_gguf(
        path,
        [
            ("general.architecture", 8, _string("llama")),
            ("general.file_type", 4, struct.pack("<I", 15)),
            ("llama.context_length", 4, struct.pack("<I", 4096)),
            ("tokenizer.ggml.tokens", 9, tokens),
            ("tokenizer.chat_template", 8, _string("{{ x }}")),
        ],
    )
    info = read_gguf(path)
    assert info.architecture == "llama"
    assert info.quantization == "Q4_K_M"
    assert info.context_length == 4096
    assert info.chat_template == "{{ x }}"
    assert info.metadata["tokenizer.ggml.tokens"] == 2
    assert read_gguf(path, skip_arrays=False).metadata["tokenizer.ggml.tokens"] == ["a", "bb"]


@pytest.mark.parametrize(
    "data", [b"", b"GGML" + b"\0" * 20, b"GGUF\x03\0\0\0", b"GGUF" + struct.pack("<IQQ", 3, 0, 5)]
)
def test_bad_files_raise_a_clear_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError):
        read_gguf(path)


def test_the_default_model(default_model: ModelRecord) -> None:
    info = read_gguf(Path(default_model.path))
    assert info.architecture == "gemma3"
    assert info.quantization == "Q4_K_M" == default_model.quantization
    assert info.chat_template is None  # a base model: the family template is used
