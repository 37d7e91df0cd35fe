"""Tools around the parsers: a template's probed capabilities and the messages it is handed
(core.tools.prompt), the constraint of a required or named call (core.tools.constraint), the
session giving calls their ids and the turn its finish reason (core.tools.stream), and v1's
checks of tools and tool_choice (rpc.v1.tools)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.core.requests.chat import ChatMessage
from llama_grpc_server.core.requests.request import (
    Finished,
    FinishReason,
    Timings,
    TokenDelta,
    Usage,
)
from llama_grpc_server.core.tools import prompt
from llama_grpc_server.core.tools.constraint import tool_structural_tag
from llama_grpc_server.core.tools.stream import ToolSession, call_id, with_tool_calls
from llama_grpc_server.core.tools.types import (
    ChoiceMode,
    Parsed,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
)
from llama_grpc_server.engine.chat import _Template
from llama_grpc_server.rpc.v1 import tools as rpc_tools

WEATHER = ToolSpec(
    "get_weather",
    "Current weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = ToolSpec("get_time", "", {})
CALL = ToolCall("call_1", "get_weather", '{"city": "Tokyo"}')

# -- templates: what they render ------------------------------------------------------------------

# renders everything, arguments through tojson (as Qwen 2.5 does)
NATIVE = """{%- if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}
{% endif %}
{%- for m in messages -%}
[{{ m.role }}]{% if m.content %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}
{%- endfor %}[assistant]"""  # noqa: E501

# prints arguments as they are, and only the calls of a turn without content (DeepSeek R1)
TEXT_ARGS = """{%- for m in messages -%}
{%- if m.role == 'assistant' and m.content is none -%}
{%- for c in m.tool_calls %}<call>{{ c.function.name }}\n{{ c.function.arguments }}</call>{% endfor -%}
{%- elif m.role == 'tool' %}<out>{{ m.content }}</out>
{%- else %}[{{ m.role }}]{{ m.content }}{% endif -%}
{%- endfor %}[assistant]"""  # noqa: E501

PLAIN = """{%- for m in messages -%}[{{ m.role }}]{{ m.content }}{%- endfor %}[assistant]"""


def caps_of(source: str) -> prompt.TemplateCaps:
    return _Template(source, "<s>", "</s>").caps


def test_probe_finds_what_each_template_renders() -> None:
    assert caps_of(NATIVE) == prompt.TemplateCaps(
        tools=True, tool_calls=True, tool_responses=True, object_arguments=True
    )
    assert caps_of(TEXT_ARGS) == prompt.TemplateCaps(
        tools=False, tool_calls=True, tool_responses=True, null_content=True
    )
    assert caps_of(PLAIN) == prompt.TemplateCaps(tool_responses=True)  # any role as it is


def test_a_template_without_tools_gets_the_generic_prompt_calls_as_json_results_as_user() -> None:
    messages = (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Tokyo and Paris?"),
        ChatMessage("assistant", "", (CALL, ToolCall("call_2", "get_weather", '{"city":"Paris"}'))),
        ChatMessage("tool", "21 C", tool_call_id="call_1"),
        ChatMessage("tool", "18 C", tool_call_id="call_2", name="get_weather"),
    )
    out = prompt.template_messages(messages, prompt.TemplateCaps(), (WEATHER,))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == prompt.generic_prompt((WEATHER,)) + "\n\nBe brief."
    assert out[2]["content"] == (
        '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
        '{"name": "get_weather", "arguments": {"city":"Paris"}}'
    )
    assert out[3]["content"] == (
        '{"tool_response": {"name": "get_weather", "content": "21 C"}}\n'
        '{"tool_response": {"name": "get_weather", "content": "18 C"}}'
    )


def test_a_native_template_gets_objects_and_the_result_names_its_call() -> None:
    caps = prompt.TemplateCaps(True, True, True, object_arguments=True)
    messages = (
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", (CALL,)),
        ChatMessage("tool", "21 C", tool_call_id="call_1"),
    )
    out = prompt.template_messages(messages, caps, (WEATHER,))
    assert out[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}},
            }
        ],
    }
    assert out[2] == {
        "role": "tool",
        "content": "21 C",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }


def test_the_rendered_prompt_of_a_native_and_a_plain_template() -> None:
    messages = (ChatMessage("user", "Weather?"), ChatMessage("assistant", "", (CALL,)))
    native = _Template(NATIVE, "", "")
    payload = prompt.template_messages(messages, native.caps, (WEATHER,))
    rendered = native.render(payload, [prompt.openai_tool(WEATHER)])
    assert rendered == (
        'TOOLS:get_weather;[user]Weather?[assistant]<call>get_weather {"city": "Tokyo"}</call>'
        "[assistant]"
    )


# -- constraints ---------------------------------------------------------------------------------


def hermes(name: str) -> tuple[str, str]:
    return f'<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"


def test_a_named_call_in_a_wrapped_format() -> None:
    tag = tool_structural_tag(
        (WEATHER, TIME), ToolChoice(ChoiceMode.NAMED, "get_time"), parallel=True, wrapper=hermes
    )
    assert tag is not None
    assert json.loads(tag) == {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {
                    "type": "const_string",
                    "value": '<tool_call>\n{"name": "get_time", "arguments": ',
                },
                {"type": "json_schema", "json_schema": {"type": "object"}},
                {"type": "const_string", "value": "}\n</tool_call>"},
            ],
        },
    }


def test_required_calls_without_a_wrapper_are_bare_json_one_per_line() -> None:
    tag = tool_structural_tag(
        (WEATHER,), ToolChoice(ChoiceMode.REQUIRED), parallel=True, wrapper=lambda _: None
    )
    assert tag is not None
    one = {
        "type": "json_schema",
        "json_schema": {
            "type": "object",
            "properties": {"name": {"const": "get_weather"}, "arguments": dict(WEATHER.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    }
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, one]}
    assert json.loads(tag)["format"] == {
        "type": "sequence",
        "elements": [one, {"type": "star", "content": more}],
    }


def test_required_single_call_is_one_of_the_tools_and_auto_constrains_nothing() -> None:
    tag = tool_structural_tag(
        (WEATHER, TIME), ToolChoice(ChoiceMode.REQUIRED), parallel=False, wrapper=hermes
    )
    assert tag is not None
    form = json.loads(tag)["format"]
    assert form["type"] == "or"
    assert [e["elements"][0]["value"] for e in form["elements"]] == [
        hermes("get_weather")[0],
        hermes("get_time")[0],
    ]
    assert tool_structural_tag((WEATHER,), ToolChoice(), parallel=True, wrapper=hermes) is None


# -- the session ---------------------------------------------------------------------------------


class ScriptedParser:
    """Releases what the script says for each push."""

    def __init__(self, script: dict[str, Parsed], calls: Sequence[ToolCall]) -> None:
        self._script = script
        self._calls = list(calls)

    def push(self, text: str) -> Parsed:
        return self._script.get(text, Parsed(text))

    def finish(self) -> Parsed:
        return self._script.get("<finish>", Parsed())

    @property
    def calls(self) -> Sequence[ToolCall]:
        return self._calls


def finished(reason: FinishReason) -> Finished:
    return Finished(reason, Usage(3, 4, 0), Timings(0, 0, 0, 0, 0), seed=1)


async def events(*items: TokenDelta | Finished) -> AsyncIterator[TokenDelta | Finished]:
    for item in items:
        yield item


def run(session: ToolSession, *items: TokenDelta | Finished) -> list[TokenDelta | Finished]:
    async def collect() -> list[TokenDelta | Finished]:
        return [e async for e in with_tool_calls(events(*items), session)]

    return asyncio.run(collect())


def test_calls_get_ids_on_their_first_piece_and_the_turn_ends_with_tool_calls() -> None:
    script = {
        "a": Parsed("Sure. ", (ToolCallDelta(0, name="get_weather"),)),
        "b": Parsed(
            "", (ToolCallDelta(0, arguments='{"city"'), ToolCallDelta(0, arguments=": 1}"))
        ),
        "c": Parsed("", (ToolCallDelta(1, name="get_time"), ToolCallDelta(1, arguments="{}"))),
    }
    calls = [ToolCall("", "get_weather", '{"city": 1}'), ToolCall("", "get_time", "{}", index=1)]
    session = ToolSession(ScriptedParser(script, calls), "req-1")
    out = run(
        session,
        TokenDelta((5,), "a"),
        TokenDelta((6,), "b"),
        TokenDelta((7,), "c"),
        finished(FinishReason.EOS),
    )
    first, second, third, done = out
    assert isinstance(first, TokenDelta) and first.text == "Sure. "
    assert first.tool_calls == (ToolCallDelta(0, name="get_weather", id=call_id("req-1", 0)),)
    assert isinstance(second, TokenDelta)
    assert second.tool_calls == (ToolCallDelta(0, arguments='{"city": 1}'),)  # merged
    assert isinstance(third, TokenDelta)
    assert third.tool_calls == (
        ToolCallDelta(1, name="get_time", arguments="{}", id=call_id("req-1", 1)),
    )
    assert isinstance(done, Finished) and done.reason is FinishReason.TOOL_CALLS
    assert [(c.id, c.name) for c in done.tool_calls] == [
        (call_id("req-1", 0), "get_weather"),
        (call_id("req-1", 1), "get_time"),
    ]
    assert call_id("req-1", 0).startswith("call_") and len(call_id("req-1", 0)) == 29
    assert call_id("req-1", 0) != call_id("req-2", 0)


def test_a_turn_cut_short_keeps_its_reason_and_one_call_only_without_parallel() -> None:
    script = {"<finish>": Parsed("", (ToolCallDelta(0, name="f"), ToolCallDelta(1, name="g")))}
    calls = [ToolCall("", "f", "{}"), ToolCall("", "g", "{}", index=1)]
    session = ToolSession(ScriptedParser(script, calls), "r", parallel=False)
    out = run(session, TokenDelta((1,), "x"), finished(FinishReason.MAX_TOKENS))
    flushed, done = out[1], out[2]
    assert isinstance(flushed, TokenDelta)
    assert flushed.tool_calls == (ToolCallDelta(0, name="f", id=call_id("r", 0)),)
    assert isinstance(done, Finished) and done.reason is FinishReason.MAX_TOKENS
    assert [c.name for c in done.tool_calls] == ["f"]


def test_a_turn_without_calls_is_unchanged() -> None:
    session = ToolSession(ScriptedParser({}, []), "r")
    out = run(session, TokenDelta((1,), "hello"), finished(FinishReason.EOS))
    assert out == [TokenDelta((1,), "hello"), finished(FinishReason.EOS)]


# -- v1's checks ---------------------------------------------------------------------------------


def request(**fields: Any) -> pb.GenerateRequest:
    fields.setdefault("messages", [pb.ChatMessage(role="user", content="hi")])
    return pb.GenerateRequest(**fields)


def test_tools_and_choice_are_parsed() -> None:
    parsed = rpc_tools.parse_tools(
        request(
            tools=[
                pb.Tool(
                    name="get_weather",
                    description="Current weather",
                    parameters=json.dumps(WEATHER.parameters),
                ),
                pb.Tool(name="get_time"),
            ],
            tool_choice=pb.ToolChoice(function="get_time"),
            parallel_tool_calls=False,
        )
    )
    assert parsed == rpc_tools.ToolRequest(
        (WEATHER, TIME), ToolChoice(ChoiceMode.NAMED, "get_time"), False
    )
    none = rpc_tools.parse_tools(
        request(tools=[pb.Tool(name="f")], tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE))
    )
    assert none.offered == () and not none.constrains


@pytest.mark.parametrize(
    ("fields", "field", "text"),
    [
        ({"tools": [pb.Tool(name="bad name")]}, "tools[0].name", "letters, digits"),
        ({"tools": [pb.Tool(name="f"), pb.Tool(name="f")]}, "tools[1].name", "offered twice"),
        ({"tools": [pb.Tool(name="f", parameters="{")]}, "tools[0].parameters", "JSON text"),
        ({"tools": [pb.Tool(name="f", parameters="[]")]}, "tools[0].parameters", "got list"),
        (
            {"tools": [pb.Tool(name="f", parameters='{"type": "string"}')]},
            "tools[0].parameters",
            "object schema",
        ),
        (
            {"tools": [pb.Tool(name="f")], "tool_choice": pb.ToolChoice(function="g")},
            "tool_choice.function",
            "'g', not offered (offered: f)",
        ),
        (
            {"tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)},
            "tool_choice",
            "no tools are offered",
        ),
        (
            {"messages": [], "prompt": "p", "tools": [pb.Tool(name="f")]},
            "tools",
            "messages only",
        ),
        (
            {
                "tools": [pb.Tool(name="f")],
                "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
                "params": pb.GenerationParams(json_schema="{}"),
            },
            "tool_choice",
            "leave params.json_schema unset",
        ),
        (
            {"tools": [pb.Tool(name="f")], "tool_choice": pb.ToolChoice(mode=9)},
            "tool_choice.mode",
            "unknown tool choice mode 9",
        ),
    ],
)
def test_bad_tools_name_the_field(fields: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        rpc_tools.parse_tools(request(**fields))
    assert caught.value.field == field
    assert text in caught.value.message
