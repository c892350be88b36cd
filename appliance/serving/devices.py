"""The compute devices llama.cpp sees (CPU, CUDA GPUs…), through ggml's backend registry.

llama-cpp-python does not bind ggml's device API, so this reads it with ctypes from the
``libggml`` that llama-cpp-python ships. A CUDA build lists each GPU with its memory; a
CPU build lists the CPU only. Called in the model worker after it loaded the model, where
the backends are initialised.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# enum ggml_backend_dev_type
_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


@dataclass(frozen=True)
class Device:
    name: str  # ggml's backend device name: CPU, CUDA0, …
    description: str  # the hardware: a CPU model, "NVIDIA H200", …
    kind: str  # cpu, gpu, igpu, accel
    memory_total_mib: int
    memory_free_mib: int


@dataclass(frozen=True)
class DeviceLayout:
    """Where a model's layers run."""

    gpu_offload: bool  # llama.cpp was built with a GPU backend
    n_gpu_layers: int  # as configured; -1 means all layers
    devices: tuple[Device, ...]

    @property
    def device(self) -> str:
        """One word for the model's main device: ``cuda``-style GPU name or ``cpu``."""
        gpus = [d for d in self.devices if d.kind in {"gpu", "igpu"}]
        if self.gpu_offload and self.n_gpu_layers != 0 and gpus:
            return gpus[0].name.lower()
        return "cpu"

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "gpu_offload": self.gpu_offload,
            "n_gpu_layers": self.n_gpu_layers,
            "devices": [asdict(d) for d in self.devices],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceLayout:
        return cls(
            gpu_offload=bool(data["gpu_offload"]),
            n_gpu_layers=int(data["n_gpu_layers"]),
            devices=tuple(Device(**d) for d in data["devices"]),
        )


def _ggml() -> ctypes.CDLL:
    import llama_cpp  # noqa: PLC0415 - heavy; only the worker needs it

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml.so"))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    return lib


def devices() -> tuple[Device, ...]:
    """Every device ggml registered; empty if the library cannot be read."""
    try:
        lib = _ggml()
    except (OSError, AttributeError) as err:
        log.warning("cannot list ggml devices: %s", err)
        return ()
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(
            Device(
                name=(lib.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
                description=(lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                kind=_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
                memory_total_mib=total.value >> 20,
                memory_free_mib=free.value >> 20,
            )
        )
    return tuple(found)


def layout(n_gpu_layers: int) -> DeviceLayout:
    """Where this process puts a model's layers: on the GPUs llama.cpp sees, or the CPU."""
    import llama_cpp  # noqa: PLC0415

    return DeviceLayout(bool(llama_cpp.llama_supports_gpu_offload()), n_gpu_layers, devices())
