"""Every model family through `make gateway` (deploy/gateway.py): the OpenAI SDK through SMG to a
llama-grpc replica serving that family's model (llama_grpc_testkit.synth_gguf's FAMILIES: random
weights, the real architecture, vocabulary and chat template), SMG tokenizing with the tokenizer the
replica exports and reading tool calls with the parser `make gateway` picked from the template.

The synthetic models write noise, so what the text must be is forced with constraints SMG
passes on (`regex`, a tool's JSON schema); SMG drops `logit_bias` for vLLM workers (its
vllm_engine.rs sets none), so that cannot steer here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from deploy.cluster import free_port
from deploy.gateway import NO_WARM_UP, QUICK_EXIT, Gateway

from llama_grpc import AsyncClient
from llama_grpc_testkit import synth_gguf
from llama_grpc_testkit.threads import TEST_THREADS

from .conftest import NO_DRAIN

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
# A call of get_weather(unit="c") as each SMG parser reads it in free text: what the family's
# model writes when it calls a tool (its chat template renders earlier calls the same way).
NATIVE_CALL = {
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>',
    "qwen_xml": "<tool_call>\n<function=get_weather>\n<parameter=unit>\nc\n</parameter>\n"
    "</function>\n</tool_call>",
    "llama": '{"name": "get_weather", "parameters": {"unit": "c"}}',
    "deepseek": "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>"
    'function<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n{"unit": "c"}\n```'
    "<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>",
    "json": '{"name": "get_weather", "arguments": {"unit": "c"}}',
    "gemma4": '<|tool_call>call:get_weather{unit:<|"|>c<|"|>}<tool_call|>',
}
FAMILY_NAMES = sorted(synth_gguf.FAMILIES)
# SMG's qwen3 and deepseek_r1 reasoning parsers read an answer as thinking until "</think>". A
# replica applies a constraint from the end of thinking on (rpc/v1/reasoning.py), and its reasoning
# budget ends the thinking of these random models: a constrained answer of a thinking family
# thinks REASONING_BUDGET tokens first (noise), then the forced end, then what was forced, as
# the trained models think first; the others answer at once.
THINKS = {"qwen3", "deepseek_r1"}
REASONING_BUDGET = 8


def literal(text: str) -> str:
    """`text` as a regex matching only itself (core/constrained/regex_grammar.py's escapes)."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch in ".^$*+?{}[]\\|()":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def gateway(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    family = synth_gguf.FAMILIES[request.param]
    args = ["--model", str(synth_gguf.family_model(family.name)), "--n-ctx", "2048", *NO_DRAIN,
            "--reasoning-budget", str(REASONING_BUDGET)]  # fmt: skip
    if family.server_template:
        args += ["--chat-template", family.server_template]
    with Gateway(
        replicas=1,
        port=free_port(),
        server_args=args,
        smg_args=(*NO_WARM_UP, *QUICK_EXIT),
        threads=TEST_THREADS,
    ) as gw:
        yield gw


async def test_chat_streamed_and_whole_agree_with_usage(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """SMG renders the family's template from the exported tokenizer: the same prompt tokens
    as v1 rendering the same messages on the replica; a streamed answer is the whole one, and
    the streamed usage is the whole one's."""
    ours = await direct.chat(MESSAGES, max_tokens=1, temperature=0)
    params = {"model": gateway.model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = await sdk.chat.completions.create(**params)
    assert whole.usage.prompt_tokens == ours.usage.prompt_tokens
    assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("length", 12)
    content: list[str] = []
    reasoning: list[str] = []
    usage = None
    stream = await sdk.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    async for event in stream:
        if event.choices:
            content.append(event.choices[0].delta.content or "")
            reasoning.append(getattr(event.choices[0].delta, "reasoning_content", None) or "")
        if event.usage is not None:
            usage = event.usage
    message = whole.choices[0].message
    # SMG trims a whole answer's content (llama3's noise, 24 newlines, is "" whole), not a
    # stream's deltas
    assert "".join(content).strip() == (message.content or "").strip()
    assert "".join(reasoning).strip() == (getattr(message, "reasoning_content", None) or "").strip()
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (ours.usage.prompt_tokens, 12)


async def test_a_finished_answer_stops_on_an_end_token(sdk: Any, gateway: Gateway) -> None:
    """Once a constraint is complete only end-of-generation tokens are allowed: the answer
    ends with finish_reason stop, and no end token shows in the text; a stop string ends one
    too. A thinking family's thoughts come apart from the answer (its reasoning parser): the
    constraint applies after them."""
    thinks = gateway.parsers.reasoning in THINKS
    regex = "(Sunny|Rainy), [0-9]{2} degrees"
    answer = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=48, temperature=0,
        extra_body={"regex": regex},
    )  # fmt: skip
    message = answer.choices[0].message
    text = (message.content or "").strip()
    assert answer.choices[0].finish_reason == "stop"
    assert text.startswith(("Sunny, ", "Rainy, ")) and text.endswith(" degrees"), message
    thoughts = getattr(message, "reasoning_content", None)
    if not thinks:
        assert not (thoughts or "").strip(), message
    stopped = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=48, temperature=0, stop=[","],
        extra_body={"regex": regex},
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert (stopped.choices[0].message.content or "").strip() == text.split(",")[0]


def family_of(gateway: Gateway) -> synth_gguf.Family:
    model = gateway.checked.path if gateway.checked else ""
    return next(f for f in synth_gguf.FAMILIES.values()
                if str(synth_gguf.family_model(f.name)) == model)  # fmt: skip


def forced_call_request(gateway: Gateway) -> dict[str, Any]:
    """What a tool_choice required / named test adds to its request: for a family whose SMG
    tool parser constrains nothing (Family.limits: gemma4), the model's own call, forced as a
    trained model would write it."""
    limit = family_of(gateway).limit("gateway_forced_tools") or ""
    if "sends no constraint" in limit:
        return {"regex": literal(NATIVE_CALL[str(gateway.parsers.tool)])}
    return {}


async def test_tool_call_with_a_named_function(sdk: Any, gateway: Gateway) -> None:
    answer = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=64, temperature=0, tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=forced_call_request(gateway),
    )  # fmt: skip
    message = answer.choices[0].message
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] in {"c", "f"}
    if gateway.parsers.reasoning == "qwen3":  # (the R1 distill's random model thinks blanks)
        assert (getattr(message, "reasoning_content", None) or "").strip(), message


async def test_json_schema_after_thinking(sdk: Any, gateway: Gateway) -> None:
    """response_format json_schema: the JSON is the content; a thinking family thinks first
    (its reasoning parser takes the thinking, the budget ends it), the others answer at once."""
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    answer = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    )  # fmt: skip
    message = answer.choices[0].message
    assert json.loads(message.content)["unit"] in {"c", "f"}, message
    thoughts = (getattr(message, "reasoning_content", None) or "").strip()
    if gateway.parsers.reasoning == "qwen3":
        assert thoughts, message
    elif gateway.parsers.reasoning not in THINKS:
        assert not thoughts, message


async def test_tool_call_required(sdk: Any, gateway: Gateway) -> None:
    """SMG constrains the answer to a JSON array of calls with no bound on its length (its
    build_required_array_schema: minItems 1, no maxItems, whatever parallel_tool_calls says),
    so a model that repeats itself (random weights; the embedded Gemma 3 270M too: five calls
    and a cut at 120 tokens, no tool_calls) fills max_tokens and SMG parses nothing. A
    frequency penalty, which SMG passes on, makes the model close the array as a trained one
    would."""
    answer = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=200, temperature=0, tools=[TOOL],
        tool_choice="required", frequency_penalty=2.0, extra_body=forced_call_request(gateway),
    )  # fmt: skip
    calls = answer.choices[0].message.tool_calls
    assert calls, answer.choices[0]
    assert answer.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["unit"] in {"c", "f"}


async def test_tool_call_in_the_familys_own_format(sdk: Any, gateway: Gateway) -> None:
    """tool_choice auto: the model writes a call in its family's own format (forced here with
    a regex, as a trained model would write it), and the SMG parser `make gateway` picked from
    the template turns it into an OpenAI tool call."""
    parser = gateway.parsers.tool
    assert parser in NATIVE_CALL, f"no native call written for SMG parser {parser!r}"
    answer = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=256, temperature=0, tools=[TOOL],
        extra_body={"regex": literal(NATIVE_CALL[parser])},
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.message.tool_calls, (parser, choice.message)
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"unit": "c"}
    assert choice.finish_reason == "tool_calls"
