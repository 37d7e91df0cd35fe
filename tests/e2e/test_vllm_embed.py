"""The vLLM engine protocol's Embed (what the SMG gateway calls for /v1/embeddings) against the
real server and model: the vector of a v1 Embed with its defaults, bad input answered with a
status naming the field while the server keeps serving."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc import AsyncClient
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from tests.support.servicer_fake import details

TEXT = "Embeddings through the engine protocol."


@pytest_asyncio.fixture(loop_scope="session")
async def vllm(server: RunningServer) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield vpb_grpc.VllmEngineStub(channel)


def embed_request(ids: list[int], request_id: str = "") -> vpb.EmbedRequest:
    request = vpb.EmbedRequest(request_id=request_id or uuid.uuid4().hex)
    request.tokenized.input_ids.extend(ids)
    request.tokenized.original_text = TEXT
    return request


async def test_embed_equals_v1_embed(vllm: Any, client: AsyncClient) -> None:
    """The same token ids give v1 Embed's vector (default pooling, unit length), its token
    count and its dimension."""
    ids = await client.tokenize(TEXT, add_special=True)
    got = await vllm.Embed(embed_request(ids))
    want = (await client.embed([ids])).embeddings[0]
    info = await client.model_info()
    assert got.prompt_tokens == want.prompt_tokens == len(ids)
    assert got.embedding_dim == len(got.embedding) == info.n_embd
    dot = math.fsum(a * b for a, b in zip(got.embedding, want.vector, strict=True))
    assert dot >= 0.9999  # both unit length: the cosine
    assert math.isclose(math.fsum(v * v for v in got.embedding), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize(
    ("ids", "code", "field"),
    [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids"),
        ([2, 10**7], grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids[1]"),
        ([5] * 5000, grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids"),
    ],
)
async def test_bad_input_names_the_field(
    vllm: Any, ids: list[int], code: grpc.StatusCode, field: str
) -> None:
    """Empty, out-of-vocabulary and over-the-context inputs: INVALID_ARGUMENT naming the
    field; the next call is served."""
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await vllm.Embed(embed_request(ids))
    assert bad.value.code() == code
    assert details(bad.value)["BadRequest"].field_violations[0].field == field
    assert len((await vllm.Embed(embed_request([2, 651]))).embedding) > 0
