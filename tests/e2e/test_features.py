"""Generation features through gRPC with the real model: logprobs, logit bias, and their
validation errors."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from llama_grpc import AsyncClient, Delta, Done, InvalidArgumentError

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
