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


# What a worker holds beyond weights and KV cache: Python, llama.cpp's compute buffers, the
# gateway-side vocabulary (measured on the embedded models: tests/appliance/test_fit.py).
REPLICA_OVERHEAD_MIB = 400.0
# Bytes a KV cache element takes, by the cache's type (q8_0 and q4_0 blocks with their scales).
KV_ELEMENT_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# A node's model defaults (the appliance's `model.n_ctx` and `model.n_slots`): what a
# replica is sized for unless its deployment says otherwise.
DEFAULT_N_CTX = 4096
DEFAULT_N_SLOTS = 4


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

    def _number(self, key: str, default: int) -> int:
        value = self.metadata.get(f"{self.architecture}.{key}")
        return value if isinstance(value, int) else default

    def kv_elements_per_token(self) -> int:
        """K and V elements one token's cache cell holds across the layers (0 when the
        metadata does not say)."""
        layers = self._number("block_count", 0)
        heads = self._number("attention.head_count", 1)
        kv_heads = self._number("attention.head_count_kv", heads)
        head_dim = self._number("embedding_length", 0) // max(heads, 1)
        key = self._number("attention.key_length", head_dim)
        value = self._number("attention.value_length", head_dim)
        return layers * kv_heads * (key + value)


def cache_cells(n_ctx: int, n_slots: int, *, prefix_store: bool = True) -> int:
    """Tokens a worker's KV cache holds: every slot's context, and the shared-prefix store's."""
    return n_ctx * n_slots + (n_ctx if prefix_store else 0)


def replica_mib(
    kv_elements_per_token: int | None, size_bytes: int, cells: int, kv_type: str = "f16"
) -> float:
    """What one replica holds resident, at most: its weights (the file), a KV cache of
    `cells` tokens at `kv_type` (`kv_elements_per_token`: GGUFInfo's; None when the file
    says nothing of it), and :data:`REPLICA_OVERHEAD_MIB`."""
    kv = cells * (kv_elements_per_token or 0) * KV_ELEMENT_BYTES[kv_type]
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
                key = _read_string(f)
                (vtype,) = _unpack(f, "<I")
                metadata[key] = _read_value(f, vtype, skip_arrays)
            parameters = sum(_tensor_elements(f) for _ in range(n_tensors))
            return GGUFInfo(version=version, metadata=metadata, parameters=parameters or None)
    except (struct.error, UnicodeDecodeError) as err:
        raise GGUFError(f"{path}: truncated or corrupt GGUF header") from err


def _tensor_elements(f: IO[bytes]) -> int:
    """One tensor's entry read (name, dimensions, type, offset): its element count."""
    _read_string(f)
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


def _read_string(f: IO[bytes]) -> str:
    (length,) = _unpack(f, "<Q")
    if length > 1 << 30:
        raise struct.error("string length out of range")
    data = f.read(length)
    if len(data) != length:
        raise struct.error("unexpected end of file")
    return data.decode("utf-8")


def _read_value(f: IO[bytes], vtype: int, skip_arrays: bool) -> Any:
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])[0]
    if vtype == _STRING:
        return _read_string(f)
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
        return [_read_value(f, item_type, skip_arrays) for _ in range(count)]
    raise struct.error(f"unknown GGUF value type {vtype}")
