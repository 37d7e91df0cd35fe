"""The tests' models, built once per machine under ~/.cache/llama-grpc/test-models/: the
embedded model re-quantized (a second real model) and synth_gguf's counting model (the tiny
one), with what a test needs to know of the counting model's output (`counting`)."""

from __future__ import annotations

import os
from pathlib import Path

from llama_grpc_testkit import synth_gguf

# -- a second real model ---------------------------------------------------------------------------

SECOND_MODEL_TYPE = "Q8_0"


def built_models_dir() -> Path:
    """Where built test models are kept between sessions (one build per machine)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llama-grpc" / "test-models"


def second_model_file() -> Path:
    """The embedded model re-quantized to Q8_0 by llama.cpp: a second real model, with its own
    file, size, sha256 and quantization (same architecture and vocabulary). Built once per
    machine (1.6 s on the 2-core dev box), cached under ~/.cache/llama-grpc/test-models/ by
    the source's sha256; the write is atomic. The tests' fixture and the benchmarks use it."""
    from llama_grpc_server.engine.quantize import quantize
    from llama_grpc_server.models.files import default_model_path, file_sha256

    source = default_model_path()
    path = built_models_dir() / f"embedded-{file_sha256(source)[:16]}-{SECOND_MODEL_TYPE}.gguf"
    if not path.is_file():
        quantize(source, path, SECOND_MODEL_TYPE)
    return path


# -- a tiny synthetic model -----------------------------------------------------------------------


def tiny_model_file() -> Path:
    """llama_grpc_testkit.synth_gguf's counting model (a Gemma 3 128 wide, 2 layers, a 1,024-token
    synthetic vocabulary): a forward pass costs microseconds where the embedded model's costs
    tens of milliseconds, and its greedy next token is always `synth_gguf.successor` of the last
    one by several nats, whatever the batch (never EOS: a stream runs to max_tokens). For the
    tests of statuses, token flow, cancellation, limits, streams and metrics, which do not read
    the words. Written once per machine under ~/.cache/llama-grpc/test-models/."""
    return synth_gguf.counting_model()


TINY_N_VOCAB = 1024  # synth_gguf.SHAPES["counting"].n_vocab (a test checks they agree)
TINY_BOS = 2  # synth_gguf.BOS


def counting(after: int, n: int) -> list[int]:
    """The tiny model's greedy output: the n tokens that follow token `after`."""
    out = [synth_gguf.successor(after, TINY_N_VOCAB)]
    while len(out) < n:
        out.append(synth_gguf.successor(out[-1], TINY_N_VOCAB))
    return out[:n]
