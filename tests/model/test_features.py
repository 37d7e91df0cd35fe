"""Generation features on the real model, through the engine: logprobs, logit bias, grammar
and JSON-schema constraints, chat templates (the logprob and bias mechanics that do not compare
outputs across batches: on the tiny synthetic model)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest

from llama_grpc_server.config import ModelSettings, Settings
from llama_grpc_server.core.requests.chat import ChatMessage
from llama_grpc_server.core.requests.request import (
    Constraint,
    Failed,
    FinishReason,
    GenerationRequest,
    OutputParams,
    TokenLogprob,
)
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_testkit.threads import TEST_THREADS
from tests.support.greedy import assert_greedy_equal

from ..conftest import PERSON_SCHEMA, YES_NO, check_person
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
    tiny_engine: EngineLoop,
) -> None:
    """Greedy with top_logprobs=5: one entry per token, logprobs <= 0, alternatives sorted
    most likely first, and the sampled token is the top-1 with the same logprob."""
    engine = tiny_engine
    # both uncached: the same forward passes, so the tiny model's near ties fall the same way
    out = await run(engine, request(engine, PROMPT, max_tokens=12, cache_prompt=False))
    entries = await logprobs_of(
        engine,
        with_output(request(engine, PROMPT, max_tokens=12, cache_prompt=False), top_logprobs=5),
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
    """The same greedy request with and without logprobs yields the same tokens (up to a
    near-tie: the two need not share every pass, e.g. when one finds the prompt cached from the
    other or starts a pass later, tests/support/greedy.py); without, no entries are produced."""
    plain = request(engine, PROMPT, max_tokens=16)
    asking = dataclasses.replace(
        with_output(plain, logprobs=True, top_logprobs=2), request_id=plain.request_id + "lp"
    )
    a, b = await run_all(engine, [plain, asking])
    assert len(b.logprobs) == len(b.token_ids) == 16
    assert_greedy_equal(b.token_ids, b.logprobs, a.token_ids, "without logprobs")
    assert await logprobs_of(engine, request(engine, PROMPT, max_tokens=16)) == []
    entries = await logprobs_of(
        engine, with_output(request(engine, PROMPT, max_tokens=16), logprobs=True)
    )
    assert len(entries) == 16 and all(not e.top for e in entries)


async def test_sampled_token_is_among_top_alternatives_at_temperature(
    tiny_engine: EngineLoop,
) -> None:
    """With top_k 5 sampling and top_logprobs 20, every sampled token is one of the top 20."""
    engine = tiny_engine
    req = request(engine, PROMPT, max_tokens=16, temperature=0.9, seed=3)
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, top_k=5))
    for entry in await logprobs_of(engine, with_output(req, top_logprobs=20)):
        assert entry.token_id in {t.token_id for t in entry.top}


async def test_banned_token_never_appears(tiny_engine: EngineLoop) -> None:
    """logit_bias -inf on the greedy completion's most frequent token removes it entirely."""
    engine = tiny_engine
    base = request(engine, PROMPT, max_tokens=24)
    free = await run(engine, base)
    banned, _ = Counter(free.token_ids).most_common(1)[0]
    out = await run(engine, with_bias(base, {banned: -math.inf}))
    assert banned not in out.token_ids
    assert len(out.token_ids) == 24


async def test_positive_bias_forces_a_token(tiny_engine: EngineLoop) -> None:
    """A large positive bias makes greedy pick that token every step."""
    engine = tiny_engine
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


# -- grammar constraints --------------------------------------------------------------------------


def constrained(req: GenerationRequest, gbnf: str, root: str = "root") -> GenerationRequest:
    return dataclasses.replace(req, constraint=Constraint(gbnf, root))


def ending_on_eos(req: GenerationRequest) -> GenerationRequest:
    """The model-test helper ignores EOS by default; a grammar ends on it."""
    return dataclasses.replace(req, stopping=dataclasses.replace(req.stopping, ignore_eos=False))


async def test_json_schema_output_parses_and_validates(engine: EngineLoop) -> None:
    """Greedy with a JSON schema yields JSON that validates, and ends with EOS once complete."""
    gbnf = engine.json_schema_to_grammar(json.dumps(PERSON_SCHEMA))
    prompt = "Describe a person as JSON:"
    out = await run(
        engine, ending_on_eos(constrained(request(engine, prompt, max_tokens=120), gbnf))
    )
    check_person(json.loads(out.text))
    assert out.finished.reason is FinishReason.EOS


async def test_yes_no_grammar_is_obeyed_across_seeds(engine: EngineLoop) -> None:
    """A (yes|no) grammar at temperature 1 gives exactly "yes" or "no" for 20 seeds, then EOS."""
    reqs = [
        ending_on_eos(
            constrained(
                request(engine, "Is the sky blue?", max_tokens=8, temperature=1.0, seed=seed),
                YES_NO,
            )
        )
        for seed in range(20)
    ]
    outs = await run_all(engine, reqs)
    assert {o.text for o in outs} <= {"yes", "no"}
    assert all(o.finished.reason is FinishReason.EOS for o in outs)


async def test_grammar_next_to_free_text_does_not_leak(engine: EngineLoop) -> None:
    """A grammar request batched with a free-text one: the free one equals its solo run, the
    constrained one obeys its grammar."""
    free = request(engine, PROMPT, max_tokens=16)
    alone = await run(engine, free)
    digits = ending_on_eos(constrained(request(engine, PROMPT, max_tokens=16), "root ::= [0-9]+"))
    together, constrained_out = await run_all(
        engine, [dataclasses.replace(free, request_id=free.request_id + "b"), digits]
    )
    assert together.token_ids == alone.token_ids
    assert constrained_out.text.isdigit()


async def test_grammar_with_every_allowed_token_banned_fails_cleanly(engine: EngineLoop) -> None:
    """When logit_bias bans every token the grammar allows, the request fails with a reason
    (no llama.cpp abort) and the engine keeps serving."""
    yes_ids = set(engine.tokenize("yes", add_special=False, parse_special=False))
    first_pieces = [
        t for t in range(engine.model_info.n_vocab) if engine.token_piece(t) in ("y", "ye", "yes")
    ]
    ban = dict.fromkeys(yes_ids | set(first_pieces), -math.inf)
    req = with_bias(constrained(request(engine, "Answer:", max_tokens=4), 'root ::= "yes"'), ban)
    out = await run(engine, req)
    assert isinstance(out.final, Failed)
    assert "allows no token" in out.final.error.message
    assert out.final.error.field == "params.grammar.gbnf"
    after = await run(engine, request(engine, PROMPT, max_tokens=4))
    assert len(after.token_ids) == 4


async def test_finished_grammar_with_ignore_eos_keeps_to_end_of_generation(
    engine: EngineLoop,
) -> None:
    """ignore_eos past a completed grammar only ever yields end-of-generation tokens (the only
    ones a finished grammar allows): no abort, and the text stays the grammar's."""
    req = constrained(request(engine, "Is the sky blue?", max_tokens=6), YES_NO)
    out = await run(engine, req)
    assert out.text in ("yes", "no")
    assert out.finished.reason is FinishReason.MAX_TOKENS
    eog = set(engine.model_info.eog_token_ids)
    tail = out.token_ids[len(engine.tokenize(out.text, add_special=False, parse_special=False)) :]
    assert tail and set(tail) <= eog


# -- chat templates -------------------------------------------------------------------------------

CONVERSATION = (
    ChatMessage("system", "Answer in one word."),
    ChatMessage("user", "Capital of France?"),
    ChatMessage("assistant", "Paris."),
    ChatMessage("user", "And of Italy?"),
)
GEMMA_PROMPT = (
    "<bos><start_of_turn>user\nAnswer in one word.\n\nCapital of France?<end_of_turn>\n"
    "<start_of_turn>model\nParis.<end_of_turn>\n"
    "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


def test_gemma_template_renders_the_expected_prompt(engine: EngineLoop) -> None:
    """The built-in gemma template folds the system message into the first user turn, spells the
    assistant "model", opens the model's turn, and starts with exactly one BOS token."""
    text = engine.render_chat(CONVERSATION, "gemma")
    assert text == GEMMA_PROMPT
    ids = engine.tokenize(text, add_special=False, parse_special=True)
    bos = engine.model_info.bos_token_id
    assert ids[0] == bos and bos not in ids[1:]
    start_of_turn = engine.tokenize("<start_of_turn>", add_special=False, parse_special=True)
    assert len(start_of_turn) == 1 and ids.count(start_of_turn[0]) == 4


def test_chatml_template_renders_the_expected_prompt(engine: EngineLoop) -> None:
    """chatml writes one <|im_start|>role block per message and opens the assistant's."""
    text = engine.render_chat(CONVERSATION[1:2], "chatml")
    assert text == "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_template_errors_are_value_errors(engine: EngineLoop) -> None:
    """A template's own raise_exception (roles out of order) and a missing GGUF template are
    ValueErrors with the reason, for the servicer to turn into INVALID_ARGUMENT."""
    with pytest.raises(ValueError, match="alternate"):
        engine.render_chat((ChatMessage("assistant", "hi"),), "gemma")
    with pytest.raises(ValueError, match="gguf"):
        engine.render_chat(CONVERSATION, "gguf")


def test_embedded_model_gets_its_familys_template_unless_configured(engine: EngineLoop) -> None:
    """Gemma 3 270M (base) ships no template: the default engine uses the gemma3 family's
    built-in and says why; one built with chat_template="chatml" reports that instead."""
    info = engine.model_info
    assert (info.chat_template, info.has_chat_template) == ("gemma", False)
    assert info.chat_template_origin.startswith("built-in, the gemma3 family's")
    model = ModelSettings(n_ctx=512, n_batch=128, n_threads=TEST_THREADS, chat_template="chatml")
    settings = Settings(model=model)
    configured = build_engine(settings)
    try:
        assert configured.model_info.chat_template == "chatml"
        assert configured.model_info.chat_template_origin == "configured (--chat-template)"
    finally:
        configured.close()
