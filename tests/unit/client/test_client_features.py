"""Client request building and result conversion for the generation features (logit bias,
logprobs, constraints, context overflow, chat), against scripted server behaviour (grpc_testing)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from llama_grpc import ChatMessage, Client, TokenLogprob, TopLogprob
from llama_grpc.client import build_request
from llama_grpc.types import delta_from_proto
from llama_grpc.v1 import llm_service_pb2 as pb
from tests.support.client import UnaryScript, channel, client, executor, unary

__all__ = ["channel", "client", "executor", "unary"]  # fixtures


def test_logit_bias_and_logprob_keywords_land_in_their_fields(
    client: Client, unary: UnaryScript
) -> None:
    """logit_bias fills the map (with -inf kept); logprobs/top_logprobs fill params.output."""
    _, request, _ = unary(
        lambda: client.generate(
            "p", logit_bias={3: -math.inf, 9: 2.5}, logprobs=True, top_logprobs=7
        ),
        "Generate",
        pb.GenerateResponse(),
    )
    assert dict(request.params.sampling.logit_bias) == {3: -math.inf, 9: 2.5}
    assert request.params.output.logprobs is True
    assert request.params.output.top_logprobs == 7


def test_result_carries_logprobs(client: Client, unary: UnaryScript) -> None:
    """GenerateResponse.logprobs become TokenLogprob values with their alternatives."""
    response = pb.GenerateResponse(
        token_ids=[5],
        logprobs=[
            pb.TokenLogprob(
                token_id=5,
                token="a",
                logprob=-0.5,
                top=[pb.TopLogprob(token_id=5, token="a", logprob=-0.5)],
            )
        ],
    )
    _, _, result = unary(lambda: client.generate("p"), "Generate", response)
    assert result.logprobs == (TokenLogprob(5, "a", -0.5, (TopLogprob(5, "a", -0.5),)),)


def test_delta_carries_logprobs() -> None:
    """A stream delta's logprobs are converted alongside its token ids."""
    delta = delta_from_proto(
        pb.GenerationDelta(
            text="a", token_ids=[5], logprobs=[pb.TokenLogprob(token_id=5, token="a", logprob=-1)]
        )
    )
    assert delta.logprobs == (TokenLogprob(5, "a", -1.0),)


def test_grammar_keywords_fill_the_constraint(client: Client, unary: UnaryScript) -> None:
    """grammar + grammar_root set params.grammar; nothing else of the oneof is set."""
    _, request, _ = unary(
        lambda: client.generate("p", grammar='start ::= "a"', grammar_root="start"),
        "Generate",
        pb.GenerateResponse(),
    )
    assert request.params.WhichOneof("constraint") == "grammar"
    assert (request.params.grammar.gbnf, request.params.grammar.root) == ('start ::= "a"', "start")


def test_json_schema_dict_is_sent_as_json_text(client: Client, unary: UnaryScript) -> None:
    """A schema given as a dict travels as its JSON text in params.json_schema."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _, request, _ = unary(
        lambda: client.generate("p", json_schema=schema), "Generate", pb.GenerateResponse()
    )
    assert request.params.WhichOneof("constraint") == "json_schema"
    assert json.loads(request.params.json_schema) == schema


@pytest.mark.parametrize(
    "params",
    [{"grammar": 'root ::= "a"', "json_schema": "{}"}, {"grammar_root": "start"}],
)
def test_contradictory_constraint_keywords_raise_before_any_rpc(
    client: Client, params: dict[str, Any]
) -> None:
    """Both grammar and json_schema, or a root without a grammar, is a ValueError."""
    with pytest.raises(ValueError, match="grammar"):
        client.generate("p", **params)


def test_context_overflow_keywords_fill_the_policy(client: Client, unary: UnaryScript) -> None:
    """context_overflow="truncate_left" and n_keep land in params.context_overflow."""
    _, request, _ = unary(
        lambda: client.generate("p", context_overflow="truncate_left", n_keep=4),
        "Generate",
        pb.GenerateResponse(),
    )
    overflow = request.params.context_overflow
    assert (overflow.policy, overflow.n_keep) == (pb.OVERFLOW_POLICY_TRUNCATE_LEFT, 4)


def test_unknown_context_overflow_raises_before_any_rpc(client: Client) -> None:
    """A misspelled policy is a ValueError, not a request."""
    with pytest.raises(ValueError, match="truncate_left"):
        client.generate("p", context_overflow="truncate")  # type: ignore[typeddict-item]


@pytest.mark.parametrize(
    ("priority", "expected"),
    [("low", pb.PRIORITY_LOW), ("normal", pb.PRIORITY_NORMAL), ("high", pb.PRIORITY_HIGH)],
)
def test_priority_maps_to_the_enum(
    client: Client, unary: UnaryScript, priority: Any, expected: int
) -> None:
    """priority="low" / "normal" / "high" lands in params.priority as PRIORITY_*."""
    _, request, _ = unary(
        lambda: client.generate("p", priority=priority), "Generate", pb.GenerateResponse()
    )
    assert request.params.priority == expected


def test_priority_left_out_stays_unspecified(client: Client, unary: UnaryScript) -> None:
    """Without priority the request carries PRIORITY_UNSPECIFIED (the server's default)."""
    _, request, _ = unary(
        lambda: client.generate("p", max_tokens=1), "Generate", pb.GenerateResponse()
    )
    assert request.params.priority == pb.PRIORITY_UNSPECIFIED


def test_token_requests_take_a_priority_too() -> None:
    """generate_tokens() requests are built with the same priority mapping."""
    request = build_request(pb.GenerateTokensRequest(token_ids=[1]), {"priority": "low"})
    assert request.params.priority == pb.PRIORITY_LOW


@pytest.mark.parametrize("priority", ["urgent", "HIGH", 3])
def test_unknown_priority_raises_before_any_rpc(priority: Any) -> None:
    """A priority other than low/normal/high is a ValueError naming the accepted values, raised
    while the request is built (so no call starts)."""
    with pytest.raises(ValueError, match="'low', 'normal' or 'high'"):
        build_request(pb.GenerateRequest(prompt="p"), {"priority": priority})


def test_truncation_is_reported_in_the_result(client: Client, unary: UnaryScript) -> None:
    """`truncated` and usage.truncated_prompt_tokens reach the GenerateResult."""
    response = pb.GenerateResponse(
        truncated=True, usage=pb.Usage(prompt_tokens=10, truncated_prompt_tokens=7)
    )
    _, _, result = unary(lambda: client.generate("p"), "Generate", response)
    assert result.truncated and result.usage.truncated_prompt_tokens == 7


def test_chat_sends_messages_in_any_accepted_shape(client: Client, unary: UnaryScript) -> None:
    """chat() takes ChatMessage values, mappings and (role, content) pairs, plus chat_template."""
    messages = [
        ChatMessage("system", "s"),
        {"role": "user", "content": "u"},
        ("assistant", "a"),
    ]
    _, request, _ = unary(
        lambda: client.chat(messages, chat_template="gemma", max_tokens=3),
        "Generate",
        pb.GenerateResponse(),
    )
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "s"),
        ("user", "u"),
        ("assistant", "a"),
    ]
    assert request.chat_template == "gemma" and request.prompt == ""
    assert request.params.stopping.max_tokens == 3


def test_cache_response_is_sent_only_when_given(client: Client, unary: UnaryScript) -> None:
    """cache_response=False reaches params (set, so the server sees the opt-out); left out it
    stays unset (the server's default: cache when possible); cached_response comes back."""
    response = pb.GenerateResponse(usage=pb.Usage(prompt_tokens=3, cached_response=True))
    _, request, result = unary(
        lambda: client.generate("p", cache_response=False), "Generate", response
    )
    assert request.params.HasField("cache_response") and not request.params.cache_response
    assert result.usage.cached_response
    plain = build_request(pb.GenerateTokensRequest(token_ids=[1]), {})
    assert not plain.params.HasField("cache_response")
