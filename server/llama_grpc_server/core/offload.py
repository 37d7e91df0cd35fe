"""`--n-gpu-layers auto`: offload every layer when llama.cpp can and the GPU has room, else none.
Pure: the engine probes the build and the devices (engine/offload.py) and asks decide()."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ALL_LAYERS = -1  # llama.cpp: a negative n_gpu_layers offloads every layer
GIB = 1024**3
# Beyond the weights and the KV cache, llama.cpp allocates compute buffers (a few hundred MiB
# at n_ubatch 512 for small models, more for large vocabularies) and the CUDA context itself.
MIN_MARGIN_BYTES = GIB // 2
MARGIN_FRACTION = 0.1


@dataclass(frozen=True, slots=True)
class Offload:
    n_gpu_layers: int
    reason: str


def needed_bytes(model_bytes: int, kv_bytes: int = 0) -> int:
    """Device memory a fully offloaded model needs, roughly: weights + KV cache + margin."""
    return model_bytes + kv_bytes + max(MIN_MARGIN_BYTES, int(model_bytes * MARGIN_FRACTION))


def decide(
    supports_offload: bool, free_bytes: int | None, model_bytes: int, kv_bytes: int = 0
) -> Offload:
    """All layers (-1) or none (0), and why. free_bytes: free memory summed over the GPU
    devices llama.cpp sees (None: it sees none)."""
    if not supports_offload:
        return Offload(0, "no GPU backend in this llama.cpp build")
    if free_bytes is None:
        return Offload(0, "llama.cpp reports no GPU device")
    need = needed_bytes(model_bytes, kv_bytes)
    fits = free_bytes >= need
    verdict = "offloading all layers" if fits else "too little, keeping the model on the CPU"
    reason = f"model needs about {_gib(need)} GiB, GPUs have {_gib(free_bytes)} GiB free: {verdict}"
    return Offload(ALL_LAYERS if fits else 0, reason)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def kv_cache_bytes(metadata: Mapping[str, object], n_ctx: int) -> int:
    """The F16 KV cache of n_ctx cells over every layer, from GGUF metadata (the engine keeps
    the full cache on sliding-window layers too: swa_full). Head sizes default to
    embedding_length / head_count as in llama.cpp. 0 when the file does not say (per-layer
    head counts in an array, say): the margin then has to cover it."""
    arch = metadata.get("general.architecture")

    def number(key: str) -> int:
        value = metadata.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    layers, heads = number("block_count"), number("attention.head_count")
    heads_kv = number("attention.head_count_kv") or heads
    head_dim = number("embedding_length") // heads if heads else 0
    key_length = number("attention.key_length") or head_dim
    value_length = number("attention.value_length") or head_dim
    return 2 * n_ctx * layers * heads_kv * (key_length + value_length)
