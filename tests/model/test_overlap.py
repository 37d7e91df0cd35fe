"""--overlap-decode: a tick's events are published and delivered while the next forward pass runs
(loop.EngineLoop._tick). On this CPU build nothing overlaps, but the switch must change no output:
the same plans, the same greedy tokens, whatever the delivery timing. On the tiny counting model
(llama_grpc_testkit.models), whose output is known whatever the batch: on the real model a loaded
box once split a burst over two passes (the engine thread ticked between two submissions), and a
near-tie then flipped a token."""

from __future__ import annotations

import asyncio

from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_testkit.models import counting

from .conftest import Outcome, make_tiny_engine, request, run_all

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1969, the first",
    "My favourite recipe for bread",
]


async def burst(engine: EngineLoop) -> list[Outcome]:
    """Six greedy requests of different lengths on six slots, submitted together, without
    prefix reuse: one prefill pass, then decode passes of 6, 5, ..., 1 rows."""
    reqs = [
        request(engine, p, max_tokens=6 + 3 * i, cache_prompt=False) for i, p in enumerate(PROMPTS)
    ]
    outs = await run_all(engine, reqs)  # each submits before it first waits: one burst
    for req, out in zip(reqs, outs, strict=True):  # each its own, not another request's
        assert out.token_ids == counting(req.prompt_tokens[-1], req.stopping.max_tokens)
    return outs


async def two_bursts(overlap: str) -> list[list[Outcome]]:
    """A fresh engine's outputs for two bursts, the second over the KV cells and idle slots
    the first left. Every pass is the same whatever the timing: all requests start in the
    first pass (no prefill allowance, which follows measured costs, splits a prompt later) and
    no pass is padded (pads follow measured costs too), so the outputs must be equal bit for
    bit, not only up to a near-tie (tests/support/greedy.py)."""
    engine = await asyncio.to_thread(
        make_tiny_engine, n_parallel=len(PROMPTS), overlap_decode=overlap, pad_decode_batches=False
    )
    try:
        assert engine._overlap_decode is (overlap == "on")
        return [await burst(engine), await burst(engine)]
    finally:
        await asyncio.to_thread(engine.close)


async def test_overlap_decode_gives_the_same_greedy_tokens() -> None:
    """Two engines, the overlap off and on, run the same two bursts: every request's tokens,
    finish reason and usage are identical."""
    want = await two_bursts("off")
    got = await two_bursts("on")
    for want_burst, got_burst in zip(want, got, strict=True):
        assert [len(o.token_ids) for o in got_burst] == [6 + 3 * i for i in range(len(PROMPTS))]
        for w, g in zip(want_burst, got_burst, strict=True):
            assert g.token_ids == w.token_ids
            assert (g.finished.reason, g.finished.usage) == (w.finished.reason, w.finished.usage)


def test_overlap_decode_auto_is_off_on_a_cpu_build(engine: EngineLoop) -> None:
    assert engine._overlap_decode is False
