"""LoraAdapters: a model's LoRA adapters as llama.cpp holds them (llama_adapter_lora_init) and the
adapter set its context applies (llama_set_adapters_lora). Loading, freeing and switching run on
the engine thread only, between forward passes. What requests see (names, scales, the caches'
keys) is core.adapters; the checks against the base model, models.adapters."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp
import structlog

from llama_grpc_server.core.adapters import AdapterEntry, AdapterSet
from llama_grpc_server.models.adapters import check_adapter
from llama_grpc_server.models.files import file_sha256

log = structlog.get_logger("llama_grpc.engine")

DIGEST_CHARS = 16


class AdapterLoadError(ValueError):
    """The adapter does not fit its base model, or llama.cpp could not load it."""


class LoraAdapters:
    """The llama.cpp adapters of one model and context, by name."""

    def __init__(self, model: Any, ctx: Any, model_path: str) -> None:
        self._model = model
        self._ctx = ctx
        self._model_path = model_path
        self._handles: dict[str, tuple[str, Any]] = {}  # name -> (digest, llama_adapter_lora *)
        self._current: tuple[tuple[str, float], ...] = ()  # (name, scale) the context applies

    def load(self, name: str, path: str, default_scale: float) -> AdapterEntry:
        """Check the file against the base model (AdapterLoadError naming the mismatch), then
        load it; a name already loaded is replaced (its old handle is freed unless in use: the
        caller frees it when its requests are done)."""
        if not Path(path).is_file():
            raise AdapterLoadError(f"adapter file not found: {path}")
        try:
            info = check_adapter(Path(path), Path(self._model_path))
        except (ValueError, OSError) as exc:
            raise AdapterLoadError(str(exc)) from None
        handle = llama_cpp.llama_adapter_lora_init(self._model, path.encode())
        if not handle:
            raise AdapterLoadError(f"llama.cpp could not load the adapter {path} (see the log)")
        digest = file_sha256(path)[:DIGEST_CHARS]
        self._handles[name] = (digest, handle)
        log.info("adapter_loaded", name=name, path=path, rank=info.rank, alpha=info.alpha)
        return AdapterEntry(
            name=name,
            path=path,
            default_scale=default_scale,
            digest=digest,
            rank=info.rank,
            alpha=info.alpha,
            num_tensors=len(info.targets),
            size_bytes=info.n_bytes,
        )

    def has(self, name: str, digest: str) -> bool:
        held = self._handles.get(name)
        return held is not None and held[0] == digest

    def free(self, name: str) -> None:
        """Free an adapter no request uses any more (the context stops applying it first)."""
        held = self._handles.pop(name, None)
        if held is None:
            return
        if any(n == name for n, _ in self._current):
            self.apply(())
        llama_cpp.llama_adapter_lora_free(held[1])
        log.info("adapter_freed", name=name)

    def apply(self, adapters: AdapterSet) -> bool:
        """Make the context apply `adapters` (a no-op when it already does); True if it
        switched. KeyError for an adapter not loaded (the engine checks at admission)."""
        wanted = tuple((a.name, a.scale) for a in adapters)
        if wanted == self._current:
            return False
        n = len(wanted)
        handles = (llama_cpp.llama_adapter_lora_p_ctypes * max(n, 1))()
        scales = (ctypes.c_float * max(n, 1))()
        for i, adapter in enumerate(adapters):
            handles[i] = self._handles[adapter.name][1]
            scales[i] = adapter.scale
        status = int(llama_cpp.llama_set_adapters_lora(self._ctx, handles, n, scales))
        if status != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed with status {status}")
        self._current = wanted
        return True

    def close(self) -> None:
        """Forget the handles: llama_model_free frees the adapters of the model."""
        self._handles.clear()
        self._current = ()
