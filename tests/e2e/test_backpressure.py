"""Back-pressure over real channels, on the tiny counting model (llama_grpc_testkit.models: what is
tested is flow control, and its greedy output is known and wide at every step): a client that
stops reading mid-stream while others run. The others finish with their exact greedy tokens; the
paused request stops decoding with exactly --stream-buffer-tokens unread on the server (never
more), and once its client reads again it gets its whole exact output. A client that reads
nothing for --stalled-reader-s is ended with RESOURCE_EXHAUSTED (STALLED_READER) and its slot is
freed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from llama_grpc import AsyncClient, Delta
from llama_grpc.errors import LlamaGrpcError
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_testkit.models import tiny_model_file
from tests.support.fault_support import Outcome, collect, poll, reference

from .conftest import settings

BOUND = 16
# The paused stream pauses once its messages fill the slow client's HTTP/2 window: ~86 tokens
# in, alone on the box (three runs). A message carries every token decoded since the last send,
# up to BOUND, and a busy box lets more of them gather: bytes per token fall to about a third, so
# a window may hold ~300 (a two-worker run had all of 128 through, and nothing paused). 1,000
# leave it full with room to spare; 3,000 did too, and took 15 s of slow reading.
MAX_TOKENS = 1000
# The slow client's receive window: small, so the server's writes wait for it within a few
# dozen tokens (by default HTTP/2 flow control lets ~2,000 small deltas through unread).
SLOW_OPTIONS = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))
# The counting model's every step is wide, so the solo comparison covers every token. (Story
# prompts on the embedded model, used before, had a narrow first step: their Reference.sound was
# 0 and "exact" compared lengths only.)
PROMPTS = tuple(
    "Counting by 1: " + ", ".join(str(start + i) for i in range(6)) + "," for start in (3, 40, 250)
)


@asynccontextmanager
async def served(**scheduler: object) -> AsyncIterator[tuple[AsyncClient, AsyncClient]]:
    """A server with the options, a client and a slow client (a small receive window)."""
    conf = settings(str(tiny_model_file()), n_parallel=4, n_ctx=16384, **scheduler)
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        target = f"127.0.0.1:{running.port}"
        async with (
            AsyncClient(target, timeout=300) as client,
            AsyncClient(target, timeout=300, options=SLOW_OPTIONS) as slow,
        ):
            yield client, slow


def generate(client: AsyncClient, prompt: str) -> AsyncIterator[object]:
    return aiter(client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


async def test_a_stopped_reader_pauses_alone_and_then_gets_its_exact_output() -> None:
    async with served(stream_buffer_tokens=BOUND, stalled_reader_s=0.0) as (client, slow):
        # solo runs: each token with its margin (batching numerics may flip a near tie: the
        # tokens up to the first one are checked exactly, as in the fault suite)
        alone = [await reference(client, p, MAX_TOKENS) for p in PROMPTS]
        assert all(ref.sound == MAX_TOKENS for ref in alone), [r.sound for r in alone]

        paused = generate(slow, PROMPTS[0])
        first = await anext(paused)  # then it stops reading
        assert isinstance(first, Delta)
        stats = await poll(client, lambda s: s.paused_streams == 1, polls=600)
        assert stats.paused_streams == 1
        others = asyncio.gather(*(collect(generate(client, p)) for p in PROMPTS[1:]))
        buffered: list[int] = []
        while not others.done():  # the paused stream's unread tokens while the others run
            stats = await client.stats()
            buffered += [s.buffered_tokens for s in stats.slots if s.buffered_tokens]
            await asyncio.sleep(0.05)
        got: list[Outcome] = await others
        for ref, outcome in zip(alone[1:], got, strict=True):
            assert outcome.error is None
            ref.check(outcome.token_ids)
        assert buffered and max(buffered) == BOUND, buffered
        stats = await client.stats()
        assert stats.paused_streams == 1 and stats.generating_slots == 1

        rest = await collect(paused)  # it reads again: the rest comes, exact
        assert rest.error is None and rest.done is not None
        alone[0].check(list(first.token_ids) + rest.token_ids)
        stats = await client.stats()
        assert stats.stream_pauses >= 1 and stats.stalled_readers == 0


async def test_a_reader_that_reads_nothing_is_ended_resource_exhausted() -> None:
    async with served(stream_buffer_tokens=BOUND, stalled_reader_s=1.0) as (client, slow):
        stalled = generate(slow, PROMPTS[0])
        first = await anext(stalled)
        assert isinstance(first, Delta)
        stats = await poll(client, lambda s: s.stalled_readers == 1, polls=600)
        assert stats.stalled_readers == 1 and stats.active_slots == 0, "its slot is free"
        assert stats.requests_failed == 1
        rest = await collect(stalled)  # what was sent before the end, then the status
        assert isinstance(rest.error, LlamaGrpcError)
        assert rest.error.code == "RESOURCE_EXHAUSTED"
        assert rest.error.reason == "STALLED_READER"
        assert "read nothing for 1 s" in rest.error.message
        assert rest.done is None
        assert 1 + len(rest.token_ids) < MAX_TOKENS
