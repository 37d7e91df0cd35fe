"""Speculative decoding on the real model (Gemma 3 270M): greedy output with and without drafts,
alone and in a mixed batch of eight, logprobs for every token, max_tokens, stop strings and
grammars inside drafts, usage and stats counts, a cancelled speculating stream, AUTO's
calibration.

The numerics caveat: a position verified inside a multi-token batch gets logits slightly
different from a one-token decode (llama.cpp's kernels depend on the batch shape), exactly as
batching with other requests already does (test_batching.py). Where the model's top two tokens
are that close, greedy output may differ: "The capital of France is" diverged at token 18 with
the x86-64-v3 build, where plain decoding had its top two 0.215 apart, and two other prompts
here diverged with the AVX-512 build. So identity is asserted up to such a near-tie
(tests/support/greedy.py): equal, or parted only where the plain run's top two were < 1 nat apart
and the speculating run took the second."""

from __future__ import annotations

import asyncio
import dataclasses

import llama_cpp
import pytest

from llama_grpc_server.core.requests.request import (
    Constraint,
    FinishReason,
    GenerationRequest,
    OutputParams,
    SpeculativeMode,
    SpeculativeParams,
    TokenDelta,
)
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_testkit.models import TINY_BOS, counting
from tests.support.greedy import assert_greedy_equal

from .conftest import Outcome, make_engine, make_tiny_engine, request, run, run_all, wait_idle

ON = SpeculativeParams(SpeculativeMode.ON)
OFF = SpeculativeParams(SpeculativeMode.OFF)

# Input-grounded: the continuation repeats text from the prompt, so drafts get accepted.
PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the reading room, the children's corner and the "
    "archive, but not the cafe."
)
GROUNDED = [
    f"Copy the text exactly.\nText: {PARAGRAPH}\nCopy: {PARAGRAPH}\nCopy:",
    "Name: Alice Smith\nCity: Paris\nAge: 34\n\nName: Alice Smith\nCity:",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,",
    "Q: What is the capital of Italy?\nA: Rome.\nQ: What is the capital of Italy?\nA:",
    "red, green, blue, red, green, blue, red, green, blue, red,",
    "<ul>\n  <li>apple</li>\n  <li>pear</li>\n  <li>plum</li>\n</ul>\n<ul>\n  <li>apple</li>\n",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;\nSELECT name, age FROM users WHERE",
]
# Free writing: fewer drafts, and those mostly rejected. (Not "The capital of France is": see
# the module docstring.)
FREE = [
    "Once upon a time, in a land far away,",
    "The history of the printing press begins",
    "def fibonacci(n):",
    "The quick brown fox",
    "In a distant galaxy, the explorers found",
]


def spec(
    engine: EngineLoop, prompt: str | list[int], mode: SpeculativeParams, **kw: object
) -> GenerationRequest:
    kw.setdefault("cache_prompt", False)  # a prefix hit would change the prompt's batch shapes
    return dataclasses.replace(request(engine, prompt, **kw), speculative=mode)  # type: ignore[arg-type]


REFERENCE = OutputParams(logprobs=True, top_logprobs=2)  # what assert_greedy_equal needs


def reference(engine: EngineLoop, prompt: str, **kw: object) -> GenerationRequest:
    """The request without speculation, with the top two logprobs of every step."""
    return dataclasses.replace(spec(engine, prompt, OFF, **kw), output=REFERENCE)


async def both(engine: EngineLoop, prompt: str, **kw: object) -> tuple[Outcome, Outcome]:
    off = await run(engine, reference(engine, prompt, **kw))
    on = await run(engine, spec(engine, prompt, ON, **kw))
    return off, on


def assert_same(off: Outcome, on: Outcome, what: str = "") -> None:
    assert_greedy_equal(off.token_ids, off.logprobs, on.token_ids, what)


@pytest.mark.parametrize("prompt", GROUNDED + FREE)
async def test_greedy_identity_alone(engine: EngineLoop, prompt: str) -> None:
    """B = 1: the same tokens with every draft verified as without drafts."""
    off, on = await both(engine, prompt, max_tokens=48)
    assert_same(off, on, prompt)
    assert on.finished.reason is off.finished.reason


async def test_drafts_are_accepted_on_grounded_prompts(engine: EngineLoop) -> None:
    """Copying prompts accept most draft tokens; usage and the stats totals count them."""
    before = engine.stats()
    outs = [await run(engine, spec(engine, p, ON, max_tokens=40)) for p in GROUNDED]
    after = engine.stats()
    drafted = sum(o.finished.usage.draft_tokens for o in outs)
    accepted = sum(o.finished.usage.accepted_draft_tokens for o in outs)
    assert drafted > 0 and accepted >= drafted // 2, (drafted, accepted)
    assert after.spec_draft_tokens - before.spec_draft_tokens == drafted
    assert after.spec_accepted_tokens - before.spec_accepted_tokens == accepted
    assert after.spec_ticks > before.spec_ticks


async def test_greedy_identity_in_a_mixed_batch_of_eight() -> None:
    """Eight concurrent input-grounded requests, half of them speculating (then all), produce
    what the same eight produce with no speculation at all."""
    eng = make_engine(n_parallel=8)
    try:

        def batch(modes: list[SpeculativeParams]) -> list[GenerationRequest]:
            return [
                dataclasses.replace(spec(eng, p, m, max_tokens=32), output=REFERENCE)
                for p, m in zip(GROUNDED, modes, strict=True)
            ]

        off = await run_all(eng, batch([OFF] * 8))
        mixed = await run_all(eng, batch([ON, OFF] * 4))
        every = await run_all(eng, batch([ON] * 8))
        for name, outs in (("mixed", mixed), ("every", every)):
            for p, ref, got in zip(GROUNDED, off, outs, strict=True):
                assert_same(ref, got, f"{name}: {p!r}")
        assert sum(o.finished.usage.draft_tokens for o in mixed) > 0
    finally:
        eng.close()


async def test_logprobs_for_every_emitted_token(engine: EngineLoop) -> None:
    """Tokens accepted from a draft carry their logprob and top alternatives like any other;
    the values agree with plain decoding within the batch-shape rounding."""
    output = OutputParams(logprobs=True, top_logprobs=2)

    async def go(mode: SpeculativeParams) -> tuple[list[int], list[float], int]:
        req = dataclasses.replace(spec(engine, GROUNDED[0], mode, max_tokens=24), output=output)
        tokens: list[int] = []
        logprobs: list[float] = []
        drafts = 0
        async for event in engine.submit(req):
            if isinstance(event, TokenDelta):
                assert len(event.logprobs) == len(event.token_ids)
                assert all(len(lp.top) == 2 for lp in event.logprobs)
                tokens += event.token_ids
                logprobs += [lp.logprob for lp in event.logprobs]
            else:
                drafts = event.usage.accepted_draft_tokens  # type: ignore[union-attr]
        return tokens, logprobs, drafts

    off_tokens, off_lps, _ = await go(OFF)
    on_tokens, on_lps, accepted = await go(ON)
    assert on_tokens == off_tokens and len(on_lps) == len(on_tokens) and accepted > 0
    assert max(abs(a - b) for a, b in zip(on_lps, off_lps, strict=True)) < 0.5


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
async def test_max_tokens_is_never_exceeded(engine: EngineLoop, max_tokens: int) -> None:
    out = await run(engine, spec(engine, GROUNDED[3], ON, max_tokens=max_tokens))
    assert len(out.token_ids) == max_tokens == out.finished.usage.completion_tokens
    assert out.finished.reason is FinishReason.MAX_TOKENS


async def test_stop_string_inside_a_draft(engine: EngineLoop) -> None:
    """The copy's stop string is met inside an accepted draft: the output ends where it ends
    without speculation."""
    off, on = await both(engine, GROUNDED[0], max_tokens=60, stop=("children",))
    assert on.text == off.text and on.finished.reason is FinishReason.STOP_SEQUENCE
    assert on.finished.usage.accepted_draft_tokens > 0


async def test_grammar_constrained_request_speculates_in_exact_match_mode(
    engine: EngineLoop,
) -> None:
    """Drafted tokens reach the grammar only once the sampler picked them: a constrained
    request speculates and its output equals the unspeculated one."""
    grammar = Constraint('root ::= [0-9, ]+ "."')

    async def go(mode: SpeculativeParams) -> Outcome:
        req = dataclasses.replace(
            spec(engine, GROUNDED[3], mode, max_tokens=30, ignore_eos=False), constraint=grammar
        )
        return await run(engine, req)

    off, on = await go(OFF), await go(ON)
    assert on.token_ids == off.token_ids
    assert on.finished.usage.draft_tokens > 0


def kv_differences(engine: EngineLoop) -> list[str]:
    """llama.cpp's own view against the slots': each idle sequence ends exactly where its
    slot's cache ends (a rejected draft token left behind shows as a higher position). []:
    they agree."""
    stats = engine.stats()
    memory = engine._runner.model.memory  # type: ignore[attr-defined]
    out = [f"{stats.active_slots} slots active"] if stats.active_slots else []
    for slot in stats.slots:
        end = llama_cpp.llama_memory_seq_pos_max(memory, slot.slot_id) + 1
        if end != slot.cached_tokens:
            out.append(f"slot {slot.slot_id}: sequence ends at {end}, cache {slot.cached_tokens}")
    if stats.kv_cells_used > sum(s.cached_tokens for s in stats.slots):
        out.append(f"{stats.kv_cells_used} KV cells used, more than the slots' caches")
    return out


async def assert_kv_holds_what_the_slots_say(engine: EngineLoop, within_s: float = 10.0) -> None:
    """Once the engine is idle, the KV cache comes to hold exactly what the slots say: polled,
    since a finished request's trim (the seq op that drops its rejected draft) runs on the
    engine thread's next tick, after its slot is already released (what wait_idle sees)."""
    await wait_idle(engine)
    for _ in range(int(within_s / 0.02)):
        if not kv_differences(engine):
            return
        await asyncio.sleep(0.02)
    assert not kv_differences(engine), f"after {within_s} s idle"


async def test_kv_cache_holds_no_rejected_draft_token(engine: EngineLoop) -> None:
    """After speculating requests that keep their cache (cache_prompt on), every sequence
    holds exactly the tokens its slot reports."""
    outs = await run_all(
        engine,
        [spec(engine, p, ON, max_tokens=40, cache_prompt=True) for p in [*GROUNDED[:2], FREE[1]]],
    )
    assert sum(o.finished.usage.draft_tokens - o.finished.usage.accepted_draft_tokens for o in outs)
    await assert_kv_holds_what_the_slots_say(engine)


async def test_cancelled_speculating_stream_frees_its_kv(engine: EngineLoop) -> None:
    """Cancel a copying stream mid-way: its slot goes idle keeping only accepted tokens as
    cache (llama.cpp's sequence ends where the slot says), and it stops generating."""
    await wait_idle(engine)  # earlier tests' slots settle
    stream = engine.submit(spec(engine, GROUNDED[0], ON, max_tokens=400, cache_prompt=True))
    seen = 0
    async for event in stream:
        if isinstance(event, TokenDelta):
            seen += len(event.token_ids)
        if seen >= 20:
            stream.cancel()
            break
    await assert_kv_holds_what_the_slots_say(engine)
    generated = engine.stats().generated_tokens
    # The engine ticks again for a next request: only that request's tokens are counted.
    after = await run(engine, spec(engine, FREE[0], ON, max_tokens=3, cache_prompt=False))
    await wait_idle(engine)
    assert engine.stats().generated_tokens == generated + len(after.token_ids)


async def test_auto_calibrates_and_speculates_on_a_copy() -> None:
    """A server speculating AUTO by default times decodes of 1 to draft_max + 2 rows at start
    (every count: the cost is not monotone) and drafts for a single copying stream."""
    eng = make_engine(n_parallel=2, speculative="auto")
    try:
        out = await run(eng, request(eng, GROUNDED[0], max_tokens=60, cache_prompt=False))
        points = dict(eng._scheduler.spec.costs.snapshot())
        assert set(range(1, 19)) <= set(points)
        assert 0 < points[1] < points[16]  # timed at start: ~2.5 s in all on 2 quiet cores
        assert out.finished.usage.draft_tokens > 0
        assert out.finished.usage.accepted_draft_tokens > 0.8 * out.finished.usage.draft_tokens
    finally:
        eng.close()


async def test_kv_pressure_while_speculating_completes_every_request() -> None:
    """A small KV cache and four speculating requests: drafts that find no KV slot are retried
    without drafts, preemption happens only for the requests themselves, and every request
    ends with exactly max_tokens tokens (none lost or repeated), each the tiny counting
    model's own output. Each prompt holds a counting run and then its first three tokens again,
    so the n-gram drafts find the rest of the run in the prompt."""
    eng = make_tiny_engine(n_parallel=4, n_ctx=512, cache_prompt=True)
    try:
        runs = [[TINY_BOS, *counting(300 + 150 * i, 120)] for i in range(4)]
        reqs = [spec(eng, run + run[1:4], ON, max_tokens=100) for run in runs]
        outs = await run_all(eng, reqs)
        assert [list(o.token_ids) for o in outs] == [counting(run[3], 100) for run in runs]
        assert all(o.finished.reason is FinishReason.MAX_TOKENS for o in outs)
        assert sum(o.finished.usage.draft_tokens for o in outs) > 0
        assert eng.stats().preemptions >= 1  # the cache was short
    finally:
        eng.close()


async def test_pads_in_odd_decode_ticks_keep_the_output_and_leave_no_kv() -> None:
    """Three greedy streams that do not speculate: an engine that pads its odd decode ticks
    (the default) padded them, produced what an engine that does not produced (the tiny
    counting model's own output: a padded tick is a 4-row pass, which must not move it), and no
    pad token stayed in any sequence. The padding engine keeps the costs the x86-64-v3 build
    measured on the development box (3 rows 42.8 ms, 4 rows 34.6) and learns none, so it pads
    whichever build and CPU run the test, and however loaded the machine is: what it checks is
    the padding, not this machine's decision."""
    runs = [[TINY_BOS, *counting(300 + 100 * i, 20)] for i in range(3)]

    def three(eng: EngineLoop) -> list[GenerationRequest]:
        return [spec(eng, run, OFF, max_tokens=48, cache_prompt=True) for run in runs]

    plain = make_tiny_engine(n_parallel=3, pad_decode_batches=False)
    try:
        unpadded = await run_all(plain, three(plain))
        assert plain._scheduler.counters.pad_rows == 0  # type: ignore[attr-defined]
    finally:
        plain.close()
    padded = make_tiny_engine(n_parallel=3, cache_prompt=True)
    costs = padded._scheduler.spec.costs  # type: ignore[attr-defined]
    costs.calibrate([(1, 12.7), (2, 25.5), (3, 42.8), (4, 34.6)])
    costs.observe = lambda rows, tick_ms: None
    try:
        outs = await run_all(padded, three(padded))
        assert padded._scheduler.counters.pad_rows > 20  # type: ignore[attr-defined]
        expected = [counting(run[-1], 48) for run in runs]
        assert [o.token_ids for o in unpadded] == [o.token_ids for o in outs] == expected
        await assert_kv_holds_what_the_slots_say(padded)
    finally:
        padded.close()
