"""Embed on every synthetic decoder family (llama_grpc_testkit.synth_gguf's FAMILIES: tiny
random-weight models of the family's architecture and real vocabulary; gemma3, the embedded model,
is tests/model/test_embeddings.py's): a real server per family answers with the model's dimension,
each vector equal to llama-cpp-python's own `Llama.embed` (mean pooling, the default of a model
without a pooling of its own), alone and in a batch."""

from __future__ import annotations

import math

import llama_cpp
import numpy as np
import pytest

from llama_grpc import AsyncClient
from llama_grpc_server.config import ModelSettings, SchedulerSettings, ServerSettings, Settings
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.server import start_server
from tests.support.families import FAMILIES, family_model

N_CTX = 256
TEXTS = ["The cat sat on the mat.", "Hi", "naïve café, 中文 and digits 3.14159 " * 3]
# An input alone: the same computation as Llama.embed's (cosine 1 - 1e-7 measured). In a batch
# the kernels' shapes change the numbers a little (tests/model/test_embeddings.py measured
# 0.998 on Gemma 3). Another text's vector is far below either: Llama.embed's cosines between
# these texts' vectors were -0.29 to 0.83 over the families (gemma4's first two: 0.825).
ALONE_COSINE = 0.9999
BATCHED_COSINE = 0.998


def cosine(a: object, b: object) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.vocabulary])
async def test_embed_equals_llama_embed(name: str) -> None:
    path = family_model(name)
    settings = ModelSettings(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, n_threads=1)
    conf = Settings(
        model=settings,
        scheduler=SchedulerSettings(n_parallel=4),
        server=ServerSettings(port=0, grace_s=1.0),
    )
    reference = llama_cpp.Llama(
        str(path),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_ubatch=N_CTX,
        n_threads=1,
        flash_attn=settings.flash_attn,  # the engine's: the attention kernel's numbers differ
        verbose=False,
    )
    try:
        want = [reference.embed(text, normalize=True) for text in TEXTS]
    finally:
        reference.close()
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        async with AsyncClient(f"127.0.0.1:{running.port}", timeout=120) as client:
            info = await client.model_info()
            alone = [(await client.embed(text)).embeddings[0] for text in TEXTS]
            batch = await client.embed(TEXTS)
    assert info.n_embd == len(want[0]) == 64  # synth_gguf.FAMILY_SHAPE's width
    assert batch.dimensions == info.n_embd and batch.pooling == "mean"
    for i, expected in enumerate(want):
        assert len(alone[i].vector) == info.n_embd
        assert math.isclose(math.fsum(v * v for v in alone[i].vector), 1.0, rel_tol=1e-4)
        assert cosine(alone[i].vector, expected) >= ALONE_COSINE, (name, i)
        assert cosine(batch.embeddings[i].vector, expected) >= BATCHED_COSINE, (name, i)
        assert batch.embeddings[i].prompt_tokens == alone[i].prompt_tokens
