"""Route llama.cpp's own log lines through structlog (warnings and errors always, the rest at
debug), instead of llama-cpp-python's default callback that prints everything to stderr."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any

import llama_cpp
import structlog

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the previous line).
_LEVELS = {
    0: logging.DEBUG,
    1: logging.DEBUG,
    2: logging.DEBUG,  # llama.cpp's info lines (model load chatter) are debug here
    3: logging.WARNING,
    4: logging.ERROR,
}
_CONT = 5  # GGML_LOG_LEVEL_CONT
_log = structlog.get_logger("llama.cpp")
_state: dict[str, Any] = {"buffer": "", "level": logging.DEBUG, "debug": False}
_capture = threading.local()  # .lines: list[str] while captured_errors() runs on this thread


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]  # ctypes CFUNCTYPE is untyped
def _callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    py_level = _LEVELS.get(level, logging.DEBUG) if level != _CONT else _state["level"]
    _state["level"] = py_level
    if py_level < logging.WARNING and not _state["debug"]:
        return
    _state["buffer"] += text.decode("utf-8", errors="replace")
    if not _state["buffer"].endswith("\n"):
        return
    line, _state["buffer"] = _state["buffer"].rstrip(), ""
    if line:
        _log.log(py_level, "llama_cpp", line=line)
        captured: list[str] | None = getattr(_capture, "lines", None)
        if captured is not None:
            captured.append(line)


def install(debug: bool) -> None:
    """Replace llama-cpp-python's stderr printer; keep a module reference to the callback."""
    _state["debug"] = debug
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))


@contextlib.contextmanager
def captured_errors() -> Iterator[list[str]]:
    """Also collect the warning and error lines llama.cpp logs on this thread during the block
    (a grammar's compile errors, say); they are still logged."""
    lines: list[str] = []
    previous = getattr(_capture, "lines", None)
    _capture.lines = lines
    try:
        yield lines
    finally:
        _capture.lines = previous
