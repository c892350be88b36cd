from __future__ import annotations

import struct
from pathlib import Path

import pytest

from appliance.state.records import ModelRecord
from shared.gguf import REPLICA_OVERHEAD_MIB, GGUFError, KvShape, read_gguf, replica_mib


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
    assert info.kv_shape() == KvShape(2 * 2 * 32)
    # Every slot's context and the prefix store's (one less), f16.
    cells = 4 * 1024 + 1023
    assert replica_mib(KvShape(128), 2**20, 1024, 4) == pytest.approx(
        1 + cells * 128 * 2 / 2**20 + REPLICA_OVERHEAD_MIB
    )
    assert replica_mib(KvShape(128), 2**20, 1024, 4, kv_type="q8_0") < replica_mib(
        KvShape(128), 2**20, 1024, 4
    )
    # Sliding layers hold their window for each sequence (the slots and the store) and a
    # batch, padded to 256 cells; the store is shorter than the window.
    sliding = replica_mib(KvShape(0, 128, window=512), 0, 4096, 4) - REPLICA_OVERHEAD_MIB
    assert sliding == pytest.approx(3072 * 128 * 2 / 2**20)
    assert replica_mib(None, 2**20, 4096, 4) == 1 + REPLICA_OVERHEAD_MIB


def test_gemma_3s_sliding_layers_are_five_of_six(default_model: ModelRecord) -> None:
    shape = read_gguf(Path(default_model.path)).kv_shape()
    # 18 layers, one KV head of 256 for K and for V: 3 full, 15 sliding over 512 tokens.
    assert shape == KvShape(3 * 512, 15 * 512, 512)
