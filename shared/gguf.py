"""A small reader for GGUF headers (metadata and the tensors' shapes), so a model can be
registered, inspected and fitted without loading it; and the estimate of what one replica of
it holds in memory, which the appliance's budget and the hub's placement both count."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

_MAGIC = b"GGUF"
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9

# llama.cpp's `llama_ftype` values, as written to `general.file_type`.
FILE_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}


class GGUFError(ValueError):
    """The file is not a readable GGUF model."""


# What a worker holds beyond weights and KV cache: Python and llama.cpp's compute buffers
# (62 and 91 MiB for the embedded models at the defaults: tests/appliance/test_fit.py).
REPLICA_OVERHEAD_MIB = 100.0
# Bytes a KV cache element takes, by the cache's type (q8_0 and q4_0 blocks with their scales).
KV_ELEMENT_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# A node's model defaults (the appliance's `model.n_ctx` and `model.n_slots`): what a
# replica is sized for unless its deployment says otherwise.
DEFAULT_N_CTX = 4096
DEFAULT_N_SLOTS = 4
DEFAULT_N_BATCH = 512


@dataclass(frozen=True)
class GGUFInfo:
    version: int
    metadata: dict[str, Any]
    parameters: int | None = None  # elements of every tensor (None: not read)

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    @property
    def quantization(self) -> str | None:
        value = self.metadata.get("general.file_type")
        return FILE_TYPES.get(value) if isinstance(value, int) else None

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def context_length(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.context_length")
        return value if isinstance(value, int) else None

    @property
    def block_count(self) -> int:
        """The model's repeating layers (0 when the metadata does not say)."""
        return self._number("block_count", 0)

    def _number(self, key: str, default: int) -> int:
        value = self.metadata.get(f"{self.architecture}.{key}")
        return value if isinstance(value, int) else default

    def kv_shape(self) -> KvShape:
        """What one token's KV cache cell holds, across full-attention and sliding-window
        layers (all zero when the metadata does not say)."""
        layers = self._number("block_count", 0)
        heads = self._number("attention.head_count", 1)
        kv_heads = self._number("attention.head_count_kv", heads)
        head_dim = self._number("embedding_length", 0) // max(heads, 1)
        key = self._number("attention.key_length", head_dim)
        value = self._number("attention.value_length", head_dim)
        window = self._number("attention.sliding_window", 0)
        # Which layers slide is llama.cpp's knowledge of the architecture, not the file's: of
        # every `pattern` layers, all but the last (Gemma 3: five of six).
        pattern = _SWA_PATTERNS.get(self.architecture or "", 0) if window > 0 else 0
        sliding = sum(1 for i in range(layers) if i % pattern < pattern - 1) if pattern else 0
        per_layer = kv_heads * (key + value)
        return KvShape(
            (layers - sliding) * per_layer, sliding * per_layer, window if sliding else 0
        )


# llama.cpp's sliding-window layer patterns (`set_swa_pattern`) of the architectures whose
# GGUF names a window; one not named here is counted at full size (an upper bound).
_SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "gpt-oss": 2}


@dataclass(frozen=True)
class KvShape:
    """K and V elements per token: over the full-attention layers, over the sliding-window
    ones, and their window (0: none)."""

    full: int
    sliding: int = 0
    window: int = 0


def replica_mib(
    shape: KvShape | None,
    size_bytes: int,
    n_ctx: int = DEFAULT_N_CTX,
    n_slots: int = DEFAULT_N_SLOTS,
    *,
    n_batch: int = DEFAULT_N_BATCH,
    kv_type: str = "f16",
) -> float:
    """What one replica's worker holds resident: its weights (the file), its KV cache as the
    appliance sizes it (appliance/serving/batching.py: every slot's context and the
    shared-prefix store, unified; sliding-window layers only their window for each sequence
    and a batch, as llama.cpp sizes them) at `kv_type`, and :data:`REPLICA_OVERHEAD_MIB`.
    Without a shape (a file that says nothing of its layers), the weights and the overhead."""
    kv = 0.0
    if shape is not None:
        store = min(n_ctx - 1, shape.window - 1) if shape.window > 0 else n_ctx - 1
        cells = n_ctx * n_slots + store
        window_cells = 0
        if shape.window > 0:  # llama.cpp: n_swa per sequence plus a ubatch, padded to 256
            window_cells = min(cells, -(-(shape.window * (n_slots + 1) + n_batch) // 256) * 256)
        kv = (cells * shape.full + window_cells * shape.sliding) * KV_ELEMENT_BYTES[kv_type]
    return (size_bytes + kv) / 2**20 + REPLICA_OVERHEAD_MIB


def read_gguf(path: Path, *, skip_arrays: bool = True) -> GGUFInfo:
    """Read the header and metadata of a GGUF file.

    With ``skip_arrays`` (the default) array values (the tokenizer's vocabulary) are read
    past and stored as their length only.
    """
    try:
        with path.open("rb") as f:
            if f.read(4) != _MAGIC:
                raise GGUFError(f"{path} is not a GGUF file (bad magic)")
            (version,) = _unpack(f, "<I")
            if version < 2:
                raise GGUFError(f"{path}: GGUF version {version} is too old")
            n_tensors, n_kv = _unpack(f, "<QQ")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = read_string(f)
                (vtype,) = _unpack(f, "<I")
                metadata[key] = read_value(f, vtype, skip_arrays)
            parameters = sum(_tensor_elements(f) for _ in range(n_tensors))
            return GGUFInfo(version=version, metadata=metadata, parameters=parameters or None)
    except (struct.error, UnicodeDecodeError) as err:
        raise GGUFError(f"{path}: truncated or corrupt GGUF header") from err


def _tensor_elements(f: IO[bytes]) -> int:
    """One tensor's entry read (name, dimensions, type, offset): its element count."""
    read_string(f)
    (n_dims,) = _unpack(f, "<I")
    if n_dims > 8:  # ggml's GGML_MAX_DIMS is 4
        raise struct.error("a tensor of more than 8 dimensions")
    elements: int = math.prod(_unpack(f, f"<{n_dims}Q"))
    _unpack(f, "<IQ")
    return elements


def _unpack(f: IO[bytes], fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise struct.error("unexpected end of file")
    return struct.unpack(fmt, data)


def read_string(f: IO[bytes]) -> str:
    (length,) = _unpack(f, "<Q")
    if length > 1 << 30:
        raise struct.error("string length out of range")
    data = f.read(length)
    if len(data) != length:
        raise struct.error("unexpected end of file")
    return data.decode("utf-8")


def read_value(f: IO[bytes], vtype: int, skip_arrays: bool) -> Any:
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])[0]
    if vtype == _STRING:
        return read_string(f)
    if vtype == _ARRAY:
        (item_type,), (count,) = _unpack(f, "<I"), _unpack(f, "<Q")
        if skip_arrays and item_type in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[item_type]) * count, 1)
            return count
        if skip_arrays and item_type == _STRING:
            for _ in range(count):
                (length,) = _unpack(f, "<Q")
                f.seek(length, 1)
            return count
        return [read_value(f, item_type, skip_arrays) for _ in range(count)]
    raise struct.error(f"unknown GGUF value type {vtype}")
