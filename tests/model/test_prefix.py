"""Prefix caching on the real model: LCP reuse, shared system prompt prefilled once, RAM tier
save/restore round trip, cache scopes."""

from __future__ import annotations

from llama_grpc_server.core.prefix_cache import common_prefix_length
from llama_grpc_server.loop import EngineLoop

from .conftest import make_engine, request, run, run_all

STORY = "The lighthouse keeper counted the ships that passed in the night, one by one. "


async def test_edited_prompt_reuses_exactly_the_common_prefix(engine: EngineLoop) -> None:
    """After a request, an edited prompt keeps exactly the LCP with what the slot holds."""
    base = "Edited-prompt test. " + STORY * 4
    first = await run(engine, request(engine, base + "What did he see?", max_tokens=8))
    a_tokens = engine.tokenize(base + "What did he see?", add_special=True, parse_special=False)
    b_tokens = engine.tokenize(base + "Why was he alone?", add_special=True, parse_special=False)
    expected = common_prefix_length([*a_tokens, *first.token_ids], b_tokens)
    assert 0 < expected < len(b_tokens) - 1
    second = await run(engine, request(engine, b_tokens, max_tokens=8))
    assert second.finished.usage.cached_prompt_tokens == expected


async def test_shared_system_prompt_is_prefilled_once() -> None:
    """Four requests arriving together with one long shared system prompt: it is computed once
    and copied (seq_cp) to the other slots; outputs equal those of cold runs."""
    eng = make_engine(n_parallel=4)
    try:
        system = "System: you are a careful assistant. " + STORY * 6
        questions = ["Who?", "What?", "When?", "Where?"]
        prompts = [system + "Question: " + q for q in questions]
        shared = common_prefix_length(
            *(eng.tokenize(p, add_special=True, parse_special=False) for p in prompts[:2])
        )
        assert shared > 100
        warm = await run_all(eng, [request(eng, p, max_tokens=8) for p in prompts])
        cached = sorted(o.finished.usage.cached_prompt_tokens for o in warm)
        assert cached[0] == 0 and all(c >= shared - 1 for c in cached[1:]), cached
        stats = eng.stats()
        computed = stats.prompt_tokens - stats.cached_prompt_tokens
        assert computed < 2 * shared, (computed, shared)
        cold = [await run(eng, request(eng, p, max_tokens=8, cache_prompt=False)) for p in prompts]
        assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    finally:
        eng.close()


async def test_ram_tier_save_restore_round_trip() -> None:
    """One slot: an unrelated request evicts a long cache, which the RAM tier saves; asking the
    first prompt again restores it (no recompute) and gives the same greedy output."""
    eng = make_engine(n_parallel=1, prompt_cache_ram_mb=64)
    try:
        long_prompt = "RAM tier test. " + STORY * 5
        first = await run(eng, request(eng, long_prompt, max_tokens=12))
        await run(eng, request(eng, "Something else entirely: " + "apples and pears " * 8))
        stats = eng.stats()
        assert stats.ram_cache_entries == 1 and stats.ram_cache_bytes > 0
        again = await run(eng, request(eng, long_prompt, max_tokens=12))
        n = again.finished.usage.prompt_tokens
        assert again.finished.usage.cached_prompt_tokens == n - 1
        assert again.token_ids == first.token_ids
        assert eng.stats().ram_cache_hits == 1
    finally:
        eng.close()


async def test_cache_scopes_never_share(engine: EngineLoop) -> None:
    """The same prompt in another scope reuses nothing; in its own scope it reuses everything."""
    prompt = "Scoped prompt. " + STORY * 3
    await run(engine, request(engine, prompt, max_tokens=4, cache_scope="tenant-a"))
    other = await run(engine, request(engine, prompt, max_tokens=4, cache_scope="tenant-b"))
    same = await run(engine, request(engine, prompt, max_tokens=4, cache_scope="tenant-a"))
    assert other.finished.usage.cached_prompt_tokens == 0
    n = same.finished.usage.prompt_tokens
    assert same.finished.usage.cached_prompt_tokens == n - 1
