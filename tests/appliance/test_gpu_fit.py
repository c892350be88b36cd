"""A model larger than its GPU's free memory loads partly offloaded instead of failing:
the worker puts as many of its layers on the GPU as the GPU holds with their KV cache
(appliance/serving/devices.py `gpu_layers`), and says so in its layout (/readyz). The
arithmetic is checked here on CPU; the GPU run measures it."""

from __future__ import annotations

from appliance.serving.devices import GPU_RESERVE_MIB, Device, DeviceLayout, gpu_layers
from shared.gguf import REPLICA_OVERHEAD_MIB, GGUFInfo, replica_mib

# A Llama 3.1 8B as its GGUF says it (Q4_K_M: 4.58 GiB): 32 layers, 32 heads of 128, 8 of
# them for K and V.
LLAMA_8B = GGUFInfo(
    version=3,
    metadata={
        "general.architecture": "llama",
        "llama.block_count": 32,
        "llama.embedding_length": 4096,
        "llama.attention.head_count": 32,
        "llama.attention.head_count_kv": 8,
    },
    parameters=8_030_261_248,
)
LLAMA_8B_BYTES = 4_920_739_232


def _need(n_ctx: int, n_slots: int) -> float:
    total = replica_mib(LLAMA_8B.kv_shape(), LLAMA_8B_BYTES, n_ctx, n_slots)
    return total - REPLICA_OVERHEAD_MIB


def test_a_model_that_fits_gets_every_layer_asked() -> None:
    # 4.58 GiB of weights, 2.5 GiB of KV cache (four slots of 4,096 and the prefix store)
    need = _need(4096, 4)
    assert 7_000 < need < 7_500
    assert gpu_layers(-1, 32, need, free_mib=24_000) == -1
    assert gpu_layers(20, 32, need, free_mib=24_000) == 20
    assert gpu_layers(0, 32, need, free_mib=24_000) == 0  # CPU asked: CPU


def test_a_model_larger_than_the_gpu_gets_the_layers_that_fit() -> None:
    need = _need(4096, 4)
    per_layer = need / 32
    chosen = gpu_layers(-1, 32, need, free_mib=4_096)
    assert chosen == int((4_096 - GPU_RESERVE_MIB) // per_layer)
    assert 0 < chosen < 32
    # What was chosen fits, with the reserve; one more would not.
    assert (
        chosen * per_layer + GPU_RESERVE_MIB <= 4_096 < (chosen + 1) * per_layer + GPU_RESERVE_MIB
    )
    # Fewer asked than fit: as asked. More asked than fit: what fits.
    assert gpu_layers(8, 32, need, free_mib=4_096) == 8
    assert gpu_layers(30, 32, need, free_mib=4_096) == chosen
    # A longer context leaves room for fewer layers; a GPU without room for the reserve
    # takes none (the model runs on the CPU).
    assert gpu_layers(-1, 32, _need(16_384, 4), free_mib=4_096) < chosen
    assert gpu_layers(-1, 32, need, free_mib=400) == 0


def test_the_layout_says_what_was_asked_where_fewer_layers_fit() -> None:
    gpu = Device("CUDA0", "NVIDIA L4", "gpu", memory_total_mib=23_034, memory_free_mib=4_096)
    cpu = Device("CPU", "Intel Xeon", "cpu", memory_total_mib=64_000, memory_free_mib=60_000)
    partly = DeviceLayout(
        gpu_offload=True, n_gpu_layers=13, devices=(gpu, cpu), n_gpu_layers_asked=-1
    )
    shown = partly.to_json()
    assert shown["device"] == "cuda0"
    assert (shown["n_gpu_layers"], shown["n_gpu_layers_asked"]) == (13, -1)
    assert DeviceLayout.from_json(shown) == partly
    whole = DeviceLayout(gpu_offload=True, n_gpu_layers=-1, devices=(gpu, cpu))
    assert whole.to_json()["n_gpu_layers_asked"] is None
    assert DeviceLayout.from_json(whole.to_json()) == whole
    # A layout from a worker that predates the field reads as all asked was loaded.
    older = {k: v for k, v in whole.to_json().items() if k != "n_gpu_layers_asked"}
    assert DeviceLayout.from_json(older) == whole
