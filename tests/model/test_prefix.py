"""Prefix caching on the real model: LCP reuse, shared system prompt prefilled once, RAM tier
save/restore round trip, cache scopes."""

from __future__ import annotations

from llama_grpc_server.core.kv.prefix_cache import common_prefix_length
from llama_grpc_server.engine.loop import EngineLoop

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


async def test_refused_partial_removal_recomputes_instead_of_reusing_stale_kv() -> None:
    """If llama_memory_seq_rm refuses to drop a cache's tail (as recurrent memory does), the
    slot is emptied and the request re-prefills from scratch: correct output, nothing reported
    as cached, never a decode over stale cells."""
    eng = make_engine(n_parallel=1)
    model = eng._runner.model
    real_remove = model.seq_remove
    refused: list[tuple[int, int]] = []

    def refuse_partial(seq_id: int, p0: int, p1: int = -1) -> bool:
        if p0 > 0:
            refused.append((seq_id, p0))
            return False
        return real_remove(seq_id, p0, p1)

    try:
        base = "Partial removal test. " + STORY * 3
        await run(eng, request(eng, base + "What did he see?", max_tokens=6))
        model.seq_remove = refuse_partial  # type: ignore[method-assign]
        edited = request(eng, base + "Why was he alone?", max_tokens=12)
        warm = await run(eng, edited)
        model.seq_remove = real_remove  # type: ignore[method-assign]
        cold = await run(
            eng, request(eng, list(edited.prompt_tokens), max_tokens=12, cache_prompt=False)
        )
    finally:
        eng.close()
    assert refused, "the edited prompt needed a partial removal"
    assert warm.finished.usage.cached_prompt_tokens == 0
    assert warm.token_ids == cold.token_ids
