"""Structural tags on llama.cpp: the grammars core/constrained/structural_tag.py writes accept and
refuse the texts xgrammar's formats mean (fed to llama.cpp's grammar one character token at a time),
and on the embedded Gemma 3 a lazy grammar leaves the text before its trigger free, constrains what
follows it, watches for it again after the tag, and never takes a token whose text past the
trigger the tag would refuse (llama.cpp would abort on it)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import llama_cpp
import pytest

from llama_grpc_server.core.constrained.structural_tag import structural_tag_to_gbnf
from llama_grpc_server.core.requests.request import Constraint, GenerationRequest
from llama_grpc_server.engine.grammar import init_grammar, json_schema_to_gbnf, token_piece
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.engine.sampler import Candidates
from llama_grpc_server.models.files import default_model_path

from .conftest import request, run

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SHADE = {
    "type": "object",
    "properties": {"shade": {"enum": ["navy", "sky"]}},
    "required": ["shade"],
}
COLORS = "The three primary colors are"


def mistral(at_least_one: bool, *, calls_at_least_one: bool = True) -> dict[str, Any]:
    """What SMG 1.13.0's mistral tool parser sends, as received on the wire for tool_choice
    "required" (the source before 1.13 left out the list's own at_least_one)."""
    call = {
        "begin": '{"name": "get_weather", "arguments": ',
        "content": {"type": "json_schema", "json_schema": WEATHER},
        "end": "}",
    }
    calls = {"type": "tags_with_separator", "tags": [call], "separator": ", ",
             "at_least_one": calls_at_least_one}  # fmt: skip
    return {"format": {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "tags": [
        {"begin": "[TOOL_CALLS] [", "content": calls, "end": "]"}
    ], "at_least_one": at_least_one}}  # fmt: skip


# What SMG sends for gpt-oss's response_format (harmony/stages/preparation.rs).
HARMONY = {"format": {"type": "triggered_tags",
    "triggers": ["<|channel|>analysis", "<|channel|>final"],
    "tags": [
        {"begin": "<|channel|>analysis<|message|>", "content": {"type": "any_text"},
         "end": "<|end|>"},
        {"begin": "<|channel|>final<|constrain|>json<|message|>",
         "content": {"type": "json_schema", "json_schema": WEATHER}, "end": ""},
    ], "at_least_one": True, "stop_after_first": False}}  # fmt: skip

# A kimi_k3-style part: any_text with excludes between two strings.
ATTRIBUTE = {"format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": 'tool="'},
    {"type": "any_text", "excludes": ['"', "<|"]},
    {"type": "const_string", "value": '"'},
]}}  # fmt: skip


def kimi_k3() -> dict[str, Any]:
    """What SMG's kimi_k3 parser sends for get_weather(city: string, days?: integer), not
    at_least_one (crates/tool_parser/src/parsers/kimi_k3.rs): a lazy grammar."""
    open_, close, sep = "<|open|>", "<|close|>", "<|sep|>"
    tools_open = f"{open_}tools{sep}"

    def argument(key: str, kind: str, value: dict[str, Any]) -> dict[str, Any]:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": f'{open_}argument key="{key}" type="{kind}"{sep}'},
            value,
            {"type": "const_string", "value": f"{close}argument{sep}"},
        ]}  # fmt: skip

    call = {"type": "sequence", "elements": [
        {"type": "const_string", "value": f'{open_}call tool="get_weather" index="'},
        {"type": "regex", "pattern": "[1-9][0-9]*"},
        {"type": "const_string", "value": f'"{sep}'},
        {"type": "sequence", "elements": [
            argument("city", "string", {"type": "any_text", "excludes": [close, open_, sep]}),
            {"type": "optional", "content": argument(
                "days", "number", {"type": "json_schema", "json_schema": {"type": "integer"}})},
        ]},
        {"type": "const_string", "value": f"{close}call{sep}"},
    ]}  # fmt: skip
    content = {"type": "plus", "content": {"type": "or", "elements": [call]}}
    tags = [
        {"begin": prefix + tools_open, "content": content, "end": f"{close}tools{sep}"}
        for prefix in ("", f"{close}think{sep}", f"{close}response{sep}")
    ]
    triggers = [tools_open, f"{close}think{sep}", f"{close}response{sep}"]
    return {"format": {"type": "triggered_tags", "triggers": triggers, "tags": tags,
                       "at_least_one": False}}  # fmt: skip


KIMI_CALL = (
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    "<|close|>call<|sep|><|close|>tools<|sep|>"
)

LEGACY = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
    {"begin": "<tool_call>", "schema": WEATHER, "end": "</tool_call>"}]}  # fmt: skip

LEGACY_FIRST = {"format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
    {"begin": "<tool_call>", "content": {"type": "json_schema", "json_schema": WEATHER},
     "end": "</tool_call>"}], "stop_after_first": True}}  # fmt: skip

CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
LANGUAGES = [
    (mistral(True), CALL, True),
    (mistral(True), CALL + " done", True),
    (mistral(True), CALL[:-1] + ', {"name": "get_weather", "arguments": {"city": "Rome"}}]', True),
    (mistral(True), "[TOOL_CALLS] []", False),  # the list's at_least_one
    (mistral(True, calls_at_least_one=False), "[TOOL_CALLS] []", True),
    (mistral(True), "Sure. " + CALL, False),  # at_least_one: a tag first
    (mistral(True), CALL.replace('"city"', '"town"'), False),  # the schema holds
    (mistral(True), CALL + " [TOOL_CALLS] x", False),  # the trigger again enters a tag
    (
        HARMONY,
        "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final"
        '<|constrain|>json<|message|>{"city": "Oslo"}',
        True,
    ),
    (HARMONY, "<|channel|>analysis<|message|>a<|end|>b<|end|>", True),  # free after the end
    (HARMONY, "<|channel|>final<|constrain|>json<|message|>Oslo", False),
    (HARMONY, "hello", False),
    (ATTRIBUTE, 'tool="get_weather"', True),
    (ATTRIBUTE, 'tool="get"weather"', False),
    (ATTRIBUTE, 'tool="get<|x"', False),
    # lazy grammars, from the trigger on (the text before is llama.cpp's to skip)
    (kimi_k3(), KIMI_CALL, True),
    (kimi_k3(), "<|close|>think<|sep|>" + KIMI_CALL + " done", True),
    (kimi_k3(), KIMI_CALL.replace('index="1"', 'index="0"'), False),  # the regex
    (kimi_k3(), KIMI_CALL.replace(">3<", ">three<"), False),  # the integer schema
    (kimi_k3(), KIMI_CALL.replace("Paris", "Par<|sep|>is"), False),  # any_text's excludes
    (LEGACY, '<tool_call>{"city": "Paris"}</tool_call>', True),
    (
        LEGACY,
        '<tool_call>{"city": "Paris"}</tool_call> then <tool_call>{"city": "Rome"}</tool_call> bye',
        True,
    ),
    (LEGACY, '<tool_call>{"city": "Paris"}</tool_call> then <tool_call>no', False),
    (LEGACY, "<tool_call>{}</tool_call>", False),
    (LEGACY_FIRST, '<tool_call>{"city": "Paris"}</tool_call>', True),
    (LEGACY_FIRST, '<tool_call>{"city": "Paris"}</tool_call> more', False),  # stop_after_first
]


@pytest.fixture(scope="module")
def vocab() -> Iterator[Any]:
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(default_model_path()).encode(), params)
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


@pytest.fixture(scope="module")
def char_tokens(vocab: Any) -> dict[str, int]:
    """A token whose piece is exactly that character, for every such character."""
    tokens: dict[str, int] = {}
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        piece = token_piece(vocab, token)
        if len(piece) == 1 and not llama_cpp.llama_vocab_is_control(vocab, token):
            tokens.setdefault(piece.decode("latin-1"), token)
    return tokens


def accepts(vocab: Any, char_tokens: dict[str, int], gbnf: str, text: str) -> bool:
    """Whether llama.cpp's grammar takes `text`, a character at a time, and may end there."""
    grammar = init_grammar(vocab, gbnf, "root")
    assert grammar
    candidates = Candidates(llama_cpp.llama_vocab_n_tokens(vocab))
    try:
        for c in text:
            token = char_tokens[c]
            if not candidates.allows(grammar, token):
                return False
            llama_cpp.llama_sampler_accept(grammar, token)
        return candidates.allows(grammar, llama_cpp.llama_vocab_eos(vocab))
    finally:
        llama_cpp.llama_sampler_free(grammar)


@pytest.mark.parametrize(("document", "text", "accepted"), LANGUAGES)
def test_the_grammar_takes_what_the_format_means(
    vocab: Any, char_tokens: dict[str, int], document: dict[str, Any], text: str, accepted: bool
) -> None:
    gbnf = structural_tag_to_gbnf(json.dumps(document), json_schema_to_gbnf).gbnf
    assert accepts(vocab, char_tokens, gbnf, text) is accepted


def with_tag(engine: EngineLoop, req: GenerationRequest, document: dict[str, Any]) -> Any:
    compiled = structural_tag_to_gbnf(json.dumps(document), engine.json_schema_to_grammar)
    engine.check_grammar(compiled.gbnf, "root")
    constraint = Constraint(compiled.gbnf, "root", "f", compiled.triggers, compiled.starts)
    return dataclasses.replace(req, constraint=constraint)


def shades(trigger: str, begin: str, **fields: Any) -> dict[str, Any]:
    tag = {"begin": begin, "content": {"type": "json_schema", "json_schema": SHADE}, "end": "."}
    return {"format": {"type": "triggered_tags", "triggers": [trigger], "tags": [tag], **fields}}


async def test_lazy_grammar_is_free_before_its_trigger_and_constrains_after_it(
    engine: EngineLoop,
) -> None:
    """Greedy: the free run says " red, blue, and yellow"; with the trigger "blue" the text up
    to it is the same tokens, and what follows obeys the tag's schema and end. (That the free
    text after a tag enters the tag again at the next trigger is checked above on llama.cpp's
    grammar, a character at a time: each constrained token here costs a full-vocabulary mask.)"""
    free = await run(engine, request(engine, COLORS, max_tokens=3))
    out = await run(engine, with_tag(engine, request(engine, COLORS, max_tokens=16), shades(
        "blue", "blue")))  # fmt: skip
    assert free.text == " red, blue"
    assert out.token_ids[:3] == free.token_ids
    assert out.text == ' red, blue{ "shade": "sky"}.'


async def test_a_token_going_past_the_trigger_where_the_tag_cannot_is_not_taken(
    engine: EngineLoop,
) -> None:
    """With the trigger "bl" and the begin "bl!", the greedy token " blue" would hand llama.cpp
    "blue" to replay, which the tag refuses (an abort): the guard refuses it, greedy takes its
    next choice, and the engine goes on serving."""
    out = await run(engine, with_tag(engine, request(engine, COLORS, max_tokens=6), shades(
        "bl", "bl!")))  # fmt: skip
    assert out.text == " red, yellow, and orange"
    after = await run(engine, request(engine, COLORS, max_tokens=3))
    assert after.text == " red, blue"
