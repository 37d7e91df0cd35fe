"""Sharing the CPUs between a model load and the engines decoding meanwhile (one process).

A model load (llama_model_load_from_file, the context, the vocabulary tables: LlamaModel's
constructor) keeps one core busy for seconds on its own thread. An engine that decodes meanwhile
with one llama.cpp thread per core then has more threads than there are cores: every forward
pass is a few hundred OpenMP barriers, and at each one the threads that are done spin, waiting
for the one the scheduler has just put off its core for the loader. Measured on the 2-core dev
box (bench/load_stall.py): a stream on the default model delivered nothing during the whole
2.6-2.8 s load of a Q8_0 model; its forward passes went from ~20 ms to seconds.

So while loads are in progress every engine decodes with fewer threads: at most the CPUs left
once each load has its core (never fewer than one, never more than configured). Each engine
applies it on its own thread just before each llama_decode (`decode_threads`, then
llama_set_n_threads, which only sets what the next graph computation uses) and goes back to its
configured threads at the first decode after the last load ended. Reading the count is one
attribute read: no lock on the decode path."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from llama_grpc_server.config import num_cpus


class _Loads:
    """The process's model loads in progress. Only the loader threads write it (under a lock);
    engine threads read `count` (one int read) before each forward pass."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        # bench/load_stall.py turns this off to measure what the engines do without it.
        self.enabled = True

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        with self._lock:
            self.count += 1
        try:
            yield
        finally:
            with self._lock:
                self.count -= 1


LOADS = _Loads()


def loading() -> contextlib.AbstractContextManager[None]:
    """A model load in progress: the engines give it a core until the block ends."""
    return LOADS.loading()


def decode_threads(configured: tuple[int, int], cpus: int | None = None) -> tuple[int, int]:
    """(generation, prompt) threads for an engine's next forward pass: `configured` unless
    loads are in progress and it would leave them no core; `cpus` defaults to num_cpus()."""
    loads = LOADS.count if LOADS.enabled else 0
    if not loads:
        return configured
    free = max(1, (cpus if cpus is not None else num_cpus()) - loads)
    return min(configured[0], free), min(configured[1], free)
