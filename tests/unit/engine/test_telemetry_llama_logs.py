"""engine.logs: llama.cpp's own log lines go through structlog (no model needed)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from llama_grpc_server.engine import logs

GGML_INFO, GGML_WARN, GGML_CONT = 2, 3, 5


@pytest.fixture
def debug_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(logs._state, "debug", True)
    monkeypatch.setitem(logs._state, "buffer", "")


def test_info_lines_are_debug_and_joined(debug_logs: None) -> None:
    """With debug logs on, llama.cpp's info output becomes one debug line per text line, a
    continuation (CONT) joining the line it continues."""
    with capture_logs() as captured:
        logs._callback(GGML_INFO, b"load: 18 layers", None)
        logs._callback(GGML_CONT, b", done\n", None)
    assert captured == [
        {"event": "llama_cpp", "line": "load: 18 layers, done", "log_level": "debug"}
    ]


def test_warnings_pass_without_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without debug logs, info output is dropped but warnings still reach the log."""
    monkeypatch.setitem(logs._state, "debug", False)
    monkeypatch.setitem(logs._state, "buffer", "")
    with capture_logs() as captured:
        logs._callback(GGML_INFO, b"chatter\n", None)
        logs._callback(GGML_WARN, b"careful\n", None)
    assert captured == [{"event": "llama_cpp", "line": "careful", "log_level": "warning"}]
