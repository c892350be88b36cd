from __future__ import annotations

import struct
from pathlib import Path

import pytest

from appliance.state.records import ModelRecord
from shared.gguf import REPLICA_OVERHEAD_MIB, GGUFError, cache_cells, read_gguf, replica_mib


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


def test_the_tensors_shapes_count_the_parameters_and_the_cache_is_sized(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    kv = [
        ("general.architecture", 8, _string("llama")),
        ("llama.block_count", 4, struct.pack("<I", 2)),
        ("llama.embedding_length", 4, struct.pack("<I", 64)),
        ("llama.attention.head_count", 4, struct.pack("<I", 4)),
        ("llama.attention.head_count_kv", 4, struct.pack("<I", 2)),
    ]
    tensors = [("a", [64, 32]), ("b", [64]), ("c", [2, 3, 4])]
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    body = b"".join(_string(k) + struct.pack("<I", t) + v for k, t, v in kv)
    infos = b"".join(
        _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", 0, 0)
        for name, dims in tensors
    )  # fmt: skip
    path.write_bytes(header + body + infos)
    info = read_gguf(path)
    assert info.parameters == 64 * 32 + 64 + 24
    # 2 layers, 2 KV heads, each 16 wide for K and for V (a head is 64 / 4 wide).
    assert info.kv_elements_per_token() == 2 * 2 * 32
    assert replica_mib(128, 2**20, cells=1024) == 1 + 1024 * 128 * 2 / 2**20 + REPLICA_OVERHEAD_MIB
    assert replica_mib(128, 2**20, 1024, "q8_0") < replica_mib(128, 2**20, 1024)
    assert cache_cells(4096, 4) == 5 * 4096
    assert cache_cells(4096, 4, prefix_store=False) == 4 * 4096
