"""A llama_decode that fails on demand, in-process: `fail_embedding_passes(n)` makes the next n
forward passes run with embeddings on (the runner's embedding passes: llama_set_embeddings
true) return GGML_STATUS_FAILED's -3 without computing, as llama.cpp does when a graph compute
fails (it has then removed the failed ubatch's positions from the KV cache, which is what a
skipped pass leaves). Other passes run as usual."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import llama_cpp

STATUS_COMPUTE_FAILED = -3


class _Fault:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.left = 0  # embedding passes still to fail
        self.failed = 0  # failed so far
        self.embeddings_on: set[int] = set()  # contexts (addresses) with embeddings on


@contextlib.contextmanager
def fail_embedding_passes(n: int) -> Iterator[_Fault]:
    """Patch llama_cpp's llama_set_embeddings and llama_decode (the engine's modules call them
    through the module) for the block; yields the counters."""
    fault = _Fault()
    fault.left = n
    real_set, real_decode = llama_cpp.llama_set_embeddings, llama_cpp.llama_decode

    def set_embeddings(ctx: Any, on: bool) -> None:
        key = _address(ctx)
        with fault.lock:
            if on:
                fault.embeddings_on.add(key)
            else:
                fault.embeddings_on.discard(key)
        real_set(ctx, on)

    def decode(ctx: Any, batch: Any) -> int:
        with fault.lock:
            if _address(ctx) in fault.embeddings_on and fault.left > 0:
                fault.left -= 1
                fault.failed += 1
                return STATUS_COMPUTE_FAILED
        return int(real_decode(ctx, batch))

    llama_cpp.llama_set_embeddings = set_embeddings
    llama_cpp.llama_decode = decode
    try:
        yield fault
    finally:
        llama_cpp.llama_set_embeddings = real_set
        llama_cpp.llama_decode = real_decode


def _address(ctx: Any) -> int:
    return int(ctx) if isinstance(ctx, int) else int(getattr(ctx, "value", 0) or id(ctx))
