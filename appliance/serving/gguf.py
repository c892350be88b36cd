"""A small reader for GGUF metadata, so models can be registered without loading them."""

from __future__ import annotations

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


@dataclass(frozen=True)
class GGUFInfo:
    version: int
    metadata: dict[str, Any]

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
            _n_tensors, n_kv = _unpack(f, "<QQ")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = _read_string(f)
                (vtype,) = _unpack(f, "<I")
                metadata[key] = _read_value(f, vtype, skip_arrays)
            return GGUFInfo(version=version, metadata=metadata)
    except (struct.error, UnicodeDecodeError) as err:
        raise GGUFError(f"{path}: truncated or corrupt GGUF header") from err


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
