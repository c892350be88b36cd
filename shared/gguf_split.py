"""Split GGUF files (`NAME-00001-of-00003.gguf`, as llama.cpp's `llama-gguf-split` writes
them for the Hugging Face Hub's 50 GB file limit) joined into one, as its `--merge` does:
the hub keeps and delivers a model as one file.

Each part is a GGUF of its own. The first holds the model's metadata and `split.count`,
`split.no` (0 for the first) and `split.tensors.count`; each other part holds only the
`split.*` keys; every part holds some of the tensors, their offsets counted from its own
data section. The joined file has the first part's metadata without the `split.*` keys,
every tensor's entry in order with its offset moved by the data of the parts before, and
the parts' data sections one after the other, each padded to the alignment. Nothing is
decoded or copied through memory whole: metadata is copied as the bytes it was, and the
tensors' data in pieces.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from shared.gguf import GGUFError, read_string, read_value

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
MAX_ENTRIES = 1 << 20  # metadata keys or tensors in one part: far above any model's
DEFAULT_ALIGNMENT = 32  # GGUF's, when `general.alignment` is not set
_PIECE = 1 << 20
_MAGIC = b"GGUF"


@dataclass(frozen=True)
class _Part:
    version: int
    metadata: list[tuple[str, bytes]]  # each key with its entry's bytes, in order
    values: dict[str, object]  # the scalar and string values, by key
    tensors: list[tuple[bytes, int]]  # each tensor's entry up to its offset, and the offset
    data_start: int
    size: int

    @property
    def alignment(self) -> int:
        value = self.values.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(value, int) or value <= 0 or value & (value - 1) or value > 1 << 16:
            raise GGUFError(f"general.alignment {value!r} is not a power of two")
        return value


def merge(parts: list[Path], write: Callable[[bytes], object]) -> None:
    """Join the parts of one split GGUF, in order, into one file, written through `write`.
    GGUFError saying why when they are not the parts of one split file."""
    read = [_read(path) for path in parts]
    first = read[0]
    count = first.values.get("split.count")
    if count != len(parts):
        raise GGUFError(f"the first part says split.count {count!r}, not {len(parts)} parts")
    alignment = first.alignment
    for number, part in enumerate(read):
        if part.values.get("split.no") != number or part.values.get("split.count") != count:
            raise GGUFError(f"part {number + 1} is not part {number + 1} of {count}")
        if part.version != first.version or part.alignment != alignment:
            raise GGUFError(f"part {number + 1} is of another GGUF version or alignment")
    total = sum(len(p.tensors) for p in read)
    if first.values.get("split.tensors.count") != total:
        raise GGUFError(
            f"the first part says split.tensors.count "
            f"{first.values.get('split.tensors.count')!r}; the parts hold {total} tensors"
        )
    kept = [entry for key, entry in first.metadata if key not in SPLIT_KEYS]
    head = [_MAGIC, struct.pack("<IQQ", first.version, total, len(kept)), *kept]
    base = 0
    for part in read:
        data = part.size - part.data_start
        for entry, offset in part.tensors:
            if offset % alignment or offset >= max(data, 1):
                raise GGUFError("a tensor's offset lies outside its part's data")
            head += [entry, struct.pack("<Q", base + offset)]
        base += _padded(data, alignment)
    header = b"".join(head)
    write(header + bytes(_padded(len(header), alignment) - len(header)))
    for path, part in zip(parts, read, strict=True):
        with path.open("rb") as f:
            f.seek(part.data_start)
            left = part.size - part.data_start
            while left:
                piece = f.read(min(_PIECE, left))
                if not piece:
                    raise GGUFError(f"{path.name} ended before its data did")
                write(piece)
                left -= len(piece)
        data = part.size - part.data_start
        write(bytes(_padded(data, alignment) - data))


def _read(path: Path) -> _Part:
    try:
        with path.open("rb") as f:
            return _layout(f, os.fstat(f.fileno()).st_size, path.name)
    except (struct.error, UnicodeDecodeError) as err:
        raise GGUFError(f"{path.name}: truncated or corrupt GGUF header") from err


def _layout(f: IO[bytes], size: int, name: str) -> _Part:
    if f.read(4) != _MAGIC:
        raise GGUFError(f"{name} is not a GGUF file (bad magic)")
    (version,) = struct.unpack("<I", f.read(4))
    n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
    if version < 2 or n_tensors > MAX_ENTRIES or n_kv > MAX_ENTRIES:
        raise GGUFError(f"{name}: a GGUF header this hub does not read")
    metadata: list[tuple[str, bytes]] = []
    values: dict[str, object] = {}
    for _ in range(n_kv):
        start = f.tell()
        key = read_string(f)
        (vtype,) = struct.unpack("<I", f.read(4))
        value = read_value(f, vtype, skip_arrays=True)
        end = f.tell()
        if vtype != 9:  # arrays are read past
            values[key] = value
        f.seek(start)
        metadata.append((key, f.read(end - start)))
    tensors: list[tuple[bytes, int]] = []
    for _ in range(n_tensors):
        start = f.tell()
        read_string(f)
        (n_dims,) = struct.unpack("<I", f.read(4))
        if n_dims > 8:
            raise GGUFError(f"{name}: a tensor of more than 8 dimensions")
        f.seek(8 * n_dims + 4, 1)  # the dimensions and the type
        end = f.tell()
        (offset,) = struct.unpack("<Q", f.read(8))
        f.seek(start)
        tensors.append((f.read(end - start), offset))
        f.seek(8, 1)
    part = _Part(version, metadata, values, tensors, 0, size)
    data_start = _padded(f.tell(), part.alignment)
    if data_start > size:
        raise GGUFError(f"{name} ends inside its header")
    return _Part(version, metadata, values, tensors, data_start, size)


def _padded(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment
