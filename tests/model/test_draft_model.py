"""Draft-model speculation on the real model: the embedded Gemma 3 270M drafting for itself
(--draft-model pointing at the same file), in batch-invariant mode so that a position's logits
do not depend on the pass it is computed in (the draft's one-row steps, the target's verifying
rows): greedy output identical to the target alone, alone and in a batch of three streams, and
every draft token accepted (a model drafting for itself greedily agrees with itself), counted
exactly; a draft model whose vocabulary is not the target's stops the start, naming the
difference; the tiny counting model drafting for itself through preemptions, prefix reuse and a
cancel, every draft accepted (a draft KV out of step would show as a rejection)."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import llama_cpp
import pytest

from llama_grpc_server.core.requests.request import (
    GenerationRequest,
    SpeculativeMode,
    SpeculativeParams,
    TokenDelta,
)
from llama_grpc_server.engine.draft import DraftModel
from llama_grpc_server.engine.llama import ModelLoadError
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.models.files import default_model_path
from llama_grpc_testkit.models import TINY_BOS, counting, tiny_model_file

from .conftest import Outcome, make_engine, make_tiny_engine, request, run, run_all, wait_idle

DRAFT_MAX = 4
ON_MODE = SpeculativeMode.ON
MAX_TOKENS = 16
# Tokens drafted (and accepted) for one request: after the prompt's pass gives the first token,
# each tick drafts min(DRAFT_MAX, max_tokens - generated - 1) and all are accepted, so the
# answer grows 1 -> 6 -> 11 -> 16, 4 each: 12.
EXPECTED_ACCEPTED = 3 * 4
PROMPTS = [
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The history of the printing press begins",
]


def spec(engine: EngineLoop, prompt: str, mode: SpeculativeMode) -> GenerationRequest:
    req = request(engine, prompt, max_tokens=MAX_TOKENS, cache_prompt=False)
    return dataclasses.replace(req, speculative=SpeculativeParams(mode))


Tokens = list[int]
Usage = tuple[int, int]  # (draft_tokens, accepted_draft_tokens)


@dataclasses.dataclass(frozen=True)
class GemmaOutcomes:
    """What the embedded model drafting for itself answered (_gemma_outcomes)."""

    single: tuple[Tokens, Tokens, Usage, Usage]  # plain, drafted, usage, GetStats' model share
    batch: list[tuple[Tokens, Tokens, Usage]]  # per prompt: plain, drafted, usage
    seeded: tuple[Tokens, Tokens, Usage]
    auto: tuple[Tokens, Tokens, int]  # plain, AUTO, model drafts during AUTO


@pytest.fixture(scope="module")
def gemma() -> GemmaOutcomes:
    """The Gemma scenarios run in a process of their own: --batch-invariant turns off ggml's
    tiled matmul with GGML_CPU_TILED_MM, which ggml reads once per process, so in a test worker
    that has run a forward pass already the mode is only partly on and a 15-row verifying pass
    may round otherwise than 3 one-row decodes (the full suite saw a last token differ)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_gemma_outcomes).result(timeout=600)


def _gemma_outcomes() -> GemmaOutcomes:
    return asyncio.run(_gemma_outcomes_async())


async def _gemma_outcomes_async() -> GemmaOutcomes:
    engine = make_engine(
        draft_model=str(default_model_path()),
        batch_invariant=True,
        n_parallel=3,
        n_ctx=1024,
        draft_max=DRAFT_MAX,
    )
    try:
        return GemmaOutcomes(
            single=await _single(engine),
            batch=await _batch(engine),
            seeded=await _seeded(engine),
            auto=await _auto(engine),
        )
    finally:
        engine.close()


def _usage(outcome: Outcome) -> Usage:
    usage = outcome.finished.usage
    return (usage.draft_tokens, usage.accepted_draft_tokens)


async def _single(engine: EngineLoop) -> tuple[Tokens, Tokens, Usage, Usage]:
    before = engine.stats()
    plain = await run(engine, spec(engine, PROMPTS[0], SpeculativeMode.OFF))
    drafted = await run(engine, spec(engine, PROMPTS[0], ON_MODE))
    after = engine.stats()
    stats = (
        after.spec_model_draft_tokens - before.spec_model_draft_tokens,
        after.spec_model_accepted_tokens - before.spec_model_accepted_tokens,
    )
    return list(plain.token_ids), list(drafted.token_ids), _usage(drafted), stats


async def _batch(engine: EngineLoop) -> list[tuple[Tokens, Tokens, Usage]]:
    plain = await run_all(engine, [spec(engine, p, SpeculativeMode.OFF) for p in PROMPTS])
    drafted = await run_all(engine, [spec(engine, p, ON_MODE) for p in PROMPTS])
    return [
        (list(p.token_ids), list(d.token_ids), _usage(d))
        for p, d in zip(plain, drafted, strict=True)
    ]


async def _seeded(engine: EngineLoop) -> tuple[Tokens, Tokens, Usage]:
    prompt = PROMPTS[2]
    plain, drafted = [
        await run(
            engine,
            dataclasses.replace(
                req, sampling=dataclasses.replace(req.sampling, temperature=0.9, seed=7)
            ),
        )
        for req in (spec(engine, prompt, SpeculativeMode.OFF), spec(engine, prompt, ON_MODE))
    ]
    return list(plain.token_ids), list(drafted.token_ids), _usage(drafted)


async def _auto(engine: EngineLoop) -> tuple[Tokens, Tokens, int]:
    before = engine.stats().spec_model_draft_tokens
    plain = await run(engine, spec(engine, PROMPTS[1], SpeculativeMode.OFF))
    auto = await run(engine, spec(engine, PROMPTS[1], SpeculativeMode.AUTO))
    drafts = engine.stats().spec_model_draft_tokens - before
    return list(plain.token_ids), list(auto.token_ids), drafts


def test_a_model_drafting_for_itself_gives_the_same_greedy_answer_all_accepted(
    gemma: GemmaOutcomes,
) -> None:
    plain, drafted, usage, stats = gemma.single
    assert len(plain) == MAX_TOKENS
    assert drafted == plain
    assert usage == stats == (EXPECTED_ACCEPTED, EXPECTED_ACCEPTED)


def test_three_streams_draft_in_one_pass_with_the_same_answers(gemma: GemmaOutcomes) -> None:
    for plain, drafted, usage in gemma.batch:
        assert drafted == plain
        assert usage == (EXPECTED_ACCEPTED, EXPECTED_ACCEPTED)


def test_a_seeded_sampled_answer_is_the_same_with_the_draft_model(gemma: GemmaOutcomes) -> None:
    """Sampled: the draft token is kept only where the target's own draw at that position
    (seeded: a function of the seed and the position) gives it, so the answer is the target's,
    drafts or not."""
    plain, drafted, (draft_tokens, accepted) = gemma.seeded
    assert drafted == plain
    assert draft_tokens > 0
    assert accepted <= draft_tokens


def test_auto_does_not_draft_with_a_model_as_dear_as_the_target(gemma: GemmaOutcomes) -> None:
    """A model drafting for itself costs a target's decode per drafted token: it never pays, and
    AUTO drafts none with it (prompt lookup it may still use)."""
    plain, auto, model_drafts = gemma.auto
    assert auto == plain
    assert model_drafts == 0


def test_a_draft_model_of_another_vocabulary_stops_the_start() -> None:
    with pytest.raises(ModelLoadError, match="n_vocab differs: target 262144, draft 1024"):
        make_engine(draft_model=str(tiny_model_file()), n_ctx=256)


async def test_kept_in_step_through_preemption_prefix_reuse_and_cancel() -> None:
    """The tiny counting model drafting for itself, on a KV cache too small for its four
    streams (preemptions; the draft context, as small, drops slots that are not drafting), then
    the same prompts again (their prefixes restored into the target's KV only), then a stream
    cancelled mid-answer and its slot reused: every answer is the model's own, every draft token
    is accepted (the counting model's greedy token wins by several nats in any batch), and the
    draft context's KV holds, for every slot, exactly the positions the drafter says it holds.
    (The counting model's next token depends on the last token alone, so the Gemma tests above
    are the ones where a draft KV out of step would show as rejections.)"""
    eng = make_tiny_engine(
        n_parallel=4, n_ctx=512, cache_prompt=True, draft_model=str(tiny_model_file())
    )
    try:
        runs = [[TINY_BOS, *counting(300 + 150 * i, 120)] for i in range(4)]
        for _ in range(2):
            reqs = [tiny_spec(eng, run, max_tokens=100) for run in runs]
            outs = await run_all(eng, reqs)
            assert [list(o.token_ids) for o in outs] == [counting(run[-1], 100) for run in runs]
            for out in outs:
                usage = out.finished.usage
                assert usage.draft_tokens > 0
                assert usage.accepted_draft_tokens == usage.draft_tokens
            assert_draft_kv_as_held(eng)
        assert eng.stats().preemptions >= 1
        stream = eng.submit(tiny_spec(eng, runs[0][:50], max_tokens=200))
        async for event in stream:
            if isinstance(event, TokenDelta):
                stream.cancel()
                break
        await wait_idle(eng)
        outs = await run_all(eng, [tiny_spec(eng, runs[0][:40], max_tokens=60)])
        assert list(outs[0].token_ids) == counting(runs[0][39], 60)
        usage = outs[0].finished.usage
        assert usage.accepted_draft_tokens == usage.draft_tokens > 0
        stats = eng.stats()
        assert stats.spec_model_accepted_tokens == stats.spec_model_draft_tokens > 0
        assert_draft_kv_as_held(eng)
    finally:
        eng.close()


def assert_draft_kv_as_held(engine: EngineLoop) -> None:
    """Each slot's draft KV ends at position len(held) - 1, as the drafter says (its start is
    not asked: a sliding-window cache reports the window's)."""
    drafter = engine._scheduler.spec.drafter
    assert isinstance(drafter, DraftModel)
    memory = drafter.model.memory
    for slot_id in range(drafter.model.n_seq_max):
        held = drafter.held.get(slot_id, [])
        pos_max = int(llama_cpp.llama_memory_seq_pos_max(memory, slot_id))
        assert pos_max == len(held) - 1, (slot_id, pos_max, len(held))


def tiny_spec(engine: EngineLoop, prompt: list[int], *, max_tokens: int) -> GenerationRequest:
    req = request(engine, prompt, max_tokens=max_tokens)
    return dataclasses.replace(req, speculative=SpeculativeParams(SpeculativeMode.ON))
