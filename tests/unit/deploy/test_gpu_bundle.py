"""bench/gpu/make_bundle.py's cut of llama.cpp: what the CUDA build of libllama + llama-server,
llama-batched-bench and llama-quantize needs stays, the rest goes (bench/gpu.sh --cpu builds the
cut tree: that is the test that nothing needed went)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "gpu"))

import make_bundle


@pytest.mark.parametrize(
    "path",
    [
        "CMakeLists.txt",
        "include/llama.h",
        "src/llama-context.cpp",
        "common/arg.cpp",
        "ggml/src/ggml-cuda/mmq.cuh",
        "ggml/src/ggml-cuda/template-instances/mmq-instance-q4_k.cu",
        "ggml/src/ggml-cpu/arch/x86/quants.c",
        "tools/CMakeLists.txt",
        "tools/server/server-context.cpp",
        "tools/batched-bench/batched-bench.cpp",
        "tools/quantize/quantize.cpp",
        "tools/mtmd/clip.cpp",
        "tools/ui/ui.cpp.in",
        "scripts/ui-assets.cmake",
        "vendor/cpp-httplib/httplib.cpp",
    ],
)
def test_kept(path: str) -> None:
    assert not make_bundle.dropped(path)


@pytest.mark.parametrize(
    "path",
    [
        "models/ggml-vocab-gemma-4.gguf",
        "docs/build.md",
        "tests/test-backend-ops.cpp",
        "examples/simple/simple.cpp",
        "ggml/src/ggml-vulkan/ggml-vulkan.cpp",
        "ggml/src/ggml-metal/ggml-metal.m",
        "ggml/src/ggml-cpu/arch/arm/quants.c",
        "tools/cli/cli.cpp",
        "tools/llama-bench/llama-bench.cpp",
        "tools/ui/src/app.html",
        "tools/server/tests/unit/test_basic.py",
        "scripts/sync-ggml.sh",
        "gguf-py/gguf/constants.py",
    ],
)
def test_dropped(path: str) -> None:
    assert make_bundle.dropped(path)


def test_tools_cmake_adds_only_the_built_tools() -> None:
    added = [line for line in make_bundle.TOOLS_CMAKE.splitlines() if "add_subdirectory" in line]
    assert added == [f"add_subdirectory({t})" for t in make_bundle.TOOLS]
    assert all(not make_bundle.dropped(f"tools/{t}/CMakeLists.txt") for t in make_bundle.TOOLS)
