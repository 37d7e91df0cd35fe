"""Generation features on the real model, through the engine: logprobs, logit bias."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from llama_grpc_server.core.request import GenerationRequest, OutputParams, TokenLogprob
from llama_grpc_server.loop import EngineLoop

from .conftest import request, run, run_all

PROMPT = "The capital of France is"


def with_output(req: GenerationRequest, **output: object) -> GenerationRequest:
    return dataclasses.replace(req, output=OutputParams(**output))  # type: ignore[arg-type]


def with_bias(req: GenerationRequest, bias: dict[int, float]) -> GenerationRequest:
    sampling = dataclasses.replace(req.sampling, logit_bias=tuple(sorted(bias.items())))
    return dataclasses.replace(req, sampling=sampling)


async def logprobs_of(engine: EngineLoop, req: GenerationRequest) -> list[TokenLogprob]:
    """The logprob entries of every delta of one request (its token ids are in entry order)."""
    entries: list[TokenLogprob] = []
    async for event in engine.submit(req):
        entries += getattr(event, "logprobs", ())
    return entries


async def test_greedy_logprobs_are_sorted_and_top1_is_the_sampled_token(
    engine: EngineLoop,
) -> None:
    """Greedy with top_logprobs=5: one entry per token, logprobs <= 0, alternatives sorted
    most likely first, and the sampled token is the top-1 with the same logprob."""
    out = await run(engine, request(engine, PROMPT, max_tokens=12))
    entries = await logprobs_of(
        engine, with_output(request(engine, PROMPT, max_tokens=12), top_logprobs=5)
    )
    assert [e.token_id for e in entries] == out.token_ids
    for entry in entries:
        assert entry.logprob <= 0.0
        assert len(entry.top) == 5
        values = [t.logprob for t in entry.top]
        assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)
        assert entry.top[0].token_id == entry.token_id
        assert math.isclose(entry.top[0].logprob, entry.logprob, abs_tol=1e-6)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-4
        assert entry.token == engine.token_piece(entry.token_id)


async def test_asking_for_logprobs_does_not_change_the_output(engine: EngineLoop) -> None:
    """The same greedy request with and without logprobs yields the same tokens; without, no
    entries are produced."""
    plain = request(engine, PROMPT, max_tokens=16)
    asking = dataclasses.replace(
        with_output(plain, logprobs=True), request_id=plain.request_id + "lp"
    )
    a, b = await run_all(engine, [plain, asking])
    assert a.token_ids == b.token_ids
    assert await logprobs_of(engine, request(engine, PROMPT, max_tokens=16)) == []
    entries = await logprobs_of(
        engine, with_output(request(engine, PROMPT, max_tokens=16), logprobs=True)
    )
    assert len(entries) == 16 and all(not e.top for e in entries)


async def test_sampled_token_is_among_top_alternatives_at_temperature(engine: EngineLoop) -> None:
    """With top_k 5 sampling and top_logprobs 20, every sampled token is one of the top 20."""
    req = request(engine, PROMPT, max_tokens=16, temperature=0.9, seed=3)
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, top_k=5))
    for entry in await logprobs_of(engine, with_output(req, top_logprobs=20)):
        assert entry.token_id in {t.token_id for t in entry.top}


async def test_banned_token_never_appears(engine: EngineLoop) -> None:
    """logit_bias -inf on the greedy completion's most frequent token removes it entirely."""
    base = request(engine, PROMPT, max_tokens=24)
    free = await run(engine, base)
    banned, _ = Counter(free.token_ids).most_common(1)[0]
    out = await run(engine, with_bias(base, {banned: -math.inf}))
    assert banned not in out.token_ids
    assert len(out.token_ids) == 24


async def test_positive_bias_forces_a_token(engine: EngineLoop) -> None:
    """A large positive bias makes greedy pick that token every step."""
    forced = engine.tokenize(" banana", add_special=False, parse_special=False)[0]
    out = await run(engine, with_bias(request(engine, PROMPT, max_tokens=5), {forced: 100.0}))
    assert out.token_ids == [forced] * 5


async def test_bias_and_logprobs_do_not_leak_into_a_neighbour(engine: EngineLoop) -> None:
    """A biased request with logprobs batched next to a plain one leaves the plain one's
    output identical to running it alone, and without logprobs."""
    plain = request(engine, PROMPT, max_tokens=16)
    alone = await run(engine, plain)
    banned = alone.token_ids[0]
    special = with_output(
        with_bias(request(engine, PROMPT, max_tokens=16), {banned: -math.inf}), top_logprobs=3
    )
    neighbour, biased = await run_all(
        engine, [dataclasses.replace(plain, request_id="n1"), special]
    )
    assert neighbour.token_ids == alone.token_ids
    assert banned not in biased.token_ids
