"""The engine's OS thread names, as top -H, ps -L, py-spy and /proc show them: the engine thread
reads "llama-engine", and "llama-decode" while a decode makes llama.cpp's helper threads (the
warm-up's, and the first after an idle release: engine/openmp.py), which inherit its name, so
bench/overhead.py counts their CPU time as the forward passes'."""

from __future__ import annotations

import contextlib
import ctypes

PR_SET_NAME = 15  # prctl(2): the calling thread's name, as top -H, ps -L and /proc show it
DECODE_THREAD_NAME = "llama-decode"  # llama.cpp's helper threads (made during the warm-up)
ENGINE_THREAD_NAME = "llama-engine"


def set_native_thread_name(name: str) -> None:
    """Name the calling OS thread (Linux; at most 15 bytes are kept). Best effort: a no-op
    where prctl is missing."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
