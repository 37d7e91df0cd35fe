"""`--n-gpu-layers auto`: the pure decision (core/offload.py), its KV estimate from GGUF
metadata, and the engine-side resolution with the llama.cpp probes faked (no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from llama_grpc_server.core.offload import (
    ALL_LAYERS,
    GIB,
    MIN_MARGIN_BYTES,
    Offload,
    decide,
    kv_cache_bytes,
    needed_bytes,
)
from llama_grpc_server.engine import offload
from tests.support.gguf_files import write_model

MODEL = 4 * GIB
cpu_build = pytest.mark.skipif(
    offload.llama_cpp.llama_supports_gpu_offload(), reason="llama.cpp built with a GPU backend"
)


def test_no_gpu_backend_means_cpu() -> None:
    """A CPU-only build keeps every layer on the CPU whatever memory is reported."""
    assert decide(False, 80 * GIB, MODEL) == Offload(0, "no GPU backend in this llama.cpp build")


def test_a_gpu_build_without_a_device_means_cpu() -> None:
    assert decide(True, None, MODEL) == Offload(0, "llama.cpp reports no GPU device")


@pytest.mark.parametrize(
    ("free", "kv", "expected"),
    [
        (80 * GIB, 0, ALL_LAYERS),
        (needed_bytes(MODEL), 0, ALL_LAYERS),  # exactly enough
        (needed_bytes(MODEL) - 1, 0, 0),
        (MODEL, 0, 0),  # the weights fit, the margin does not
        (needed_bytes(MODEL), GIB, 0),  # the KV cache tips it over
        (0, 0, 0),
    ],
)
def test_all_layers_only_when_the_model_fits(free: int, kv: int, expected: int) -> None:
    choice = decide(True, free, MODEL, kv)
    assert choice.n_gpu_layers == expected
    assert ("offloading all layers" in choice.reason) == (expected == ALL_LAYERS)
    assert f"{free / GIB:.2f} GiB free" in choice.reason


def test_margin_is_a_tenth_of_the_model_at_least_half_a_gib() -> None:
    assert needed_bytes(GIB) == GIB + MIN_MARGIN_BYTES
    assert needed_bytes(20 * GIB, GIB) == 20 * GIB + GIB + 2 * GIB


def test_kv_cache_bytes_from_metadata() -> None:
    """2 (K and V halves: F16) x cells x layers x kv heads x (key + value length); head sizes
    default to embedding / heads; unknown architectures give 0."""
    gemma = {
        "general.architecture": "gemma3", "gemma3.block_count": 18,
        "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256, "gemma3.attention.value_length": 256,
    }  # fmt: skip
    assert kv_cache_bytes(gemma, 8192) == 2 * 8192 * 18 * 1 * 512  # 151 MB
    llama = {
        "general.architecture": "llama", "llama.block_count": 32, "llama.embedding_length": 4096,
        "llama.attention.head_count": 32, "llama.attention.head_count_kv": 8,
    }  # fmt: skip
    assert kv_cache_bytes(llama, 8192) == 2 * 8192 * 32 * 8 * 256  # 1 GiB
    assert kv_cache_bytes({"general.architecture": "x"}, 8192) == 0
    assert kv_cache_bytes({}, 8192) == 0


def test_numbers_pass_through_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload, "auto_offload", lambda *_: pytest.fail("probed"))
    assert offload.resolve_n_gpu_layers(-1, "/no/such.gguf", 512) == -1
    assert offload.resolve_n_gpu_layers(7, "/no/such.gguf", 512) == 7


@cpu_build
def test_auto_on_this_cpu_build_is_zero_and_logged(tmp_path: Path) -> None:
    """This venv's llama.cpp has no GPU backend: auto resolves to 0, and says why."""
    model = write_model(tmp_path / "m.gguf")
    with capture_logs() as logs:
        assert offload.resolve_n_gpu_layers("auto", str(model), 512) == 0
    assert logs == [
        {
            "event": "n_gpu_layers_auto",
            "n_gpu_layers": 0,
            "reason": "no GPU backend in this llama.cpp build",
            "log_level": "info",
        }
    ]


def test_auto_with_a_roomy_gpu_offloads_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the probes faked as a GPU build with 24 GiB free, auto offloads every layer."""
    model = write_model(tmp_path / "m.gguf")
    monkeypatch.setattr(offload.llama_cpp, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(offload, "gpu_free_bytes", lambda: 24 * GIB)
    assert offload.resolve_n_gpu_layers("auto", str(model), 512) == ALL_LAYERS
    monkeypatch.setattr(offload, "gpu_free_bytes", lambda: None)
    assert offload.auto_offload(str(model), 512).reason == "llama.cpp reports no GPU device"


@cpu_build
def test_gpu_free_bytes_sees_only_the_cpu_here() -> None:
    """The real device query (ggml_backend_dev_*) runs, and finds no GPU on this build."""
    assert offload.gpu_free_bytes() is None
