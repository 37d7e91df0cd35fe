"""An embedding pass whose llama_decode fails (tests/support/failing_decode.py: the real engine
and model, the pass's llama_decode answering -3 as a failed graph compute does), through a real
server: the Embed call ends with INTERNAL / ENGINE_ERROR naming the failure, the streams whose
decode rows rode in that pass generate on, every token as they would alone (the failed pass
computed nothing for them), health stays SERVING, and the next Embed and Generate are served."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from llama_grpc import LlamaGrpcError
from tests.support.failing_decode import fail_embedding_passes
from tests.support.fault_support import (
    ProbedServer,
    gather_bounded,
    probed_server,
    reference,
    request_id,
    start,
    until,
)

from .conftest import settings

# Wide top-2 margins at every step, so the solo comparison covers every token ("A, B, C, ...",
# used before, had a narrow first step: its Reference.sound was 0, a length check only).
PROMPTS = ("1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "Counting by 1: 40, 41, 42, 43, 44, 45,")
MAX_TOKENS = 32
TEXTS = ["The cat sat on the mat.", "Hi", "Stock markets fell sharply on Monday morning."]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def served() -> AsyncIterator[ProbedServer]:
    async with probed_server(settings(n_parallel=4, max_queue=64)) as server:
        yield server


async def test_failed_embedding_pass(served: ProbedServer) -> None:
    """Two greedy streams decoding, then an Embed of three texts whose first embedding pass
    fails: the call's status, the streams' tokens, health, and the next calls."""
    client = served.client
    alone = [await reference(client, p, MAX_TOKENS) for p in PROMPTS]
    assert all(ref.sound >= MAX_TOKENS // 2 for ref in alone), alone
    stats0 = await client.stats()
    with fail_embedding_passes(1) as fault:
        streams = [
            await start(
                client.stream(
                    p,
                    max_tokens=MAX_TOKENS,
                    ignore_eos=True,
                    temperature=0.0,
                    metadata=(("x-request-id", request_id("stream")),),
                )
            )
            for p in PROMPTS
        ]
        with pytest.raises(LlamaGrpcError) as failed:
            await client.embed(TEXTS, metadata=(("x-request-id", request_id("embed")),))
        assert fault.failed == 1
    assert failed.value.code == "INTERNAL"
    assert failed.value.reason == "ENGINE_ERROR"
    assert "llama_decode failed with status -3" in str(failed.value)
    outcomes = await gather_bounded(*(s.task for s in streams))
    for ref, outcome in zip(alone, outcomes, strict=True):
        assert outcome.error is None, outcome.error
        assert outcome.done is not None and outcome.done.finish_reason == "max_tokens"
        ref.check(outcome.token_ids)
    # the decode rows were in the failed pass: it was an embedding pass beside them
    assert await until(lambda: len(served.probe.ended) >= len(PROMPTS) + len(TEXTS))
    assert await client.health() == "SERVING"
    again = await client.embed(TEXTS)
    assert [e.prompt_tokens for e in again.embeddings] == [
        len(await client.tokenize(t, add_special=True)) for t in TEXTS
    ]
    done = await client.generate(PROMPTS[0], max_tokens=4, ignore_eos=True, temperature=0.0)
    assert list(done.token_ids) == list(alone[0].token_ids[:4])
    stats = await client.stats()
    # the failed embedding input(s) count as failed, the streams do not
    assert stats.requests_failed > stats0.requests_failed
    assert not any(
        e.error is not None for rid, e in served.probe.ended.items() if rid.startswith("stream")
    )
