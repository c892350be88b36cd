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
    n_gpu_layers: int  # as loaded; -1 means all layers
    devices: tuple[Device, ...]
    # As configured (`model.n_gpu_layers`), where the GPU's free memory held fewer: the
    # model then runs its first `n_gpu_layers` on the GPU and the rest on the CPU.
    n_gpu_layers_asked: int | None = None

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
            "n_gpu_layers_asked": self.n_gpu_layers_asked,
            "devices": [asdict(d) for d in self.devices],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceLayout:
        return cls(
            gpu_offload=bool(data["gpu_offload"]),
            n_gpu_layers=int(data["n_gpu_layers"]),
            devices=tuple(Device(**d) for d in data["devices"]),
            n_gpu_layers_asked=(
                None if data.get("n_gpu_layers_asked") is None else int(data["n_gpu_layers_asked"])
            ),
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


def layout(n_gpu_layers: int, asked: int | None = None) -> DeviceLayout:
    """Where this process puts a model's layers: on the GPUs llama.cpp sees, or the CPU
    (`asked`: the layers configured, where fewer fit)."""
    import llama_cpp  # noqa: PLC0415

    offload = bool(llama_cpp.llama_supports_gpu_offload())
    return DeviceLayout(offload, n_gpu_layers, devices(), None if asked == n_gpu_layers else asked)


# Left free on the GPU for what llama.cpp allocates besides the layers: its compute
# buffers (the logits of a batch, the attention's scratch) and the CUDA context.
GPU_RESERVE_MIB = 512.0


def gpu_layers(asked: int, n_layer: int, need_mib: float, free_mib: float) -> int:
    """The layers to put on the GPU: `asked` (-1: all) where its free memory holds them
    with GPU_RESERVE_MIB to spare, else as many as it holds (0: none, the model on the
    CPU), so that a model too large for the GPU loads partly offloaded instead of failing.
    `need_mib`: the model's weights and KV cache at its context and slots, which llama.cpp
    spreads over its `n_layer` blocks about evenly."""
    if asked == 0 or n_layer <= 0 or need_mib <= 0:
        return asked
    want = n_layer if asked < 0 else min(asked, n_layer)
    fits = int(max(0.0, free_mib - GPU_RESERVE_MIB) // (need_mib / n_layer))
    return asked if fits >= want else fits
