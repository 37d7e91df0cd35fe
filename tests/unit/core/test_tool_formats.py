"""The tool-call formats' streaming parsers (core/tools/formats, core/tools/streaming.py): each
format on realistic model outputs (the shapes of the formats' templates, llama.cpp's and vLLM's
parsers and their tests), the bare JSON rule's precision, calls cut short or broken, the registry
on real chat templates, and a Hypothesis property: any split of an output into pushes gives what
one push gives."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES
from llama_grpc_server.core.tools.arg_types import param_types, typed_bare, typed_text
from llama_grpc_server.core.tools.formats import FORMATS, format_for, format_named
from llama_grpc_server.core.tools.formats.deepseek import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
)
from llama_grpc_server.core.tools.streaming import JsonScanner
from llama_grpc_server.core.tools.types import Parsed, ToolCall, ToolCallDelta, ToolSpec
from llama_grpc_testkit import llama_sdist

WEATHER = ToolSpec(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
)
TIME = ToolSpec("get_time", "The time now", {"type": "object", "properties": {}})
SEARCH = ToolSpec(
    "search",
    "Search the web",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer"},
            "exact": {"type": "boolean"},
            "score": {"type": "number"},
            "filters": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "cursor": {"type": ["string", "null"]},
            "zip": {"type": "string"},
        },
    },
)
TOOLS = (WEATHER, TIME, SEARCH)


@dataclass
class Run:
    text: str
    calls: list[ToolCall]
    names: dict[int, str] = field(default_factory=dict)  # index -> name, from the deltas
    args: dict[int, str] = field(default_factory=dict)  # index -> concatenated fragments
    pushes: list[Parsed] = field(default_factory=list)  # what each push (then finish) gave


def run(fmt: str, output: str | Sequence[str], tools: Sequence[ToolSpec] = TOOLS) -> Run:
    parser = format_named(fmt).parser(tools)
    chunks = [output] if isinstance(output, str) else list(output)
    pushes = [parser.push(chunk) for chunk in chunks]
    pushes.append(parser.finish())
    result = Run("".join(p.text for p in pushes), list(parser.calls), pushes=pushes)
    for parsed in pushes:
        for delta in parsed.calls:
            if delta.index not in result.names:
                assert delta.name, f"the first delta of call {delta.index} has no name"
                result.names[delta.index] = delta.name
                result.args[delta.index] = ""
            else:
                assert not delta.name, f"call {delta.index} named twice"
            result.args[delta.index] += delta.arguments
    for call in result.calls:  # a complete call is its deltas
        assert (result.names[call.index], result.args[call.index]) == (call.name, call.arguments)
        assert isinstance(json.loads(call.arguments), dict)
        assert call.id == ""
    return result


def call(name: str, arguments: str, index: int = 0) -> ToolCall:
    return ToolCall("", name, arguments, index)


def wrapper(fmt: str, name: str) -> tuple[str, str]:
    pair = format_named(fmt).call_wrapper(name)
    assert pair is not None
    return pair


def chars(text: str) -> list[str]:
    return list(text)


# ------------------------------------------------------------------------------------------
# hermes: <tool_call>{json}</tool_call> (Qwen 2.5 / 3, Hermes)

HERMES_TWO = (
    "I'll check both.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
HERMES_NESTED = (
    "<tool_call>\n"
    '{"name": "search", "arguments": {"query": "caf\\u00e9 \\"quoted\\" 東京 }]", '
    '"filters": {"lang": ["ja", {"x": null}], "depth": 2}, "tags": []}}\n'
    "</tool_call>"
)
HERMES_AFTER = (
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nI asked for the time.'
)


def test_hermes_two_calls_text_before_whitespace_between_dropped() -> None:
    r = run("hermes", HERMES_TWO)
    assert r.text == "I'll check both.\n"
    assert r.calls == [
        call("get_weather", '{"city": "Tokyo", "days": 3}', 0),
        call("get_time", "{}", 1),
    ]


def test_hermes_arguments_exact_text_unicode_escapes_nesting() -> None:
    r = run("hermes", HERMES_NESTED)
    args = (
        '{"query": "caf\\u00e9 \\"quoted\\" 東京 }]", '
        '"filters": {"lang": ["ja", {"x": null}], "depth": 2}, "tags": []}'
    )
    assert (r.text, r.calls) == ("", [call("search", args)])
    assert json.loads(r.calls[0].arguments)["query"] == 'café "quoted" 東京 }]'


def test_hermes_text_after_the_calls_is_text() -> None:
    r = run("hermes", HERMES_AFTER)
    assert r.text == "\n\nI asked for the time."
    assert r.calls == [call("get_time", "{}")]


def test_hermes_streams_name_then_argument_fragments() -> None:
    parser = format_named("hermes").parser(TOOLS)
    assert parser.push("Sure. <tool") == Parsed("Sure. ")
    assert parser.push('_call>\n{"name": "get_wea') == Parsed()
    assert parser.push('ther", "argu') == Parsed(calls=(ToolCallDelta(0, name="get_weather"),))
    assert parser.push('ments": {"city": "To') == Parsed(
        calls=(ToolCallDelta(0, arguments='{"city": "To'),)
    )
    assert parser.push('kyo"}}\n</tool_call>') == Parsed(
        calls=(ToolCallDelta(0, arguments='kyo"}'),)
    )
    assert parser.finish() == Parsed()
    assert list(parser.calls) == [call("get_weather", '{"city": "Tokyo"}')]


def test_hermes_arguments_before_name_and_parameters_and_missing_arguments() -> None:
    r = run(
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
    )
    assert r.calls == [
        call("get_weather", '{"city": "Oslo"}', 0),
        call("get_weather", '{"city": "Rome"}', 1),
        call("get_time", "{}", 2),
    ]
    assert r.pushes[0].calls[0] == ToolCallDelta(0, "get_weather", '{"city": "Oslo"}')


def test_hermes_tagged_call_of_a_tool_not_offered_is_still_reported() -> None:
    r = run("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>')
    assert r.calls == [call("rm_rf", '{"path": "/"}')]


def test_hermes_call_cut_short_is_streamed_but_not_complete() -> None:
    r = run("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tok')
    assert (r.text, r.calls) == ("Checking.\n", [])
    assert (r.names, r.args) == ({0: "get_weather"}, {0: '{"city": "Tok'})
    # cut inside the name: nothing to report, nothing released as text
    r = run("hermes", '<tool_call>\n{"name": "get_wea')
    assert (r.text, r.calls, r.names) == ("", [], {})


def test_hermes_invalid_json_call_is_abandoned_and_the_next_keeps_its_index() -> None:
    """Choice: a complete tagged call whose arguments are not a JSON object is abandoned like
    one cut short (its deltas stand, it is not in `calls`, text up to its closer is dropped)."""
    r = run(
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {\'city\': \'Tokyo\'}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.',
    )
    assert r.text == "\nDone."
    assert r.names == {0: "get_weather", 1: "get_time"}
    assert r.args[0] == "{'city': 'Tokyo'}"
    assert r.calls == [call("get_time", "{}", 1)]
    # mismatched brackets and NaN are not JSON either
    for bad in ('{"a": [1}', '{"a": NaN}'):
        out = f'<tool_call>\n{{"name": "search", "arguments": {bad}}}\n</tool_call>after'
        assert run("hermes", out).calls == []
        assert run("hermes", out).text == "after"


def test_hermes_tag_with_qwen_xml_body_and_with_no_call() -> None:
    r = run(
        "hermes",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
    )
    assert r.calls == [call("get_weather", '{"city": "Paris"}')]
    r = run("hermes", "A <tool_call>nothing here</tool_call> B")
    assert (r.text, r.calls) == ("A  B", [])


def test_text_never_holds_a_marker_nor_a_partial_one_while_streaming() -> None:
    parser = format_named("hermes").parser(TOOLS)
    assert parser.push("x < y and a <tool") == Parsed("x < y and a ")
    assert parser.push("box> and </tool_call> <") == Parsed("<toolbox> and  ")
    assert parser.finish() == Parsed("<")
    assert run("hermes", chars("if a<b: return <tool")).text == "if a<b: return <tool"


def test_whitespace_only_answer_and_leading_whitespace_stay() -> None:
    assert run("hermes", "  \n").text == "  \n"
    assert run("hermes", ["\n ", " Hi"]).text == "\n  Hi"
    r = run("hermes", '\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')
    assert (r.text, len(r.calls)) == ("", 1)


def test_hermes_call_wrapper_is_what_the_parser_reads() -> None:
    before, after = wrapper("hermes", 'we"ird')
    assert (before, after) == (
        '<tool_call>\n{"name": "we\\"ird", "arguments": ',
        "}\n</tool_call>",
    )
    r = run("hermes", before + '{"k": [1, 2]}' + after, tools=[ToolSpec('we"ird')])
    assert r.calls == [call('we"ird', '{"k": [1, 2]}')]


# ------------------------------------------------------------------------------------------
# the bare JSON rule (every parser; Qwen 2.5 Coder writes its calls this way)

BARE_CALLS = {
    '{"name": "get_weather", "arguments": {"city": "Tokyo"}}': [
        ("get_weather", '{"city": "Tokyo"}')
    ],
    '  \n{"name": "get_weather", "parameters": {"city": "Tokyo"}}\n\n': [
        ("get_weather", '{"city": "Tokyo"}')
    ],
    '{"type": "function", "name": "get_time", "parameters": {}}': [("get_time", "{}")],
    '```json\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n```': [
        ("get_weather", '{"city": "Tokyo"}')
    ],
    '```\n{"name": "get_time", "arguments": {}}\n```\n': [("get_time", "{}")],
    '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
    '{"name": "get_time", "arguments": {}}': [
        ("get_weather", '{"city": "Tokyo"}'),
        ("get_time", "{}"),
    ],
    '{"name": "get_weather", "arguments": {"city": "A"}}; '
    '{"name": "get_weather", "arguments": {"city": "B"}}': [
        ("get_weather", '{"city": "A"}'),
        ("get_weather", '{"city": "B"}'),
    ],
    '[{"name": "get_weather", "arguments": {"city": "A"}}, '
    '{"name": "get_time", "arguments": {}}]': [
        ("get_weather", '{"city": "A"}'),
        ("get_time", "{}"),
    ],
    '```json\n[\n  {"name": "search", '
    '"arguments": {"query": "\\"x\\" ü", "tags": ["a"]}}\n]\n```': [
        ("search", '{"query": "\\"x\\" ü", "tags": ["a"]}')
    ],
}
NOT_CALLS = [
    '{"city": "Tokyo", "temperature": 21}',  # JSON the user asked for
    '{"name": "Alice", "arguments": {"age": 30}}',  # a name that is no offered tool
    '{"name": "get_weather", "arguments": {"city": "Tokyo"}} I called it.',  # text after
    'Here: {"name": "get_weather", "arguments": {"city": "Tokyo"}}',  # text before
    '```json\n{"name": "get_time", "arguments": {}}\n```\n```json\n{"name": "get_time", '
    '"arguments": {}}\n```',  # two fences
    '```python\n{"name": "get_time", "arguments": {}}\n```',  # not a JSON fence
    '{"name": "get_time", "arguments": {}, "reason": "asked"}',  # a key outside the rule
    '{"name": "get_time", "arguments": "{}"}',  # arguments not an object
    '{"name": "get_time", "name": "get_time", "arguments": {}}',  # a key twice
    '{"name": "get_time", "arguments": {}, "parameters": {}}',
    '{"type": "object", "name": "get_time", "arguments": {}}',
    '{"name": "get_time"}',  # no arguments
    '{"name": "get_weather", "arguments": {"city": }}',  # not JSON
    '{"name": "get_weather", "arguments": {"city": "Tokyo"}',  # never closed
    "[]",
    "[1, 2, 3]",
    '[{"name": "get_time", "arguments": {}}, 5]',
    '{"name": "get_time", "arguments": {}};',
    "`get_time()` is what I would call.",
    "```\nplain code\n```",
    "{}",
]


@pytest.mark.parametrize("fmt", ["hermes", "generic", "llama3_json", "qwen_xml", "mistral"])
@pytest.mark.parametrize("output", sorted(BARE_CALLS))
def test_bare_json_calls_are_calls(fmt: str, output: str) -> None:
    r = run(fmt, output)
    assert r.text == ""
    assert r.calls == [call(n, a, i) for i, (n, a) in enumerate(BARE_CALLS[output])]
    # emitted at finish(), one delta per call carrying name and arguments
    assert all(not p.calls and not p.text for p in r.pushes[:-1])
    assert r.pushes[-1].calls == tuple(
        ToolCallDelta(i, n, a) for i, (n, a) in enumerate(BARE_CALLS[output])
    )


@pytest.mark.parametrize("fmt", ["hermes", "generic", "deepseek", "gemma4", "phi4_mini"])
@pytest.mark.parametrize("output", NOT_CALLS)
def test_bare_json_that_is_not_a_call_is_text_unchanged(fmt: str, output: str) -> None:
    r = run(fmt, output)
    assert (r.text, r.calls, r.names) == (output, [], {})


def test_bare_json_needs_offered_tools() -> None:
    output = '{"name": "get_time", "arguments": {}}'
    assert run("hermes", output, tools=[]).text == output
    assert run("hermes", output, tools=[WEATHER]).text == output


def test_bare_candidate_released_as_soon_as_it_cannot_be_a_call() -> None:
    parser = format_named("generic").parser(TOOLS)
    assert parser.push("  ") == Parsed()
    assert parser.push("Hello") == Parsed("  Hello")
    parser = format_named("generic").parser(TOOLS)
    assert parser.push('{"ci') == Parsed()
    assert parser.push('ty": "Tokyo"}') == Parsed('{"city": "Tokyo"}')  # the key rules it out
    parser = format_named("generic").parser(TOOLS)
    assert parser.push('{"name": "Alice') == Parsed()
    assert parser.push('", "age"') == Parsed('{"name": "Alice", "age"')  # name not offered
    parser = format_named("generic").parser(TOOLS)
    assert parser.push('{"name": "get_time", "arguments": {}}\n') == Parsed()
    assert parser.push("\n") == Parsed()
    assert parser.push("Then") == Parsed('{"name": "get_time", "arguments": {}}\n\nThen')
    parser = format_named("generic").parser(TOOLS)
    assert parser.push('{"name": "get_time", "arguments": {}}') == Parsed()
    assert parser.finish() == Parsed(calls=(ToolCallDelta(0, "get_time", "{}"),))


def test_bare_candidate_rejected_is_read_again_for_markers() -> None:
    r = run(
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tokyo"}, "id": "a1b2c3d4e"}]',
    )
    assert (r.text, r.calls) == ("", [call("get_weather", '{"city": "Tokyo"}')])
    r = run("hermes", '{"a": 1}\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert (r.text, r.calls) == ('{"a": 1}\n', [call("get_time", "{}")])


def test_generic_has_no_markers_tags_are_text() -> None:
    output = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert (run("generic", output).text, run("generic", output).calls) == (output, [])
    assert format_named("generic").markers == ()
    assert format_named("generic").call_wrapper("get_time") is None


# ------------------------------------------------------------------------------------------
# llama3_json: optional <|python_tag|>, {"name": ..., "parameters": {...}}

LLAMA_TAGGED = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA", '
    '"unit": "celsius"}}; {"name": "get_time", "parameters": {}}'
)


def test_llama3_python_tag_calls_separated_by_semicolons() -> None:
    r = run("llama3_json", LLAMA_TAGGED)
    assert r.text == ""
    assert r.calls == [
        call("get_weather", '{"city": "San Francisco, CA", "unit": "celsius"}', 0),
        call("get_time", "{}", 1),
    ]


def test_llama3_text_before_tag_and_after_calls_and_non_json_after_tag() -> None:
    r = run(
        "llama3_json",
        'Let me look.<|python_tag|>{"name": "get_time", "arguments": {}} and that is all',
    )
    assert (r.text, r.calls) == ("Let me look. and that is all", [call("get_time", "{}")])
    r = run("llama3_json", '<|python_tag|>brave_search.call(query="weather")')
    assert (r.text, r.calls) == ('brave_search.call(query="weather")', [])


def test_llama3_bare_call_with_parameters_and_wrapper() -> None:
    before, after = wrapper("llama3_json", "get_weather")
    assert (before, after) == ('{"name": "get_weather", "parameters": ', "}")
    r = run("llama3_json", before + '{"city": "Tokyo"}' + after)
    assert (r.text, r.calls) == ("", [call("get_weather", '{"city": "Tokyo"}')])


# ------------------------------------------------------------------------------------------
# qwen_xml: <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>

QWEN_XML = (
    "Let me search.\n\n<tool_call>\n<function=search>\n"
    "<parameter=query>\n123\n</parameter>\n"
    "<parameter=limit>\n5\n</parameter>\n"
    "<parameter=exact>\ntrue\n</parameter>\n"
    "<parameter=score>\n0.5\n</parameter>\n"
    '<parameter=filters>\n{"lang": "ja"}\n</parameter>\n'
    '<parameter=tags>\n["a", "b"]\n</parameter>\n'
    "<parameter=cursor>\nnull\n</parameter>\n"
    "<parameter=zip>\n01234\n</parameter>\n"
    "</function>\n</tool_call>"
)
QWEN_XML_ARGS = (
    '{"query": "123", "limit": 5, "exact": true, "score": 0.5, "filters": {"lang": "ja"}, '
    '"tags": ["a", "b"], "cursor": null, "zip": "01234"}'
)
QWEN_XML_MULTI = (
    '<tool_call>\n<function=search>\n<parameter=query>\nline one\n  "two" </b>\n\n'
    "</parameter>\n<parameter=limit>\nmany\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)


def test_qwen_xml_values_typed_by_schema() -> None:
    r = run("qwen_xml", QWEN_XML)
    assert r.text == "Let me search.\n\n"
    assert r.calls == [call("search", QWEN_XML_ARGS)]
    assert json.dumps(json.loads(QWEN_XML_ARGS), ensure_ascii=False) == QWEN_XML_ARGS


def test_qwen_xml_multiline_values_untyped_text_and_no_parameters() -> None:
    r = run("qwen_xml", QWEN_XML_MULTI)
    assert r.calls == [
        call("search", '{"query": "line one\\n  \\"two\\" </b>\\n", "limit": "many"}', 0),
        call("get_time", "{}", 1),
    ]


def test_qwen_xml_streams_a_parameter_at_a_time() -> None:
    parser = format_named("qwen_xml").parser(TOOLS)
    assert parser.push("<tool_call>\n<function=get_weather>\n<parameter=ci") == Parsed(
        calls=(ToolCallDelta(0, name="get_weather"),)
    )
    assert parser.push("ty>\nTokyo\n</parameter>\n") == Parsed(
        calls=(ToolCallDelta(0, arguments='{"city": "Tokyo"'),)
    )
    assert parser.push("<parameter=days>\n3\n</parameter>\n<parameter=unit>\nx") == Parsed(
        calls=(ToolCallDelta(0, arguments=', "days": 3'),)
    )
    assert parser.push("\n</parameter>\n</function>\n</tool_call>") == Parsed(
        calls=(ToolCallDelta(0, arguments=', "unit": "x"}'),)
    )
    assert parser.finish() == Parsed()
    assert list(parser.calls) == [call("get_weather", '{"city": "Tokyo", "days": 3, "unit": "x"}')]


def test_qwen_xml_lenient_forms() -> None:
    # no <tool_call> (Qwen3-Coder), no </parameter>, a parameter the schema does not know
    r = run(
        "qwen_xml",
        "<function=get_weather>\n<parameter=city>\nRome\n<parameter=note>\n7\n</function>\nok",
    )
    assert (r.text, r.calls) == ("\nok", [call("get_weather", '{"city": "Rome", "note": "7"}')])
    # two functions in one tag; the JSON body in the tag
    r = run(
        "qwen_xml",
        "<tool_call>\n<function=get_time>\n</function>\n<function=get_time>\n</function>\n"
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    )
    assert r.calls == [call("get_time", "{}", i) for i in range(3)]
    # <function= is an opener only with an offered name
    assert run("qwen_xml", "<function=rm>\nx").text == "<function=rm>\nx"


def test_qwen_xml_cut_short_inside_a_parameter() -> None:
    r = run("qwen_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nTok")
    assert (r.text, r.calls, r.names, r.args) == ("", [], {0: "get_weather"}, {0: ""})


def test_qwen_xml_format_facts() -> None:
    fmt = format_named("qwen_xml")
    assert fmt.call_wrapper("get_time") is None
    assert fmt.markers == ("<tool_call>", "</tool_call>")


# ------------------------------------------------------------------------------------------
# deepseek: the V3/R1 fenced form and the V3.1 form

DEEPSEEK_V3 = (
    "<think>\nThe user wants weather.\n</think>\n\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
    '{"city": "Tokyo", "days": 2}\n```'
    f"{CALL_END}\n{CALL_BEGIN}function{SEP}search\n```json\n"
    '{"query": "\\u6771\\u4eac \\"tokyo\\"", "filters": {"a": [1, {"b": true}]}}\n```'
    f"{CALL_END}{CALLS_END}"
)
DEEPSEEK_V31 = (
    f"Sure.{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}{{}}{CALL_END}"
    f'{CALL_BEGIN}get_weather{SEP}{{"city": "Lima"}}{CALL_END}{CALLS_END}'
)


def test_deepseek_v3_fenced_calls() -> None:
    r = run("deepseek", DEEPSEEK_V3)
    assert r.text == "<think>\nThe user wants weather.\n</think>\n\n"
    assert r.calls == [
        call("get_weather", '{"city": "Tokyo", "days": 2}', 0),
        call(
            "search",
            '{"query": "\\u6771\\u4eac \\"tokyo\\"", "filters": {"a": [1, {"b": true}]}}',
            1,
        ),
    ]


def test_deepseek_v31_calls_and_a_call_without_the_calls_token() -> None:
    r = run("deepseek", DEEPSEEK_V31)
    assert (r.text, r.calls) == (
        "Sure.",
        [call("get_time", "{}", 0), call("get_weather", '{"city": "Lima"}', 1)],
    )
    r = run("deepseek", f"{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END} done")
    assert (r.text, r.calls) == (" done", [call("get_time", "{}")])


def test_deepseek_cut_short_and_stray_tokens() -> None:
    r = run("deepseek", f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"ci')
    assert (r.calls, r.names, r.args) == ([], {0: "get_weather"}, {0: '{"ci'})
    assert run("deepseek", f"a{CALL_END}b{SEP}c").text == "abc"


def test_deepseek_wrapper_and_markers() -> None:
    fmt = format_named("deepseek")
    before, after = wrapper("deepseek", "get_weather")
    assert before == (
        "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>"
        "function<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n"
    )
    assert (
        after == "\n```<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>"
    )
    assert set(fmt.markers) == {CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP}
    r = run("deepseek", before + '{"city": "Oslo"}' + after)
    assert (r.text, r.calls) == ("", [call("get_weather", '{"city": "Oslo"}')])


# ------------------------------------------------------------------------------------------
# gemma4: <|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>

Q = '<|"|>'
GEMMA = (
    f'I\'ll look that up.<|tool_call>call:search{{query:{Q}Tokyo, "Japan"{Q},limit:5,'
    f"exact:false,score:1.5,zip:94043,cursor:null,filters:{{lang:{Q}ja{Q},"
    f"nested:{{deep:[1,{Q}x{Q},true]}}}},tags:[{Q}a{Q},{Q}b{Q}]}}<tool_call|>"
    f"<|tool_call>call:get_time{{}}<tool_call|>"
)
GEMMA_ARGS = (
    '{"query": "Tokyo, \\"Japan\\"", "limit": 5, "exact": false, "score": 1.5, "zip": "94043", '
    '"cursor": null, "filters": {"lang": "ja", "nested": {"deep": [1, "x", true]}}, '
    '"tags": ["a", "b"]}'
)


def test_gemma4_arguments_converted_to_json_typed_by_schema() -> None:
    r = run("gemma4", GEMMA)
    assert r.text == "I'll look that up."
    assert r.calls == [call("search", GEMMA_ARGS, 0), call("get_time", "{}", 1)]


def test_gemma4_streams_a_parameter_at_a_time_and_quoted_keys() -> None:
    parser = format_named("gemma4").parser(TOOLS)
    assert parser.push("<|tool_call>call:get_weather{city:" + Q + "Par") == Parsed(
        calls=(ToolCallDelta(0, name="get_weather"),)
    )
    assert parser.push("is" + Q + "," + Q + "days" + Q + ":3}<tool") == Parsed(
        calls=(ToolCallDelta(0, arguments='{"city": "Paris", "days": 3}'),)
    )
    assert parser.push("_call|>") == Parsed()
    assert parser.finish() == Parsed()


def test_gemma4_tool_response_ends_the_answer_and_broken_calls() -> None:
    r = run(
        "gemma4",
        f"<|tool_call>call:get_time{{}}<tool_call|><|tool_response>response:get_time{{value:"
        f"{Q}12:00{Q}}}<tool_response|>It is noon.",
    )
    assert (r.text, r.calls) == ("", [call("get_time", "{}")])
    r = run("gemma4", f"<|tool_call>call:get_weather{{city:{Q}Par")
    assert (r.calls, r.names, r.args) == ([], {0: "get_weather"}, {0: ""})
    r = run("gemma4", "<|tool_call>call:get_weather{city}<tool_call|>after")
    assert (r.text, r.calls, r.names) == ("after", [], {0: "get_weather"})


# ------------------------------------------------------------------------------------------
# mistral: [TOOL_CALLS][{...}] and [TOOL_CALLS]NAME[ARGS]{...}

MISTRAL_ARRAY = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}, '
    '{"name": "get_time", "arguments": {}, "id": "ghiJKL456"}]'
)
MISTRAL_NAMED = (
    'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "unit": "celsius"}'
    "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}"
)


def test_mistral_array_form() -> None:
    r = run("mistral", MISTRAL_ARRAY)
    assert (r.text, r.calls) == (
        "",
        [call("get_weather", '{"city": "Paris"}', 0), call("get_time", "{}", 1)],
    )


def test_mistral_name_args_form_with_call_id() -> None:
    r = run("mistral", MISTRAL_NAMED)
    assert r.text == "Checking."
    assert r.calls == [
        call("get_weather", '{"city": "Nice", "unit": "celsius"}', 0),
        call("get_time", "{}", 1),
    ]


def test_mistral_wrapper_cut_short_and_strays() -> None:
    before, after = wrapper("mistral", "get_time")
    assert (before, after) == ('[TOOL_CALLS][{"name": "get_time", "arguments": ', "}]")
    assert run("mistral", before + "{}" + after).calls == [call("get_time", "{}")]
    r = run("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Ni')
    assert (r.calls, r.names, r.args) == ([], {0: "get_weather"}, {0: '{"city": "Ni'})
    assert run("mistral", "a [ARGS] b").text == "a  b"


# ------------------------------------------------------------------------------------------
# phi4_mini: functools[...] and <|tool_call|>[...]<|/tool_call|>

PHI_FUNCTOOLS = (
    'functools[{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
    '{"name": "search", "parameters": {"query": "[x]"}}]'
)
PHI_TOKENS = (
    'OK <|tool_call|>[{"name": "get_time", "arguments": {}}]<|/tool_call|> then '
    '<|tool_call|>{"name": "get_time", "arguments": {}}<|/tool_call|>'
)


def test_phi4_mini_functools_and_token_forms() -> None:
    r = run("phi4_mini", PHI_FUNCTOOLS)
    assert (r.text, r.calls) == (
        "",
        [call("get_weather", '{"city": "Lyon"}', 0), call("search", '{"query": "[x]"}', 1)],
    )
    r = run("phi4_mini", PHI_TOKENS)
    assert (r.text, r.calls) == (
        "OK  then ",
        [call("get_time", "{}", 0), call("get_time", "{}", 1)],
    )


def test_phi4_mini_wrapper_and_functools_prefix_held() -> None:
    before, after = wrapper("phi4_mini", "get_time")
    assert (before, after) == ('functools[{"name": "get_time", "arguments": ', "}]")
    parser = format_named("phi4_mini").parser(TOOLS)
    assert parser.push("use functo") == Parsed("use ")
    assert parser.push("ols here") == Parsed("functools here")


# ------------------------------------------------------------------------------------------
# the registry

REAL_TEMPLATES = {
    "Qwen-Qwen3-0.6B": "hermes",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-QwQ-32B": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "Qwen3.5-4B": "qwen_xml",
    "Qwen3-Coder": "qwen_xml",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3_json",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "deepseek",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek",
    "deepseek-ai-DeepSeek-V3.1": "deepseek",
    "google-gemma-4-31B-it": "gemma4",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "unsloth-mistral-Devstral-Small-2507": "mistral",
    "fireworks-ai-llama-3-firefunction-v2": "phi4_mini",
    "microsoft-Phi-3.5-mini-instruct": "generic",
    "google-gemma-2-2b-it": "generic",
    "GLM-4.6": "generic",  # <tool_call>NAME<arg_key>: not hermes
}


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_format_for_real_templates(name: str) -> None:
    assert format_for(llama_sdist.template(name)).name == REAL_TEMPLATES[name]


def test_registry() -> None:
    names = [fmt.name for fmt in FORMATS]
    assert names[-1] == "generic"
    assert sorted(names) == sorted(
        [
            "hermes",
            "llama3_json",
            "qwen_xml",
            "deepseek",
            "gemma4",
            "mistral",
            "phi4_mini",
            "generic",
        ]
    )
    assert all(format_named(n).name == n for n in names)
    with pytest.raises(KeyError):
        format_named("nope")
    assert format_for(BUILTIN_TEMPLATES["gemma"]).name == "generic"
    assert format_for("").name == "generic"
    phi4 = "{{ '<|system|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' }}"
    assert format_for(phi4).name == "phi4_mini"


# ------------------------------------------------------------------------------------------
# the shared pieces


def test_json_scanner_finds_the_end_across_pieces() -> None:
    scanner = JsonScanner()
    text = '{"a": "}\\"]", "b": [1, {"c": "\\\\"}]} tail'
    ends = []
    for i in range(0, len(text), 3):
        end = scanner.feed(text[: i + 3], i)
        if scanner.done:
            ends.append(end)
            break
    assert ends == [text.index(" tail")]
    bad = JsonScanner()
    assert bad.feed('{"a": [1}', 0) == 8 and bad.error
    scalar = JsonScanner()
    assert scalar.feed("12.5e3, x", 0) == 6 and scalar.done


def test_argument_typing_rules() -> None:
    assert param_types(SEARCH, "cursor") == {"string", "null"}
    assert param_types(SEARCH, "nope") == frozenset()
    assert param_types(None, "x") == frozenset()
    enum_only = ToolSpec(
        "t",
        "",
        {
            "properties": {
                "e": {"enum": [1, 2]},
                "s": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            }
        },
    )
    assert param_types(enum_only, "e") == {"integer"}
    assert param_types(enum_only, "s") == {"integer", "string"}
    assert typed_text("123", frozenset({"string"})) == "123"
    assert typed_text("123", frozenset({"integer", "string"})) == 123
    assert typed_text("abc", frozenset({"integer", "string"})) == "abc"
    assert typed_text("5.0", frozenset({"integer"})) == 5
    assert typed_text("5.5", frozenset({"integer"})) == "5.5"
    assert typed_text("True", frozenset({"boolean"})) is True
    assert typed_text("NaN", frozenset({"number"})) == "NaN"
    assert typed_text("[1]", frozenset({"object"})) == "[1]"
    assert typed_text(" x ", frozenset()) == " x "
    assert typed_bare("007", frozenset()) == "007"
    assert typed_bare("7", frozenset({"string"})) == "7"
    assert typed_bare("7", frozenset()) == 7


# ------------------------------------------------------------------------------------------
# any split gives what one push gives

CORPUS = [
    ("hermes", HERMES_TWO),
    ("hermes", HERMES_NESTED),
    ("hermes", HERMES_AFTER),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tok'),
    ("hermes", "a < b <tool_call> x </tool_call> <tool_c"),
    ("llama3_json", LLAMA_TAGGED),
    ("llama3_json", 'Let me look.<|python_tag|>{"name": "get_time", "arguments": {}} bye'),
    ("qwen_xml", QWEN_XML),
    ("qwen_xml", QWEN_XML_MULTI),
    ("qwen_xml", "<function=get_weather>\n<parameter=city>\nRome\n</function>\nok"),
    ("deepseek", DEEPSEEK_V3),
    ("deepseek", DEEPSEEK_V31),
    ("gemma4", GEMMA),
    ("gemma4", "<|tool_call>call:get_time{}<tool_call|><|tool_response>x"),
    ("mistral", MISTRAL_ARRAY),
    ("mistral", MISTRAL_NAMED),
    ("phi4_mini", PHI_FUNCTOOLS),
    ("phi4_mini", PHI_TOKENS),
    *(("hermes", output) for output in BARE_CALLS),
    *(("llama3_json", output) for output in NOT_CALLS),
    *(("mistral", output) for output in NOT_CALLS[:3]),
]


def split(output: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(output) + 1) for c in cuts})
    return [output[a:b] for a, b in zip([0, *points], [*points, len(output)], strict=True)]


def check_split(fmt: str, output: str, chunks: list[str]) -> None:
    whole = run(fmt, output)
    pieces = run(fmt, chunks)
    assert pieces.text == whole.text, (fmt, output, chunks)
    assert pieces.calls == whole.calls, (fmt, output, chunks)
    assert (pieces.names, pieces.args) == (whole.names, whole.args), (fmt, output, chunks)
    for marker in format_named(fmt).markers:
        assert marker not in whole.text


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    item=st.sampled_from(CORPUS),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=40),
)
def test_any_split_gives_what_one_push_gives(item: tuple[str, str], cuts: list[int]) -> None:
    fmt, output = item
    check_split(fmt, output, split(output, cuts))


def test_every_corpus_output_char_by_char_and_in_seeded_splits() -> None:
    rng = random.Random(49)
    for fmt, output in CORPUS:
        check_split(fmt, output, chars(output))
        for _ in range(3):
            check_split(
                fmt, output, split(output, rng.sample(range(len(output) + 1), min(8, len(output))))
            )


PIECES = ["{", "}", '"', ":", ",", " ", "\n", "`", "<", "[", "]", "a", "\\", "name", "arguments"]
PIECES += ["get_time", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "```"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    output=st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
    cuts=st.lists(st.integers(min_value=0, max_value=1_000), max_size=10),
    fmt=st.sampled_from(["hermes", "mistral", "generic"]),
)
def test_any_split_of_random_output(fmt: str, output: str, cuts: list[int]) -> None:
    whole = run(fmt, output)
    pieces = run(fmt, split(output, cuts))
    assert (pieces.text, pieces.calls, pieces.names, pieces.args) == (
        whole.text,
        whole.calls,
        whole.names,
        whole.args,
    )
    for marker in format_named(fmt).markers:
        assert marker not in whole.text
