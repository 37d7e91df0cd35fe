"""--batch-invariant against the real server and model (its own process: ggml reads the mode's
kernel setting once per process): one greedy request gives the same tokens alone, beside 3 other
streams, after a prefix of it was cached, continued from its own output, resumed (params.resume)
with nothing cached, and through either door (v1 GenerateTokens and the vLLM engine protocol)
whatever the gateway's probe left cached."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest_asyncio
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc import AsyncClient, Delta, Done
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_testkit.server_process import ServerProcess, server_process

# long enough for flash attention's tiled path (64 rows in one micro-batch without the mode) and,
# with 64 tokens generated and other requests' cells, a KV view of 512 cells (its split path)
PROMPT = (
    "You are a careful assistant. Summarise the following notes about lighthouses, keeping "
    "every date and name. The first lighthouse on the rock was built of timber in 1698 by "
    "Henry Winstanley, and it was washed away in the great storm of 1703 with its builder "
    "inside. John Rudyerd built a second tower of timber and stone that stood until a fire "
    "in 1755. John Smeaton then built a granite tower whose dovetailed blocks became the model "
    "for every rock lighthouse after it; it stood until erosion of the rock beneath it forced "
    "its removal in 1877, and its upper part was rebuilt on Plymouth Hoe as a memorial. Write "
    "the summary as a short story told by the last keeper, warm and a little sad."
)
OTHERS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
)
COLORS = "The three primary colors are"
N = 64


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def server() -> AsyncIterator[ServerProcess]:
    async with server_process("--batch-invariant", "--n-ctx", "4096", "--n-parallel", "4") as s:
        yield s


@pytest_asyncio.fixture(loop_scope="session")
async def client(server: ServerProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=300) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="session")
async def vllm(server: ServerProcess) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield vpb_grpc.VllmEngineStub(channel)


async def greedy(
    client: AsyncClient, ids: list[int], max_tokens: int = N, **params: Any
) -> tuple[list[int], int]:
    """(the greedy tokens, the prompt tokens the cache gave)."""
    out: list[int] = []
    cached = -1
    stream = client.generate_tokens(
        ids, max_tokens=max_tokens, temperature=0, ignore_eos=True, **params
    )
    async for event in stream:
        if isinstance(event, Delta):
            out += event.token_ids
        elif isinstance(event, Done):
            cached = event.usage.cached_prompt_tokens
    return out, cached


async def engine_greedy(vllm: Any, ids: list[int], max_tokens: int, **params: Any) -> list[int]:
    request = vpb.GenerateRequest(
        request_id=uuid.uuid4().hex,
        sampling_params=vpb.SamplingParams(max_tokens=max_tokens, **params),
    )
    request.tokenized.input_ids.extend(ids)
    messages = [m async for m in vllm.Generate(request)]
    [done] = [m.complete for m in messages if m.WhichOneof("response") == "complete"]
    return list(done.output_ids)


async def test_one_answer_through_either_door(client: AsyncClient, vllm: Any) -> None:
    """The gateway's readiness probe (a one-token completion of "Hi") leaves its BOS cached, so
    SMG's "The three primary colors are" was computed as 5 tokens after a cached one; v1's,
    whole: by default those passes round differently and the greedy answers parted (" red,
    blue, and yellow." vs " red, yellow, and blue."). The same ids, SMG's sampling fields."""
    ids = await client.tokenize(COLORS)
    hi = await client.tokenize("Hi", add_special=False)
    await engine_greedy(vllm, hi, 1, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    smg = await engine_greedy(
        vllm, ids[1:], 12, temperature=0.0, top_k=40, top_p=0.95, min_p=0.05,
        repetition_penalty=1.0,
    )  # fmt: skip
    v1, cached = await greedy(client, ids, 12, cache_prompt=False)
    assert cached == 0
    assert smg == v1


async def test_same_tokens_alone_beside_others_cached_and_continued(client: AsyncClient) -> None:
    ids = await client.tokenize(PROMPT)
    alone, _ = await greedy(client, ids, cache_prompt=False)
    # beside 3 other streams: one batch from the first pass (the admission window gathers them)
    others = [await client.tokenize(text) for text in OTHERS]
    together = await asyncio.gather(
        greedy(client, ids, cache_prompt=False), *(greedy(client, o) for o in others)
    )
    assert together[0][0] == alone
    # a prefix of it cached by a request that went on otherwise
    head = ids[:100]
    await greedy(client, head + others[2][1:], 4)
    cached_run, cached = await greedy(client, ids)
    assert cached >= 100
    assert cached_run == alone
    # its prompt and the first 20 tokens it generated, fed back as a prompt
    continued, _ = await greedy(client, ids + alone[:20], N - 20)
    assert continued == alone[20:]


async def test_a_resumed_stream_is_the_undisturbed_one(
    client: AsyncClient, server: ServerProcess
) -> None:
    """params.resume after 1, 20 and 63 tokens, the prompt and those tokens computed afresh (no
    cache) in passes of another shape than the undisturbed stream's one token each: the rest
    of the answer is the undisturbed one."""
    ids = await client.tokenize(PROMPT)
    alone, _ = await greedy(client, ids, cache_prompt=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        for cut in (1, 20, 63):
            params = pb.GenerationParams(
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_tokens=N, ignore_eos=True),
                cache_prompt=False,
                resume=pb.Resume(token_ids=alone[:cut]),
            )
            rest = [
                t
                async for message in stub.GenerateTokens(
                    pb.GenerateTokensRequest(token_ids=ids, params=params)
                )
                if message.WhichOneof("event") == "delta"
                for t in message.delta.token_ids
            ]
            assert rest == alone[cut:], cut
