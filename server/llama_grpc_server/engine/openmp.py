"""Releasing an idle engine's OpenMP helper threads (llama.cpp built with GGML_OPENMP, libgomp).

llama.cpp's CPU backend runs each forward pass as an OpenMP parallel region, so the thread that
decodes (an engine thread) owns a libgomp thread pool: its helpers stay alive between passes,
docked. libgomp counts every such thread in the process, docked or not, and once that count
exceeds the CPUs it cuts the spin at every barrier from 300,000 iterations to 100
(gomp_throttled_spin_count_var): the threads of a busy engine then sleep in futex at each of a
pass's few hundred barriers and are woken, instead of spinning for a few microseconds.

With two models resident (two engines, two llama.cpp threads each, 2 CPUs) an idle engine's
docked helper was enough. Measured with two raw contexts in one process on the dev box, 7
interleaved repetitions of a 64-token greedy run: the busy one made 78.1 tok/s alone, 65.8 beside
an idle one (-16 %), and 77.2 beside an idle one whose helpers had been released.

`omp_pause_resource_all(omp_pause_soft)` (OpenMP 5.0, libgomp's gomp_pause_host) joins the
calling thread's helpers and frees its pool; the next parallel region on that thread creates
them again (one pthread_create each). The engine loop calls it on its own thread once the engine
has been idle for a moment (EngineLoop on_idle), never during a pass."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

OMP_PAUSE_SOFT = 1
LIBGOMP = "libgomp.so.1"


def idle_release() -> Callable[[], None] | None:
    """A function that releases the calling thread's OpenMP helpers, or None when no libgomp is
    loaded in this process (llama.cpp built without OpenMP, or with another runtime): then
    there is nothing to release."""
    try:
        # RTLD_NOLOAD: the library llama.cpp already loaded, never a second copy.
        gomp = ctypes.CDLL(LIBGOMP, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int

    def release() -> None:
        pause(OMP_PAUSE_SOFT)

    return release
