"""The v1 Embed RPC through a real server and the real client, with the embedded model: a batch
of texts and token ids answered in order, pooling, dimensions, truncation, usage, and each bad
input's status naming its field while the server keeps serving."""

from __future__ import annotations

import asyncio
import math

import pytest

from llama_grpc import (
    AsyncClient,
    ContextLengthExceededError,
    DeadlineExceededError,
    EmbedResult,
    InvalidArgumentError,
    LlamaGrpcError,
)

TEXTS = ["The cat sat on the mat.", "Hi", "Stock markets fell sharply on Monday morning."]


def cosine(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


async def test_batch_of_texts_and_token_ids_in_order(client: AsyncClient) -> None:
    """Texts and token ids in one batch come back in input order: each input's vector is the
    one it gets alone (within llama.cpp's batch drift, tests/model/test_embeddings.py) and no
    other input's; a token-id input equals its text; usage adds the inputs' tokens."""
    info = await client.model_info()
    ids = await client.tokenize(TEXTS[0], add_special=True)
    alone = [(await client.embed(text)).embeddings[0] for text in TEXTS]
    batch = await client.embed([*TEXTS, ids])
    assert isinstance(batch, EmbedResult)
    assert batch.pooling == "mean"
    assert batch.dimensions == info.n_embd
    assert len(batch.embeddings) == 4
    for i, got in enumerate(batch.embeddings):
        want = alone[i % 3]
        assert got.prompt_tokens == want.prompt_tokens
        assert len(got.vector) == info.n_embd
        assert math.isclose(math.fsum(v * v for v in got.vector), 1.0, rel_tol=1e-4)
        own = cosine(got.vector, want.vector)
        assert own >= 0.998
        assert all(own > cosine(got.vector, other.vector) for other in alone if other != want)
    assert batch.prompt_tokens == sum(e.prompt_tokens for e in batch.embeddings)
    assert batch.embeddings[0].prompt_tokens == len(ids)


async def test_a_batch_of_64_mixed_lengths_comes_back_in_order(client: AsyncClient) -> None:
    """64 token-id inputs of 2 to 9 tokens (more than the call keeps submitted, 2 x
    --parallel): each answer has its own input's length, and sampled ones equal the same input
    embedded alone (within llama.cpp's batch drift) more than any other sampled input."""
    inputs = [[2, *(1000 + 37 * i + j for j in range(1 + i % 8))] for i in range(64)]
    batch = await client.embed(inputs)
    assert [e.prompt_tokens for e in batch.embeddings] == [len(i) for i in inputs]
    sampled = (5, 30, 63)
    alone = (await client.embed([inputs[i] for i in sampled])).embeddings
    for k, i in enumerate(sampled):
        own = cosine(batch.embeddings[i].vector, alone[k].vector)
        assert own >= 0.998
        others = [
            cosine(batch.embeddings[i].vector, a.vector) for j, a in enumerate(alone) if j != k
        ]
        assert own > max(others)


async def test_pooling_none_dimensions_and_unnormalized(client: AsyncClient) -> None:
    """pooling none gives a vector per token; dimensions keeps that many components, unit
    length; normalize=False gives the raw mean (not unit length)."""
    per_token = await client.embed(TEXTS[0], pooling="none", dimensions=32)
    ids = await client.tokenize(TEXTS[0], add_special=True)
    assert per_token.pooling == "none"
    assert len(per_token.embeddings[0].vectors) == len(ids)
    assert {len(v) for v in per_token.embeddings[0].vectors} == {32}
    for vector in per_token.embeddings[0].vectors:
        assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-4)
    raw = await client.embed(TEXTS[0], normalize=False)
    assert not math.isclose(math.fsum(v * v for v in raw.embeddings[0].vector), 1.0, rel_tol=1e-2)


async def test_input_over_the_context_is_refused_naming_it(client: AsyncClient) -> None:
    """An input over the context is refused by default, naming it and both numbers (the
    truncate_left path: tests/unit/rpc/test_embed_validation.py; embedding a whole 4,096-token
    context here would take a minute on the shared CPU)."""
    info = await client.model_info()
    long_ids = [1000 + i % 50 for i in range(info.n_ctx + 10)]
    with pytest.raises(ContextLengthExceededError) as refused:
        await client.embed(["ok", long_ids])
    assert refused.value.field == "inputs[1]"
    assert f"({info.n_ctx + 10} tokens) exceeds the context ({info.n_ctx} tokens)" in str(
        refused.value
    )


@pytest.mark.parametrize(
    ("inputs", "params", "field"),
    [
        ([], {}, "inputs"),
        (["fine", ""], {}, "inputs[1]"),
        ([[]], {}, "inputs[0].tokens.ids"),
        ([[5, 10**7]], {}, "inputs[0].tokens.ids[1]"),
        (["fine"], {"dimensions": 100_000}, "dimensions"),
        (["fine"], {"model": "no-such-model"}, "model"),
    ],
)
async def test_bad_inputs_name_their_field_and_the_server_keeps_serving(
    client: AsyncClient, inputs: list[object], params: dict[str, object], field: str
) -> None:
    """Each bad input gets INVALID_ARGUMENT (NOT_FOUND for a model) naming the field; the
    next call is served."""
    with pytest.raises(LlamaGrpcError) as bad:
        await client.embed(inputs, **params)  # type: ignore[arg-type]
    assert bad.value.field == field, bad.value
    if field != "model":
        assert isinstance(bad.value, InvalidArgumentError)
    assert len((await client.embed("still serving")).embeddings) == 1


async def test_unknown_pooling_is_refused_by_the_client() -> None:
    """The client refuses a pooling name it does not know before any call."""
    async with AsyncClient("127.0.0.1:1") as offline:
        with pytest.raises(ValueError, match="pooling must be one of"):
            await offline.embed("x", pooling="max")


async def test_inputs_are_scheduler_requests_in_the_stats(client: AsyncClient) -> None:
    """Each input is a request of the scheduler: started, finished and its prompt tokens
    counted in GetStats; no slot keeps its KV."""
    before = await client.stats()
    result = await client.embed(TEXTS)
    after = await client.stats()
    assert after.requests_started - before.requests_started == len(TEXTS)
    assert after.requests_finished - before.requests_finished == len(TEXTS)
    assert after.prompt_tokens - before.prompt_tokens == result.prompt_tokens
    assert await idle_slots(client)


async def test_deadline_ends_the_inputs_and_frees_their_slots(client: AsyncClient) -> None:
    """A deadline shorter than the batch: DEADLINE_EXCEEDED, every input's request ended (none
    left queued or in a slot), and the next call is served."""
    long_inputs = [[1000 + (i + j) % 50 for j in range(1500)] for i in range(12)]
    await client.embed("warm")  # the engine's warm-up is over: the deadline falls on the work
    before = await client.stats()
    with pytest.raises(DeadlineExceededError):
        await client.embed(long_inputs, timeout=0.5)
    assert await idle_slots(client)
    after = await client.stats()
    # 8 submitted (2 x --parallel at a time), each ended by the deadline; 4 never submitted
    assert after.requests_started - before.requests_started <= 8
    ended = after.requests_deadline_exceeded + after.requests_cancelled
    assert ended - (before.requests_deadline_exceeded + before.requests_cancelled) == 8
    assert after.requests_finished == before.requests_finished
    assert len((await client.embed("still serving")).embeddings) == 1


async def idle_slots(client: AsyncClient, within_s: float = 20.0) -> bool:
    """Until nothing is queued or in a slot (an ended request's slot is freed on the engine's
    next tick, and the stats snapshot follows: polled, never assumed)."""
    for _ in range(int(within_s / 0.05)):
        stats = await client.stats()
        if stats.active_slots == 0 and stats.queue_depth == 0:
            return True
        await asyncio.sleep(0.05)
    return False
