"""Generation features through gRPC with the real model: logprobs, logit bias, grammar and
JSON-schema constraints, context overflow, chat messages, and their validation errors."""

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
from tests.support.fault_support import reference

from ..conftest import PERSON_SCHEMA, YES_NO, check_person

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


async def test_json_schema_output_parses_and_validates(client: AsyncClient) -> None:
    """A greedy request with a JSON schema returns JSON with exactly the schema's keys and types."""
    result = await client.generate(
        "Describe a person as JSON:", max_tokens=120, json_schema=PERSON_SCHEMA
    )
    check_person(json.loads(result.text))
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
    the free one equals its solo run (wherever the solo run's top-2 margin is wide enough that
    batching numerics cannot flip the argmax), the constrained one obeys its grammar."""
    prompt = "Counting by 1: 7, 8, 9, 10, 11, 12,"  # wide top-2 margins at every step
    solo = await reference(client, prompt, 16)
    assert solo.sound >= 8, solo
    free, digits = await asyncio.gather(
        client.generate(prompt, max_tokens=16, ignore_eos=True),
        client.generate(prompt, max_tokens=16, grammar="root ::= [0-9]+"),
    )
    solo.check(list(free.token_ids))
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


async def test_truncate_left_keeps_the_tail_and_reports_it(tiny_client: AsyncClient) -> None:
    """A prompt longer than the context: reject by default; truncate_left keeps BOS + n_keep and
    the newest tokens and says so. The kept tokens are exactly those: sent again as a prompt,
    all but the last come from the prefix cache the truncated request left behind. (On the tiny
    model: two 4k-token prefills.)"""
    client = tiny_client
    n_ctx = (await client.model_info()).n_ctx
    text = "Count: " + " ".join(str(i) for i in range(n_ctx))
    ids = await client.tokenize(text, add_special=True)
    assert len(ids) > n_ctx
    with pytest.raises(ContextLengthExceededError):
        await collect_ids(client.generate_tokens(ids, max_tokens=8))
    n_keep, budget = 3, n_ctx - 8
    stream = client.generate_tokens(
        ids, max_tokens=8, ignore_eos=True, context_overflow="truncate_left", n_keep=n_keep
    )
    out, done = await collect_ids(stream)
    assert done.truncated and len(out) == 8
    assert done.usage.truncated_prompt_tokens == len(ids) - budget
    assert done.usage.prompt_tokens == budget
    kept = ids[: 1 + n_keep] + ids[len(ids) - (budget - 1 - n_keep) :]
    _, again = await collect_ids(client.generate_tokens(kept, max_tokens=1))
    assert again.usage.cached_prompt_tokens == len(kept) - 1
    assert not again.truncated


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


# -- chat -----------------------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France?"},
]
CHAT_PROMPT = (
    "<bos><start_of_turn>user\nAnswer in one word.\n\nCapital of France?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


async def test_the_embedded_model_chats_with_gemmas_template_by_default(
    client: AsyncClient,
) -> None:
    """The embedded base model has no template of its own; its family (gemma3) has a built-in,
    which it gets with none configured: GetModelInfo says "gemma", and messages without a
    chat_template render exactly as with chat_template="gemma". (A model with neither is
    FAILED_PRECONDITION naming messages: tests/unit/core/test_generation_features.py.)"""
    info = await client.model_info()
    assert (info.chat_template, info.has_chat_template) == ("gemma", False)
    expected = await client.tokenize(CHAT_PROMPT, add_special=False, parse_special=True)
    reply = await client.chat(CHAT, max_tokens=4, ignore_eos=True)
    named = await client.chat(CHAT, chat_template="gemma", max_tokens=4, ignore_eos=True)
    assert reply.usage.prompt_tokens == len(expected)
    assert list(reply.token_ids) == list(named.token_ids)


async def test_chat_renders_through_the_template_with_one_bos(client: AsyncClient) -> None:
    """chat() with chat_template="gemma" generates exactly what the hand-rendered prompt
    generates as token ids, and its prompt has the same length (one BOS, not two)."""
    expected = await client.tokenize(CHAT_PROMPT, add_special=False, parse_special=True)
    bos = (await client.model_info()).bos_token_id
    assert expected[0] == bos and bos not in expected[1:]
    reply = await client.chat(CHAT, chat_template="gemma", max_tokens=8, ignore_eos=True)
    direct, _ = await collect_ids(client.generate_tokens(expected, max_tokens=8, ignore_eos=True))
    assert list(reply.token_ids) == direct
    assert reply.usage.prompt_tokens == len(expected)
    streamed, done = await collect_ids(
        client.stream_chat(CHAT, chat_template="gemma", max_tokens=8, ignore_eos=True)
    )
    assert streamed == direct and done.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        ({"messages": CHAT, "chat_template": "nope"}, "chat_template"),
        (
            {"messages": [{"role": "robot", "content": "x"}], "chat_template": "gemma"},
            "messages[0].role",
        ),
        (
            {"messages": [{"role": "assistant", "content": "x"}], "chat_template": "gemma"},
            "messages",
        ),
        ({"prompt": "hi", "chat_template": "gemma"}, "chat_template"),
    ],
)
async def test_bad_chat_requests_name_the_field(
    client: AsyncClient, call: dict[str, Any], field: str
) -> None:
    """Unknown template or role, a template refusing the turn order, a template without messages:
    INVALID_ARGUMENT naming the field."""
    if "messages" in call:
        messages = call.pop("messages")
        with pytest.raises(InvalidArgumentError) as caught:
            await client.chat(messages, max_tokens=4, **call)
    else:
        with pytest.raises(InvalidArgumentError) as caught:
            await client.generate(call.pop("prompt"), max_tokens=4, **call)
    assert caught.value.field == field


# -- exact finish reasons -------------------------------------------------------------------------


async def test_stream_done_names_the_matched_stop_string(client: AsyncClient) -> None:
    """With logprobs on, a stop string taken from the greedy output ends the stream with
    stop_sequence, the string in the final message, and logprobs only for emitted tokens."""
    free = await client.generate(PROMPT, max_tokens=24, ignore_eos=True)
    stop = " " + free.text.split()[3]
    text, logprobs, done = "", 0, None
    async for event in client.stream(PROMPT, max_tokens=24, stop=[stop], logprobs=True):
        if isinstance(event, Delta):
            text += event.text
            logprobs += len(event.logprobs)
        else:
            done = event
    assert isinstance(done, Done)
    assert (done.finish_reason, done.matched_stop) == ("stop_sequence", stop)
    assert text == free.text[: free.text.index(stop)]
    assert logprobs == done.usage.completion_tokens


async def test_stream_done_names_the_matched_stop_token(client: AsyncClient) -> None:
    """A stop token id ends with stop_token and its id; the token itself is not emitted."""
    free = await client.generate(PROMPT, max_tokens=12, ignore_eos=True)
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    ids, done = await collect_ids(
        client.stream(PROMPT, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    )
    assert (done.finish_reason, done.matched_token_id) == ("stop_token", stop_id)
    assert ids == list(free.token_ids[:first])


async def test_completed_grammar_ends_with_eos_and_its_token(client: AsyncClient) -> None:
    """A grammar that completes ends with eos, naming the end-of-generation token; one cut
    short ends with max_tokens."""
    eog = set((await client.model_info()).eog_token_ids)
    ids, done = await collect_ids(client.stream("Is ice cold?", max_tokens=8, grammar=YES_NO))
    assert done.finish_reason == "eos" and done.matched_token_id in eog
    assert not eog & set(ids)
    _, cut = await collect_ids(
        client.stream("Count:", max_tokens=3, grammar='root ::= "1 2 3 4 5 6 7 8 9"')
    )
    assert cut.finish_reason == "max_tokens" and cut.matched_token_id is None
