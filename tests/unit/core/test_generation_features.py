"""Generation features without a model: validation of logit_bias / logprobs / constraints, the
scheduler carrying logprobs and constraint failures between runner and events, and conversion."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.config import SchedulerSettings
from llama_grpc_server.config.loading import ConfigError, load_settings
from llama_grpc_server.core.requests.chat import ChatMessage
from llama_grpc_server.core.requests.request import (
    Constraint,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputParams,
    Request,
    SamplingParams,
    StoppingParams,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from llama_grpc_server.core.scheduling.plan import SampledLogprob, StepPlan, StepResult
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.rpc.shared import checks
from llama_grpc_server.rpc.v1 import convert, validation
from llama_grpc_server.testing import N_VOCAB, FakeEngine, FakeRunner, fake_model_info

INFO = fake_model_info(n_ctx=64)
LIMITS = SchedulerSettings(default_max_tokens=16)


def text_request(**params: Any) -> GenerationRequest:
    message = pb.GenerateRequest(prompt="hi", params=pb.GenerationParams(**params))
    checked = validation.parse_text_request(message, INFO, LIMITS)
    return checks.complete_request(checked, [1, 2, 3], request_id="r", deadline=None)


def invalid(**params: Any) -> errors.ServiceError:
    with pytest.raises(errors.InvalidRequest) as caught:
        text_request(**params)
    return caught.value


# -- validation -------------------------------------------------------------------------------


def test_logit_bias_is_kept_sorted_with_minus_inf() -> None:
    """A bias map becomes sorted (id, bias) pairs; -inf (a ban) passes through."""
    request = text_request(sampling=pb.SamplingParams(logit_bias={7: -math.inf, 3: 1.5}))
    assert request.sampling.logit_bias == ((3, 1.5), (7, -math.inf))


@pytest.mark.parametrize("bias", [math.nan, math.inf])
def test_logit_bias_rejects_nan_and_plus_inf(bias: float) -> None:
    """NaN and +inf are not biases: INVALID_ARGUMENT naming the token's entry."""
    error = invalid(sampling=pb.SamplingParams(logit_bias={5: bias}))
    assert error.field == "params.sampling.logit_bias[5]"
    assert "finite number or -inf" in error.message


def test_logit_bias_rejects_a_token_outside_the_vocabulary() -> None:
    """A bias on a token id past the vocabulary names that id."""
    error = invalid(sampling=pb.SamplingParams(logit_bias={N_VOCAB: 1.0}))
    assert error.field == f"params.sampling.logit_bias[{N_VOCAB}]"
    assert f"the vocabulary has {N_VOCAB} tokens" in error.message


def test_logit_bias_rejects_too_many_entries() -> None:
    """More than MAX_LOGIT_BIAS entries is refused as a whole."""
    n = checks.MAX_LOGIT_BIAS + 1
    big = fake_model_info(n_ctx=64)
    message = pb.GenerateRequest(
        prompt="hi",
        params=pb.GenerationParams(
            sampling=pb.SamplingParams(logit_bias=dict.fromkeys(range(n), 1.0))
        ),
    )
    with pytest.raises(errors.InvalidRequest) as caught:
        validation.parse_text_request(message, big, LIMITS)
    assert caught.value.field == "params.sampling.logit_bias"
    assert f"{n} entries" in caught.value.message


def test_top_logprobs_above_twenty_is_rejected() -> None:
    """top_logprobs is capped at 20, and the error names the field."""
    error = invalid(output=pb.OutputOptions(top_logprobs=21))
    assert error.field == "params.output.top_logprobs"
    assert "at most 20, got 21" in error.message


def test_output_options_reach_the_request() -> None:
    """logprobs / top_logprobs pass through; top_logprobs alone implies logprobs."""
    assert text_request().output == OutputParams()
    assert not text_request().output.wants_logprobs
    request = text_request(output=pb.OutputOptions(top_logprobs=5))
    assert request.output == OutputParams(False, 5) and request.output.wants_logprobs
    assert text_request(output=pb.OutputOptions(logprobs=True)).output.wants_logprobs


# -- scheduler --------------------------------------------------------------------------------


class LogprobRunner(FakeRunner):
    """A FakeRunner that reports a logprob for every sampled token of the slots it is told."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: dict[str, OutputParams] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for spec in plan.open_samplers:
            self.opened[spec.request_id] = spec.output
        result = super().execute(plan)
        logprobs = {
            slot: SampledLogprob(-0.5, ((token, -0.5), (token + 1, -1.25)))
            for slot, token in result.sampled.items()
        }
        return StepResult(sampled=result.sampled, logprobs=logprobs)


def test_scheduler_attaches_logprobs_to_each_delta() -> None:
    """Sampled logprobs become TokenLogprob values (with pieces) on the token's own delta,
    and the runner learns which requests asked for them."""
    pieces = [f"<{i}>".encode() for i in range(97)]
    s = Scheduler(SchedulerLimits(1, 256, 64), pieces=pieces, eog_ids=frozenset())
    spec = GenerationRequest(
        "a",
        (1, 2, 3),
        SamplingParams(temperature=0.0),
        StoppingParams(max_tokens=3),
        output=OutputParams(top_logprobs=2),
    )
    s.add(Request(spec))
    runner = LogprobRunner()
    deltas: list[TokenDelta] = []
    for _ in range(10):
        plan, _ = s.schedule()
        if plan is None:
            break
        deltas += [e for _, e in s.update(plan, runner.execute(plan)) if isinstance(e, TokenDelta)]
    assert runner.opened == {"a": OutputParams(top_logprobs=2)}
    with_tokens = [d for d in deltas if d.token_ids]
    assert len(with_tokens) == 3
    for delta in with_tokens:
        (token,) = delta.token_ids
        (lp,) = delta.logprobs
        assert lp == TokenLogprob(
            token,
            f"<{token}>",
            -0.5,
            (TopLogprob(token, f"<{token}>", -0.5), TopLogprob(token + 1, f"<{token + 1}>", -1.25)),
        )


# -- convert ----------------------------------------------------------------------------------

LOGPROB = TokenLogprob(5, "a", -0.25, (TopLogprob(5, "a", -0.25), TopLogprob(6, "b", -2.0)))


def test_delta_carries_logprobs_to_the_wire() -> None:
    """Each TokenLogprob becomes a proto TokenLogprob with its top alternatives in order."""
    message = convert.generation_delta(TokenDelta((5,), "a", (LOGPROB,)))
    (lp,) = message.logprobs
    assert (lp.token_id, lp.token, lp.logprob) == (5, "a", -0.25)
    assert [(t.token_id, t.token, t.logprob) for t in lp.top] == [(5, "a", -0.25), (6, "b", -2.0)]


def test_unary_response_joins_logprobs_of_all_deltas() -> None:
    """GenerateResponse.logprobs lists every delta's entries, in order."""
    from tests.support.convert import finished

    second = TokenLogprob(6, "b", -1.0)
    deltas = [
        TokenDelta((5,), "a", (LOGPROB,)),
        TokenDelta((), ""),
        TokenDelta((6,), "b", (second,)),
    ]
    response = convert.generate_response("r", deltas, finished())
    assert [lp.token_id for lp in response.logprobs] == [5, 6]
    assert not response.logprobs[1].top


# -- constraints --------------------------------------------------------------------------------

GRAMMARS = FakeEngine()  # its stand-in parser: every line needs "::=", the root rule must exist


def constrained_request(**params: Any) -> GenerationRequest:
    message = pb.GenerateTokensRequest(token_ids=[5, 6], params=pb.GenerationParams(**params))
    checked = validation.parse_tokens_request(message, INFO, LIMITS, grammars=GRAMMARS)
    return checks.complete_request(checked, checked.prompt_tokens, request_id="c", deadline=None)


def constraint_error(**params: Any) -> errors.ServiceError:
    with pytest.raises(errors.ServiceError) as caught:
        constrained_request(**params)
    return caught.value


def test_grammar_becomes_a_constraint_with_its_root() -> None:
    """A valid grammar reaches the request as GBNF with its root (default "root")."""
    request = constrained_request(grammar=pb.Grammar(gbnf='root ::= "a"'))
    assert request.constraint == Constraint('root ::= "a"', "root", "params.grammar.gbnf")
    other = constrained_request(grammar=pb.Grammar(gbnf='start ::= "a"', root="start"))
    assert other.constraint is not None and other.constraint.root == "start"


def test_json_schema_is_converted_once_at_validation() -> None:
    """A JSON schema arrives at the engine already as GBNF; errors point at params.json_schema."""
    request = constrained_request(json_schema='{"type": "object"}')
    assert request.constraint == Constraint('root ::= "{}"', "root", "params.json_schema")


@pytest.mark.parametrize(
    ("params", "field", "text"),
    [
        ({"grammar": pb.Grammar(gbnf="root = x")}, "params.grammar.gbnf", "expecting ::="),
        ({"grammar": pb.Grammar(gbnf="  ")}, "params.grammar.gbnf", "must not be empty"),
        (
            {"grammar": pb.Grammar(gbnf='root ::= "a"', root="start")},
            "params.grammar.root",
            "does not contain a 'start' symbol",
        ),
        ({"json_schema": '{"type": '}, "params.json_schema", "JSONDecodeError"),
        ({"json_schema": "[1]"}, "params.json_schema", "must be a JSON object"),
        ({"json_schema": ""}, "params.json_schema", "must not be empty"),
        (
            {"json_schema": "x" * (checks.MAX_CONSTRAINT_CHARS + 1)},
            "params.json_schema",
            "at most 100000",
        ),
    ],
)
def test_bad_constraint_is_invalid_argument_naming_the_field(
    params: dict[str, Any], field: str, text: str
) -> None:
    """Invalid grammars and schemas are INVALID_ARGUMENT with the parser's message."""
    error = constraint_error(**params)
    assert type(error) is errors.InvalidRequest
    assert error.field == field
    assert text in error.message


def test_constraint_without_a_compiler_is_a_failed_precondition() -> None:
    """Validation without the engine's compiler refuses constraints instead of skipping them."""
    message = pb.GenerateRequest(
        prompt="hi", params=pb.GenerationParams(grammar=pb.Grammar(gbnf='root ::= "a"'))
    )
    with pytest.raises(errors.FailedPrecondition) as caught:
        validation.parse_text_request(message, INFO, LIMITS)
    assert caught.value.field == "params.grammar.gbnf"


class DeadEndRunner(FakeRunner):
    """Reports that the constraint allowed no token at the second sample."""

    def __init__(self) -> None:
        super().__init__()
        self.samples = 0
        self.constraints: list[Constraint | None] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.constraints += [spec.constraint for spec in plan.open_samplers]
        result = super().execute(plan)
        if not result.sampled:
            return result
        self.samples += 1
        if self.samples < 2:
            return result
        return StepResult(failed=dict.fromkeys(result.sampled, "no token allowed"))


def test_a_constraint_dead_end_fails_only_that_request() -> None:
    """The runner's "no token allowed" ends the request with INVALID_ARGUMENT on the
    constraint's field, frees the slot, and the sampler receives the constraint."""
    s = Scheduler(
        SchedulerLimits(1, 256, 64), pieces=[b"x"] * 97, eog_ids=frozenset(), strategy=None
    )
    constraint = Constraint('root ::= "x"', "root", "params.json_schema")
    spec = GenerationRequest(
        "a", (1, 2), SamplingParams(temperature=0.0), StoppingParams(8), constraint=constraint
    )
    s.add(Request(spec))
    runner = DeadEndRunner()
    events = []
    for _ in range(10):
        plan, _ = s.schedule()
        if plan is None:
            break
        events += [e for _, e in s.update(plan, runner.execute(plan))]
    assert runner.constraints == [constraint]
    failed = events[-1]
    assert isinstance(failed, Failed)
    assert failed.error.field == "params.json_schema"
    assert "no token allowed (after 1 generated tokens)" in failed.error.message
    assert all(slot.request is None for slot in s.slots)


# -- context overflow -----------------------------------------------------------------------------

BOS = INFO.bos_token_id


def overflow_request(
    prompt: list[int], max_tokens: int | None = None, **overflow: Any
) -> GenerationRequest:
    stopping = pb.StoppingCriteria(max_tokens=max_tokens) if max_tokens else None
    message = pb.GenerateTokensRequest(
        token_ids=prompt,
        params=pb.GenerationParams(
            stopping=stopping, context_overflow=pb.ContextOverflow(**overflow)
        ),
    )
    checked = validation.parse_tokens_request(message, INFO, LIMITS)
    return checks.complete_request(checked, checked.prompt_tokens, request_id="o", deadline=None)


TRUNCATE = pb.OVERFLOW_POLICY_TRUNCATE_LEFT


def test_truncate_left_keeps_bos_head_and_newest_tail() -> None:
    """70 tokens into a 64-token context with max_tokens 10: BOS + n_keep=2 stay, then the newest
    51 tokens; 16 are dropped and reported."""
    prompt = [BOS, *range(10, 79)]
    request = overflow_request(prompt, 10, policy=TRUNCATE, n_keep=2)
    assert request.prompt_tokens == (BOS, 10, 11, *prompt[-51:])
    assert len(request.prompt_tokens) + request.stopping.max_tokens == 64
    assert request.num_truncated == 70 - 54


def test_truncate_left_without_bos_or_n_keep_keeps_only_the_tail() -> None:
    """No BOS and n_keep 0: exactly the newest n_ctx - max_tokens tokens remain."""
    prompt = list(range(10, 110))
    request = overflow_request(prompt, 4, policy=TRUNCATE)
    assert request.prompt_tokens == tuple(prompt[-60:])
    assert request.num_truncated == 40


def test_truncate_left_uses_the_default_max_tokens_when_unset() -> None:
    """With max_tokens unset the prompt is cut to leave the server default's room."""
    request = overflow_request(list(range(10, 110)), policy=TRUNCATE)
    assert len(request.prompt_tokens) == 64 - LIMITS.default_max_tokens
    assert request.stopping.max_tokens == LIMITS.default_max_tokens


def test_truncate_left_leaves_a_fitting_prompt_alone() -> None:
    """A prompt that fits is not touched and reports nothing dropped."""
    request = overflow_request([BOS, 10, 11], 10, policy=TRUNCATE, n_keep=1)
    assert request.prompt_tokens == (BOS, 10, 11) and request.num_truncated == 0


def test_reject_is_the_default_and_names_the_numbers() -> None:
    """Without a policy an overflowing prompt is still CONTEXT_LENGTH_EXCEEDED with numbers."""
    with pytest.raises(errors.PromptTooLong) as caught:
        overflow_request(list(range(10, 70)), 10)
    assert caught.value.metadata == {"prompt_tokens": "60", "max_tokens": "10", "n_ctx": "64"}


@pytest.mark.parametrize(
    ("overflow", "field", "text"),
    [
        ({"policy": TRUNCATE, "n_keep": 60}, "params.context_overflow.n_keep", "allows 54 prompt"),
        ({"n_keep": 3}, "params.context_overflow.n_keep", "only applies with"),
        ({"policy": 7}, "params.context_overflow.policy", "unknown context overflow policy 7"),
    ],
)
def test_bad_overflow_settings_name_the_field(
    overflow: dict[str, int], field: str, text: str
) -> None:
    """n_keep that leaves no tail, n_keep without truncation, an unknown policy."""
    with pytest.raises(errors.InvalidRequest) as caught:
        overflow_request([BOS, *range(10, 79)], 10, **overflow)
    assert caught.value.field == field
    assert text in caught.value.message


def test_truncation_is_reported_on_the_wire() -> None:
    """usage.truncated_prompt_tokens and `truncated` reach both the unary and the final message."""
    from tests.support.convert import TIMINGS

    usage = Usage(54, 3, 0, truncated_prompt_tokens=16)
    done = Finished(FinishReason.MAX_TOKENS, usage, TIMINGS, seed=1)
    response = convert.generate_response("r", [], done)
    assert response.truncated and response.usage.truncated_prompt_tokens == 16
    final = convert.generation_done(done, "r")
    assert final.truncated and final.usage.truncated_prompt_tokens == 16
    plain = convert.generation_done(Finished(FinishReason.EOS, Usage(5, 1, 0), TIMINGS, 1), "r")
    assert not plain.truncated


# -- chat -----------------------------------------------------------------------------------------

TURNS = [pb.ChatMessage(role="system", content="s"), pb.ChatMessage(role="user", content="u")]


def chat_checked(info: Any = INFO, **fields: Any) -> checks.CheckedRequest:
    message = pb.GenerateRequest(messages=fields.pop("messages", TURNS), **fields)
    return validation.parse_text_request(message, info, LIMITS)


def test_chat_request_resolves_the_template() -> None:
    """The request's template wins, else the server's; the messages travel in the checked
    request."""
    server_gemma = dataclasses.replace(INFO, chat_template="gemma")
    checked = chat_checked(server_gemma)
    assert checked.chat_template == "gemma"
    assert checked.messages == (ChatMessage("system", "s"), ChatMessage("user", "u"))
    assert chat_checked(server_gemma, chat_template="chatml").chat_template == "chatml"
    with_gguf = dataclasses.replace(INFO, has_chat_template=True, chat_template="gguf")
    assert chat_checked(with_gguf).chat_template == "gguf"


@pytest.mark.parametrize(
    ("info_fields", "fields", "error_type", "field", "text"),
    [
        ({}, {}, errors.FailedPrecondition, "messages", "--chat-template (gemma | chatml)"),
        ({}, {"chat_template": "gguf"}, errors.FailedPrecondition, "chat_template", "own"),
        ({}, {"chat_template": "llama3"}, errors.InvalidRequest, "chat_template", "'llama3'"),
        ({}, {"prompt": "p"}, errors.InvalidRequest, "prompt", "not both"),
        (
            {},
            {"messages": [pb.ChatMessage(role="function", content="x")], "chat_template": "gemma"},
            errors.InvalidRequest,
            "messages[0].role",
            "got 'function'",
        ),
        (
            {},
            {
                "messages": [pb.ChatMessage(role="user", content="x", tool_call_id="call_1")],
                "chat_template": "gemma",
            },
            errors.InvalidRequest,
            "messages[0].tool_call_id",
            "tool messages only",
        ),
        (
            {},
            {
                "messages": [
                    pb.ChatMessage(
                        role="assistant",
                        tool_calls=[pb.ToolCall(id="c", name="f", arguments="[1]")],
                    )
                ],
                "chat_template": "gemma",
            },
            errors.InvalidRequest,
            "messages[0].tool_calls[0].arguments",
            "must be a JSON object, got list",
        ),
    ],
)
def test_bad_chat_requests_name_the_field(
    info_fields: dict[str, Any],
    fields: dict[str, Any],
    error_type: type[errors.ServiceError],
    field: str,
    text: str,
) -> None:
    """No template anywhere is FAILED_PRECONDITION; bad names, roles and prompt+messages are
    INVALID_ARGUMENT; each names its field."""
    with pytest.raises(errors.ServiceError) as caught:
        chat_checked(dataclasses.replace(INFO, **info_fields), **fields)
    assert type(caught.value) is error_type
    assert caught.value.field == field
    assert text in caught.value.message


def test_chat_template_without_messages_is_refused() -> None:
    """chat_template on a plain prompt request is a mistake worth reporting."""
    message = pb.GenerateRequest(prompt="p", chat_template="gemma")
    with pytest.raises(errors.InvalidRequest) as caught:
        validation.parse_text_request(message, INFO, LIMITS)
    assert caught.value.field == "chat_template"


def test_chat_prompt_gets_exactly_one_bos() -> None:
    """A rendered prompt that starts with BOS is kept; one without gets it (the model wants it)."""
    bos = INFO.bos_token_id
    assert validation.chat_prompt_tokens([bos, 7, 8], INFO) == [bos, 7, 8]
    assert validation.chat_prompt_tokens([7, 8], INFO) == [bos, 7, 8]
    no_bos_model = dataclasses.replace(INFO, add_bos=False)
    assert validation.chat_prompt_tokens([7, 8], no_bos_model) == [7, 8]


def test_chat_template_option_reaches_the_model_settings() -> None:
    """--chat-template (or LLAMA_GRPC_CHAT_TEMPLATE) picks a built-in; anything else is refused
    naming the option."""
    assert load_settings(["--chat-template", "gemma"], {}).model.chat_template == "gemma"
    env = {"LLAMA_GRPC_CHAT_TEMPLATE": "chatml"}
    assert load_settings([], env).model.chat_template == "chatml"
    assert load_settings([], {}).model.chat_template == ""
    with pytest.raises(ConfigError, match=r"--chat-template.*must be one of gemma, chatml"):
        load_settings(["--chat-template", "llama3"], {})


def test_the_template_in_use_and_why() -> None:
    """The configured built-in, else the model file's own, else the family's built-in (Gemma's
    for every Gemma architecture), else none; template_origin says which, for the log."""
    from llama_grpc_server.core.requests.chat import template_in_use, template_origin

    assert template_in_use("chatml", True, "gemma3") == "chatml"
    assert template_in_use("", True, "gemma3") == "gguf"
    assert [template_in_use("", False, arch) for arch in ("gemma", "gemma2", "gemma3")] == [
        "gemma"
    ] * 3
    assert template_in_use("", False, "llama") == ""
    assert template_in_use("", False) == ""
    assert template_origin("chatml", False, "gemma3") == "configured (--chat-template)"
    assert template_origin("", True, "llama") == "the model file's own"
    assert template_origin("", False, "gemma3").startswith("built-in, the gemma3 family's")
    assert template_origin("", False, "phi3").startswith("none")
