"""Real Gemma 3 270M through the engine: determinism, seeds, stops, tokenization."""

from __future__ import annotations

from dataclasses import replace

from llama_grpc_server.core.requests.request import FinishReason
from llama_grpc_server.engine.loop import EngineLoop

from .conftest import request, run

PROMPT = "The capital of France is"


async def test_greedy_is_deterministic(engine: EngineLoop) -> None:
    """The same greedy request twice gives the same tokens and text."""
    a = await run(engine, request(engine, PROMPT, cache_prompt=False))
    b = await run(engine, request(engine, PROMPT, cache_prompt=False))
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.token_ids) == 24 and a.finished.reason is FinishReason.MAX_TOKENS


async def test_seed_reproduces_sampled_completion(engine: EngineLoop) -> None:
    """temperature 1 with a fixed seed reproduces; another seed gives another completion."""
    a = await run(engine, request(engine, PROMPT, temperature=1.0, seed=42, max_tokens=32))
    b = await run(engine, request(engine, PROMPT, temperature=1.0, seed=42, max_tokens=32))
    c = await run(engine, request(engine, PROMPT, temperature=1.0, seed=7, max_tokens=32))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert a.finished.seed == 42


async def test_stop_string_cuts_output(engine: EngineLoop) -> None:
    """A stop string taken from the greedy output ends generation right before it."""
    full = await run(engine, request(engine, PROMPT, max_tokens=32))
    words = full.text.split()
    stop = " " + words[3]
    cut = await run(engine, request(engine, PROMPT, max_tokens=32, stop=(stop,)))
    assert cut.finished.reason is FinishReason.STOP_SEQUENCE
    assert cut.finished.matched_stop == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text


async def test_tokenize_detokenize_round_trip(engine: EngineLoop) -> None:
    """Tokenize then detokenize gives back the text, including multi-byte characters."""
    text = "Grüße aus Köln — 東京 😀 and plain ASCII."
    ids = engine.tokenize(text, add_special=False, parse_special=False)
    assert engine.detokenize(ids, render_special=False) == text
    with_bos = engine.tokenize(text, add_special=True, parse_special=False)
    assert with_bos[0] == engine.model_info.bos_token_id and with_bos[1:] == ids


async def test_eos_ends_generation_without_ignore_eos(tiny_engine: EngineLoop) -> None:
    """Without ignore_eos, an end-of-generation token ends the request with EOS (not emitted);
    with ignore_eos it does not. On the tiny model, whose free greedy run never picks EOS here,
    with a logit bias making EOS the argmax."""
    engine = tiny_engine
    eos = engine.model_info.eos_token_id
    assert eos in engine.model_info.eog_token_ids
    free = await run(engine, request(engine, PROMPT, max_tokens=6, ignore_eos=False))
    assert free.finished.reason is FinishReason.MAX_TOKENS and len(free.token_ids) == 6
    req = request(engine, PROMPT, max_tokens=6, ignore_eos=False)
    biased = replace(req, sampling=replace(req.sampling, logit_bias=((eos, 1000.0),)))
    out = await run(engine, biased)
    assert out.finished.reason is FinishReason.EOS
    assert out.finished.matched_token_id == eos
    assert out.token_ids == [] and out.finished.usage.completion_tokens == 0
    ignoring = replace(biased, stopping=replace(biased.stopping, ignore_eos=True))
    assert (await run(engine, ignoring)).finished.reason is FinishReason.MAX_TOKENS
