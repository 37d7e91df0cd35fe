"""Generation features through gRPC with the real model: logprobs, logit bias, grammar and
JSON-schema constraints, context overflow, and their validation errors."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from typing import Any

import pytest

from llama_grpc import (
    AsyncClient,
    ContextLengthExceededError,
    Delta,
    Done,
    InvalidArgumentError,
)

PROMPT = "The three primary colors are"


async def test_unary_logprobs_greedy(client: AsyncClient) -> None:
    """Generate with top_logprobs: one entry per token, <= 0, sorted, top-1 is the greedy token."""
    result = await client.generate(PROMPT, max_tokens=8, ignore_eos=True, top_logprobs=4)
    assert [e.token_id for e in result.logprobs] == list(result.token_ids)
    for entry in result.logprobs:
        values = [t.logprob for t in entry.top]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert entry.logprob <= 0.0 and entry.top[0].token_id == entry.token_id
        assert math.isclose(entry.logprob, entry.top[0].logprob, abs_tol=1e-6)


async def test_stream_deltas_carry_logprobs(client: AsyncClient) -> None:
    """Each stream delta carries one logprob per token id; the stream equals the unary call."""
    whole = await client.generate(PROMPT, max_tokens=8, ignore_eos=True, logprobs=True)
    streamed = []
    async for event in client.stream(PROMPT, max_tokens=8, ignore_eos=True, logprobs=True):
        if isinstance(event, Delta):
            assert len(event.logprobs) == len(event.token_ids)
            streamed += event.logprobs
        else:
            assert isinstance(event, Done)
    assert [(e.token_id, e.logprob) for e in streamed] == [
        (e.token_id, e.logprob) for e in whole.logprobs
    ]
    assert all(not e.top for e in streamed)


async def test_no_logprobs_unless_asked(client: AsyncClient) -> None:
    """A plain request carries no logprob entries."""
    result = await client.generate(PROMPT, max_tokens=4, ignore_eos=True)
    assert result.logprobs == ()


async def test_logit_bias_bans_a_token(client: AsyncClient) -> None:
    """-inf on the greedy completion's most frequent token keeps it out of the output."""
    free = await client.generate(PROMPT, max_tokens=16, ignore_eos=True)
    banned, _ = Counter(free.token_ids).most_common(1)[0]
    result = await client.generate(
        PROMPT, max_tokens=16, ignore_eos=True, logit_bias={banned: -math.inf}
    )
    assert banned not in result.token_ids and len(result.token_ids) == 16


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_logprobs": 21}, "params.output.top_logprobs"),
        ({"logit_bias": {10**7: 1.0}}, "params.sampling.logit_bias[10000000]"),
        ({"logit_bias": {5: math.nan}}, "params.sampling.logit_bias[5]"),
    ],
)
async def test_bad_feature_values_name_the_field(
    client: AsyncClient, params: dict[str, object], field: str
) -> None:
    """Out-of-range logprobs / bias values are INVALID_ARGUMENT naming the field."""
    with pytest.raises(InvalidArgumentError) as caught:
        await client.generate(PROMPT, max_tokens=4, **params)  # type: ignore[arg-type]
    assert caught.value.field == field


# -- structured output ----------------------------------------------------------------------------

YES_NO = 'root ::= "yes" | "no"'
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}


async def test_json_schema_output_parses_and_validates(client: AsyncClient) -> None:
    """A greedy request with a JSON schema returns JSON with exactly the schema's keys and types."""
    result = await client.generate(
        "Describe a person as JSON:", max_tokens=120, json_schema=PERSON_SCHEMA
    )
    value = json.loads(result.text)
    assert set(value) == {"name", "age", "member"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert type(value["age"]) is int and type(value["member"]) is bool
    assert result.finish_reason == "eos"


async def test_yes_no_grammar_is_obeyed_across_20_seeds(client: AsyncClient) -> None:
    """At temperature 1, every one of 20 seeds answers exactly "yes" or "no" (streamed too)."""

    async def one(seed: int) -> str:
        text = ""
        async for event in client.stream(
            "Is water wet?", max_tokens=8, temperature=1.0, seed=seed, grammar=YES_NO
        ):
            if isinstance(event, Delta):
                text += event.text
        return text

    answers = await asyncio.gather(*(one(seed) for seed in range(20)))
    assert set(answers) <= {"yes", "no"}


async def test_invalid_grammar_is_rejected_and_the_server_keeps_serving(
    client: AsyncClient,
) -> None:
    """A bad grammar is INVALID_ARGUMENT with llama.cpp's parser message and the field; the next
    request is served."""
    with pytest.raises(InvalidArgumentError) as caught:
        await client.generate(PROMPT, max_tokens=4, grammar='root ::= "a" | undefined-rule')
    assert caught.value.field == "params.grammar.gbnf"
    assert "Undefined rule identifier 'undefined-rule'" in str(caught.value)
    with pytest.raises(InvalidArgumentError) as caught:
        await client.generate(PROMPT, max_tokens=4, grammar=YES_NO, grammar_root="answer")
    assert caught.value.field == "params.grammar.root"
    with pytest.raises(InvalidArgumentError) as caught:
        await client.generate(PROMPT, max_tokens=4, json_schema='{"type": ')
    assert caught.value.field == "params.json_schema"
    result = await client.generate(PROMPT, max_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4


async def test_grammar_next_to_free_text_in_one_batch(client: AsyncClient) -> None:
    """A grammar request and a free-text request running together do not leak into each other:
    the free one equals its solo run, the constrained one obeys its grammar."""
    solo = await client.generate(PROMPT, max_tokens=16, ignore_eos=True)
    free, digits = await asyncio.gather(
        client.generate(PROMPT, max_tokens=16, ignore_eos=True),
        client.generate(PROMPT, max_tokens=16, grammar="root ::= [0-9]+"),
    )
    assert free.token_ids == solo.token_ids
    assert digits.text.isdigit()


async def test_generate_tokens_honours_a_grammar(client: AsyncClient) -> None:
    """The pre-tokenized path takes the same constraint."""
    ids = await client.tokenize("Is fire hot?", add_special=True)
    text = ""
    async for event in client.generate_tokens(ids, max_tokens=8, grammar=YES_NO):
        if isinstance(event, Delta):
            text += event.text
    assert text in ("yes", "no")


# -- context overflow -----------------------------------------------------------------------------


async def test_truncate_left_keeps_the_tail_and_reports_it(client: AsyncClient) -> None:
    """A prompt longer than the context: reject by default; truncate_left keeps BOS + n_keep and
    the newest tokens, says so, and generates exactly what that truncated prompt generates."""
    n_ctx = (await client.model_info()).n_ctx
    ids = await client.tokenize("word " * (n_ctx + 100), add_special=True)
    assert len(ids) > n_ctx
    with pytest.raises(ContextLengthExceededError):
        await collect_ids(client.generate_tokens(ids, max_tokens=8))
    n_keep, budget = 3, n_ctx - 8
    # cache_prompt=False: both runs compute their prompt from scratch, so they must agree.
    stream = client.generate_tokens(
        ids,
        max_tokens=8,
        ignore_eos=True,
        cache_prompt=False,
        context_overflow="truncate_left",
        n_keep=n_keep,
    )
    out, done = await collect_ids(stream)
    assert done.truncated
    assert done.usage.truncated_prompt_tokens == len(ids) - budget
    assert done.usage.prompt_tokens == budget
    kept = ids[: 1 + n_keep] + ids[len(ids) - (budget - 1 - n_keep) :]
    same, _ = await collect_ids(
        client.generate_tokens(kept, max_tokens=8, ignore_eos=True, cache_prompt=False)
    )
    assert out == same and len(out) == 8


async def collect_ids(stream: Any) -> tuple[list[int], Done]:
    ids: list[int] = []
    done = None
    async for event in stream:
        if isinstance(event, Delta):
            ids += event.token_ids
        else:
            done = event
    assert isinstance(done, Done)
    return ids, done
