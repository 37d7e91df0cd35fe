"""bench/synth_gguf.py: a random-weight Gemma 3 GGUF that llama.cpp loads, quantizes and serves
(the GPU benchmark makes its models this way on a machine that can fetch none)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import llama_cpp
import pytest

from llama_grpc_server.config import ModelSettings, SchedulerSettings, Settings
from llama_grpc_server.core.request import (
    Finished,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.models.gguf_header import read_header

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import synth_gguf

from .conftest import run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "tiny-f16.gguf"
    synth_gguf.write(synth_gguf.SHAPES["tiny"], path)
    return path


def test_shapes_are_the_models_they_stand_for() -> None:
    assert synth_gguf.SHAPES["270m"].n_params == pytest.approx(268e6, rel=0.01)
    assert synth_gguf.SHAPES["1b"].n_params == pytest.approx(1.0e9, rel=0.01)


def test_header_describes_a_gemma3(tiny: Path) -> None:
    meta = read_header(tiny).metadata
    shape = synth_gguf.SHAPES["tiny"]
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.block_count"] == shape.n_layer
    assert meta["gemma3.attention.key_length"] == shape.head_dim
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"].length == shape.n_vocab


def test_vocabulary_pieces_are_unique() -> None:
    tokens, scores, types = synth_gguf.vocabulary(2000)
    assert len(set(tokens)) == len(tokens) == len(scores) == len(types) == 2000
    assert tokens[synth_gguf.FIRST_PIECE] == "\u2581a".encode()


async def test_llama_cpp_quantizes_and_serves_it(tiny: Path) -> None:
    """Quantized to Q4_K_M by llama.cpp (the C API llama-quantize uses), then served by the
    engine: a token-id prompt generates max_tokens tokens with ignore_eos."""
    quantized = tiny.with_name("tiny-q4_k_m.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(tiny).encode(), str(quantized).encode(), params) == 0
    assert read_header(quantized).metadata["general.file_type"] == 15  # MOSTLY_Q4_K_M
    settings = Settings(
        model=ModelSettings(model_path=str(quantized), n_ctx=512, n_batch=128, n_threads=1),
        scheduler=SchedulerSettings(n_parallel=2),
    )
    engine = await asyncio.to_thread(build_engine, settings)
    try:
        first = synth_gguf.FIRST_PIECE
        prompt = (synth_gguf.BOS, first, first + 7, first + 300)
        request = GenerationRequest(
            "synth",
            prompt,
            SamplingParams(temperature=0.0),
            StoppingParams(max_tokens=6, ignore_eos=True),
        )
        out = await run(engine, request)
        ids = out.token_ids
        assert isinstance(out.final, Finished)
        assert len(ids) == 6 and all(0 <= t < synth_gguf.SHAPES["tiny"].n_vocab for t in ids)
        assert engine.detokenize(prompt[1:], render_special=False) == " a h ko"
    finally:
        await asyncio.to_thread(engine.close)
