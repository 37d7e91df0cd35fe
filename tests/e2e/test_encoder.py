"""An encoder-only embedding model (a random-weight BERT with the real bert-bge vocabulary,
llama_grpc_testkit.synth_gguf's bert_model) served as the default model beside the embedded Gemma 3
in the pool (`--model`): Embed equals llama-cpp-python's own `Llama.embed` with every pooling, alone
and in a batch of 64 mixed lengths; an input longer than the context (the trained 512 positions: one
pass holds a whole input) is refused or truncated; every generation RPC is refused with
FAILED_PRECONDITION naming the model and why, and the server keeps serving both models."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import llama_cpp
import numpy as np
import pytest
import pytest_asyncio
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc import AsyncClient, ContextLengthExceededError, FailedPreconditionError
from llama_grpc_server.config import PoolSettings
from llama_grpc_server.models import cli as models_cli
from llama_grpc_server.models.files import default_model_path
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_testkit import synth_gguf
from llama_grpc_testkit.pool_server import pool_server
from tests.support.servicer_fake import details

from .conftest import settings

BERT, GEMMA = "bert", "gemma"
N_CTX_TRAIN = synth_gguf.BERT_SHAPE.n_ctx_train  # 512: the context an encoder is capped to
REFUSAL = f"model '{BERT}' is an encoder-only embedding model (bert): it cannot generate text"
_POOLINGS = {
    "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
    "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
    "none": llama_cpp.LLAMA_POOLING_TYPE_NONE,
}
TEXTS = [
    "The cat sat on the mat.",
    "Hi",
    "A retrieval system ranks documents by how similar their vectors are to the query's.",
    "naïve café, 中文 and digits 3.14159",
]
# An input alone or inside a batch: non-causal attention is masked per sequence, so the other
# inputs of a pass change nothing but the kernels' batch shapes (measured: cosine >= 0.99999).
COSINE = 0.9999


@pytest.fixture(scope="module")
def bert_path() -> Path:
    return synth_gguf.bert_model("cls")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def served(bert_path: Path) -> AsyncIterator[RunningServer]:
    """BERT as the default model (so the vLLM protocol's Generate, which names none, reaches
    it), the embedded Gemma 3 beside it; both may be resident."""
    conf = settings(n_parallel=4, max_queue=64)
    conf = replace(
        conf,
        model=replace(conf.model, model_path=str(bert_path), model_name=BERT),
        pool=PoolSettings(models=((GEMMA, str(default_model_path())),), max_loaded_models=2),
    )
    async with pool_server(conf) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def client(served: RunningServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{served.port}", timeout=120) as c:
        yield c


class Reference:
    """llama-cpp-python's Llama in embedding mode over the same file, one per pooling."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._models: dict[str, llama_cpp.Llama] = {}

    def embed(self, text: str, pooling: str) -> np.ndarray:
        if pooling not in self._models:
            self._models[pooling] = llama_cpp.Llama(
                str(self._path),
                embedding=True,
                pooling_type=_POOLINGS[pooling],
                n_ctx=N_CTX_TRAIN,
                n_batch=N_CTX_TRAIN,
                n_ubatch=N_CTX_TRAIN,
                n_threads=1,
                verbose=False,
            )
        out = self._models[pooling].embed(text, normalize=True)
        return np.asarray(out if pooling == "none" else [out], dtype=np.float64)

    def close(self) -> None:
        for model in self._models.values():
            model.close()


@pytest.fixture(scope="module")
def reference(bert_path: Path) -> Iterator[Reference]:
    ref = Reference(bert_path)
    yield ref
    ref.close()


def assert_same(got: tuple[tuple[float, ...], ...], want: np.ndarray) -> None:
    """Same shape, every vector at cosine >= COSINE with the reference's."""
    rows = np.asarray(got, dtype=np.float64)
    assert rows.shape == want.shape
    cosine = (rows * want).sum(axis=1) / (
        np.linalg.norm(rows, axis=1) * np.linalg.norm(want, axis=1)
    )
    assert cosine.min() >= COSINE, cosine.min()


async def test_model_info_is_the_encoders(client: AsyncClient) -> None:
    """The encoder's context is its trained one (512, not the server's 4,096: one pass must hold
    a whole input), its dimension 64, its own pooling cls."""
    info = await client.model_info(model=BERT)
    assert (info.n_ctx, info.n_embd) == (N_CTX_TRAIN, synth_gguf.BERT_SHAPE.n_embd)
    assert info.pooling == "cls"


@pytest.mark.parametrize("pooling", [None, "mean", "cls", "last", "none"])
async def test_each_pooling_equals_llama_embed(
    client: AsyncClient, reference: Reference, pooling: str | None
) -> None:
    """Each pooling (None: the model's own, cls) of each text alone equals Llama.embed's, at
    the model's dimension; usage counts the text's tokens ([CLS] ... [SEP])."""
    for text in TEXTS:
        got = await client.embed(text, model=BERT, pooling=pooling)
        assert got.pooling == (pooling or "cls")
        assert got.dimensions == synth_gguf.BERT_SHAPE.n_embd
        want = reference.embed(text, pooling or "cls")
        assert_same(got.embeddings[0].vectors, want)
        ids = await client.tokenize(text, add_special=True, model=BERT)
        assert got.embeddings[0].prompt_tokens == len(ids)
        if pooling == "none":
            assert len(got.embeddings[0].vectors) == len(ids)


async def test_batch_of_64_mixed_lengths_equals_llama_embed(
    client: AsyncClient, reference: Reference
) -> None:
    """64 texts of 3 to 202 tokens in one call (more than the slots: several passes, each
    holding whole inputs) come back in order, each equal to Llama.embed of it alone."""
    texts = [" ".join(f"word{j}" for j in range(1 + (i * 7) % 50)) for i in range(64)]
    batch = await client.embed(texts, model=BERT)
    assert len(batch.embeddings) == 64
    for text, got in zip(texts, batch.embeddings, strict=True):
        assert_same(got.vectors, reference.embed(text, "cls"))


async def test_input_over_the_context_is_refused_or_truncated(
    client: AsyncClient, reference: Reference
) -> None:
    """An input over the 512-token context is refused naming it, as generation's overflow is;
    with truncate it loses its oldest tokens after [CLS] and equals Llama.embed of what is
    left (which fits one pass)."""
    ids = await client.tokenize(" ".join(["token"] * 600), add_special=True, model=BERT)
    assert len(ids) > N_CTX_TRAIN
    with pytest.raises(ContextLengthExceededError) as refused:
        await client.embed(["ok", ids], model=BERT)
    assert refused.value.field == "inputs[1]"
    assert f"({len(ids)} tokens) exceeds the context ({N_CTX_TRAIN} tokens)" in str(refused.value)
    cut = await client.embed([ids], model=BERT, truncate=True)
    assert cut.embeddings[0].prompt_tokens == N_CTX_TRAIN
    assert cut.embeddings[0].truncated_tokens == len(ids) - N_CTX_TRAIN
    kept_text = " ".join(["token"] * (N_CTX_TRAIN - 2))  # [CLS] token x 510 [SEP]
    kept = [ids[0], *ids[len(ids) - N_CTX_TRAIN + 1 :]]
    assert kept == await client.tokenize(kept_text, add_special=True, model=BERT)
    assert_same(cut.embeddings[0].vectors, reference.embed(kept_text, "cls"))


def _generation_calls(client: AsyncClient) -> dict[str, Any]:
    async def stream() -> None:
        async for _ in client.stream("Hello", model=BERT, max_tokens=4):
            pass

    async def tokens() -> None:
        async for _ in client.generate_tokens([101, 7592, 102], model=BERT, max_tokens=4):
            pass

    return {
        "Generate": lambda: client.generate("Hello", model=BERT, max_tokens=4),
        "StreamGenerate": stream,
        "GenerateTokens": tokens,
        "chat": lambda: client.chat([{"role": "user", "content": "Hi"}], model=BERT),
    }


@pytest.mark.parametrize("call", ["Generate", "StreamGenerate", "GenerateTokens", "chat"])
async def test_generation_is_refused_naming_the_model(client: AsyncClient, call: str) -> None:
    """Each v1 generation RPC on the encoder: FAILED_PRECONDITION, field `model`, saying why;
    then the encoder still embeds and the generator beside it still generates."""
    with pytest.raises(FailedPreconditionError) as refused:
        await _generation_calls(client)[call]()
    assert refused.value.field == "model"
    assert REFUSAL in str(refused.value)
    assert len((await client.embed("still serving", model=BERT)).embeddings[0].vector) == 64
    done = await client.generate("The capital of France is", model=GEMMA, max_tokens=3)
    assert done.usage.completion_tokens == 3


async def test_engine_protocol_generate_is_refused_and_embed_works(
    served: RunningServer, client: AsyncClient
) -> None:
    """The vLLM engine protocol (SMG's) reaches the default model, the encoder: its Generate is
    refused with FAILED_PRECONDITION naming `model`; its Embed answers v1 Embed's vector."""
    ids = await client.tokenize(TEXTS[0], add_special=True, model=BERT)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        vllm = vpb_grpc.VllmEngineStub(channel)
        request = vpb.GenerateRequest(request_id=uuid.uuid4().hex, stream=False)
        request.tokenized.input_ids.extend(ids)
        request.sampling_params.max_tokens = 4
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in vllm.Generate(request):
                pass
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert REFUSAL in (refused.value.details() or "")
        assert details(refused.value)["ErrorInfo"].metadata["model"] == BERT
        embed = vpb.EmbedRequest(request_id=uuid.uuid4().hex)
        embed.tokenized.input_ids.extend(ids)
        got = await vllm.Embed(embed)
    want = (await client.embed([ids], model=BERT)).embeddings[0].vector
    assert got.embedding_dim == 64
    assert math.fsum(a * b for a, b in zip(got.embedding, want, strict=True)) >= COSINE


@pytest.mark.usefixtures("restore_logging")
def test_models_verify_embeds_with_an_encoder(
    bert_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`llama-grpc models verify` on the encoder embeds the prompt (one vector of its
    dimension) instead of generating, and succeeds."""
    assert models_cli.main(["verify", str(bert_path)]) == 0
    out = capsys.readouterr().out
    assert "embed:   one 64-dimensional vector (encoder-only: no generation)\nok\n" in out
    assert "tokens:" not in out
