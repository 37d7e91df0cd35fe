"""Resolve `--n-gpu-layers auto` to a number: probe the llama.cpp build and its GPU devices,
let core.offload.decide() choose, and log the choice with its reason."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import llama_cpp
import structlog

from llama_grpc_server.config import AUTO, GpuLayers
from llama_grpc_server.core.offload import Offload, decide, kv_cache_bytes
from llama_grpc_server.models.gguf_header import GGUFError, read_header

log = structlog.get_logger("llama_grpc.engine")

# enum ggml_backend_dev_type (ggml-backend.h): CPU, GPU, IGPU (integrated: host memory), ACCEL.
_GPU_TYPES = (1, 2)


def _ggml() -> Any:
    """libggml with the device-API signatures set. llama-cpp-python 0.3.36 binds none of the
    ggml_backend_dev_* functions, but loads libggml (llama_cpp._ggml.libggml) and the library
    exports them; dlsym through its handle also finds those defined in libggml-base."""
    from llama_cpp._ggml import libggml

    size_p = ctypes.POINTER(ctypes.c_size_t)
    for name, restype, argtypes in (
        ("ggml_backend_dev_count", ctypes.c_size_t, []),
        ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
        ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p]),
        ("ggml_backend_dev_memory", None, [ctypes.c_void_p, size_p, size_p]),
    ):
        function = getattr(libggml, name)
        function.restype, function.argtypes = restype, argtypes
    return libggml


def gpu_free_bytes() -> int | None:
    """Free memory summed over the GPU devices llama.cpp has registered (the default split
    mode spreads layers over all of them); None when there is none or the query fails."""
    try:
        ggml = _ggml()
        free_total, found = 0, False
        for index in range(int(ggml.ggml_backend_dev_count())):
            device = ggml.ggml_backend_dev_get(index)
            if ggml.ggml_backend_dev_type(device) not in _GPU_TYPES:
                continue
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            ggml.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
            free_total += int(free.value)
            found = True
    except (ImportError, AttributeError, OSError) as exc:  # a build without the device API
        log.warning("gpu_memory_unknown", error=str(exc))
        return None
    return free_total if found else None


def auto_offload(model_path: str, n_ctx: int) -> Offload:
    """What `auto` means for this model on this machine."""
    supports = bool(llama_cpp.llama_supports_gpu_offload())
    free = gpu_free_bytes() if supports else None
    kv_bytes = 0
    if supports and free is not None:
        try:
            kv_bytes = kv_cache_bytes(read_header(model_path).metadata, n_ctx)
        except GGUFError:  # llama.cpp reports a bad file better when it loads it
            kv_bytes = 0
    return decide(supports, free, os.path.getsize(model_path), kv_bytes)


def resolve_n_gpu_layers(setting: GpuLayers, model_path: str, n_ctx: int) -> int:
    """The n_gpu_layers to load with: the configured number, or auto's choice (logged)."""
    if setting != AUTO:
        return int(setting)
    choice = auto_offload(model_path, n_ctx)
    log.info("n_gpu_layers_auto", n_gpu_layers=choice.n_gpu_layers, reason=choice.reason)
    return choice.n_gpu_layers
