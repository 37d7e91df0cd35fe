"""core.constrained.structural_tag: structural tags (xgrammar's format, as SMG and vLLM send them)
as GBNF, which ones are lazy, the refusals by path, and the guard before a lazy grammar's trigger.
The grammars' languages are checked against llama.cpp in tests/model/test_structural_tag.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_grpc_server.core.constrained.structural_tag import (
    CompiledStructuralTag,
    StructuralTagUnsupported,
    TriggerGuard,
    prefix_rules,
    structural_tag_to_gbnf,
    trigger_pattern,
)

SCHEMA = {"type": "object"}


def fake_schema(schema: str) -> str:
    """A stand-in converter: the schema's text as the literal its grammar matches."""
    if schema == "bad":
        raise ValueError("the schema must be a JSON object")
    return 'root ::= obj\nobj ::= "{" "}"\n'


def compile_tag(document: dict[str, Any]) -> CompiledStructuralTag:
    return structural_tag_to_gbnf(json.dumps(document), fake_schema)


def tool_tag(name: str) -> dict[str, Any]:
    return {
        "begin": f"<call={name}>",
        "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "</call>",
    }


def triggered(**fields: Any) -> dict[str, Any]:
    return {"format": {"type": "triggered_tags", "triggers": ["<call="], **fields}}


def test_triggered_tags_without_at_least_one_is_lazy() -> None:
    """The tool-call case: lazy, from the trigger on, any tag then free text watching it again."""
    compiled = compile_tag(triggered(tags=[tool_tag("a"), tool_tag("b")]))
    assert compiled.triggers == ("<call=",)
    assert compiled.starts == ("<call=a>", "<call=b>")
    assert compiled.gbnf.splitlines()[0] == "root ::= st5-tags st3-free"


def test_legacy_structures_are_triggered_tags() -> None:
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<call=a>", "schema": json.dumps(SCHEMA), "end": "</call>"}],
        "triggers": ["<call="],
    }
    compiled = compile_tag(legacy)
    assert compiled.triggers == ("<call=",)
    assert compiled.starts == ("<call=a>",)
    assert compiled.gbnf == compile_tag(triggered(tags=[tool_tag("a")])).gbnf


@pytest.mark.parametrize(
    "fields", [{"at_least_one": True}, {"at_least_one": True, "stop_after_first": True}]
)
def test_at_least_one_is_an_ordinary_grammar(fields: dict[str, Any]) -> None:
    """xgrammar's at_least_one starts the output with a tag: nothing to wait for."""
    compiled = compile_tag(triggered(tags=[tool_tag("a")], **fields))
    assert compiled.triggers == compiled.starts == ()


def test_the_exact_grammar_of_a_small_tag() -> None:
    """A sequence of a string and a tag whose any_text content avoids the tag's end."""
    compiled = compile_tag(
        {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": "A:"},
                    {"type": "tag", "begin": "(", "content": {"type": "any_text"}, "end": "ab"},
                ],
            },
        }
    )
    assert compiled == CompiledStructuralTag(
        'root ::= "A:" "\\x28" st1-text "ab"\n'
        'st1-text ::= "" | [^a] st1-text | "a" st1-text-1\n'
        'st1-text-1 ::= "" | [^ab] st1-text | "a" st1-text-1\n'
    )


def test_the_free_text_between_tags_enters_a_tag_at_its_trigger() -> None:
    compiled = compile_tag(
        {"format": {"type": "triggered_tags", "triggers": ["<x"], "tags": [
            {"begin": "<x>", "content": {"type": "const_string", "value": "1"}, "end": "."}
        ], "at_least_one": True, "stop_after_first": False}}
    )  # fmt: skip
    assert compiled.gbnf == (
        "root ::= st3-tags st1-free\n"
        'st1-free ::= "" | [^<] st1-free | "<" st1-free-1\n'
        'st2-enter ::= (">" "1" "\\x2E") st1-free\n'
        'st1-free-1 ::= "" | [^<x] st1-free | "<" st1-free-1 | "x" st2-enter\n'
        'st3-tags ::= "<x>" "1" "\\x2E"\n'
    )


def test_subgrammars_are_renamed_apart() -> None:
    compiled = compile_tag(
        {"format": {"type": "or", "elements": [
            {"type": "json_schema", "json_schema": SCHEMA},
            {"type": "regex", "pattern": "[0-9]{2}"},
            {"type": "grammar", "grammar": 'root ::= obj\nobj ::= "x"'},
        ]}}
    )  # fmt: skip
    assert compiled.gbnf == (
        "root ::= (st1-g-root | st2-g-root | st3-g-root)\n"
        'st1-g-root ::= st1-g-obj\nst1-g-obj ::= "{" "}"\n'
        "st2-g-root ::= [0-9]{2}\n"
        'st3-g-root ::= st3-g-obj\nst3-g-obj ::= "x"\n'
    )


def test_tags_with_separator_and_repeats() -> None:
    compiled = compile_tag(
        {"format": {"type": "sequence", "elements": [
            {"type": "tags_with_separator", "separator": ",", "tags": [
                {"begin": "a", "content": {"type": "const_string", "value": ""}, "end": ""}]},
            {"type": "plus", "content": {"type": "const_string", "value": "b"}},
            {"type": "star", "content": {"type": "const_string", "value": "c"}},
            {"type": "optional", "content": {"type": "const_string", "value": "d"}},
        ]}}
    )  # fmt: skip
    assert compiled.gbnf == (
        'root ::= (st1-tag ("," st1-tag)*)? ("b")+ ("c")* ("d")?\nst1-tag ::= "a"\n'
    )


def test_prefix_rules_leaves_literals_classes_counts_and_comments() -> None:
    gbnf = 'root ::= a-b "root x" [a-z\\]] x{2,3} # root\na-b ::= "\\"q"\n'
    assert prefix_rules(gbnf, "p-") == (
        'p-root ::= p-a-b "root x" [a-z\\]] p-x{2,3} # root\np-a-b ::= "\\"q"\n'
    )


BAD = [
    ("not json", "the structural tag is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("[]", "the structural tag must be a JSON object"),
    ('{"type": "json"}', "type must be 'structural_tag', not 'json'"),
    ("{}", "the structural tag needs 'format' (or legacy 'structures')"),
    ('{"format": {"type": "qwen_xml_parameter", "json_schema": {}}}',
     "format: format type 'qwen_xml_parameter' is not supported"),
    ('{"format": {"type": "triggered_tags", "triggers": [], "tags": []}}',
     "format.triggers: must be a non-empty list"),
    ('{"format": {"type": "triggered_tags", "triggers": [""], "tags": []}}',
     "format.triggers[0]: a trigger must be a non-empty string"),
    ('{"format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [{"begin": "<b>", '
     '"content": {"type": "any_text"}, "end": ""}]}}',
     "format.tags[0].begin: no trigger is a prefix of it"),
    ('{"format": {"type": "tag", "begin": "<a>", "content": {"type": "regex", "pattern": "(a"}, '
     '"end": ""}}',
     "format.content: the regex uses an unclosed group opened at position 0, which cannot be "
     "compiled to a grammar"),
    ('{"format": {"type": "json_schema", "json_schema": "bad"}}',
     "format.json_schema: the schema must be a JSON object"),
    ('{"format": {"type": "json_schema", "json_schema": 3}}',
     "format.json_schema: must be an object or a boolean"),
    ('{"format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [{"begin": "<a>", '
     '"content": {"type": "any_text"}, "end": ""}], "at_least_one": "yes"}}',
     "format.at_least_one: must be a boolean"),
    ('{"format": {"type": "sequence", "elements": [{"type": "any_text", "excludes": "x"}]}}',
     "format.elements[0]: excludes must be a list of strings"),
    ("[" * 100_000, "the structural tag nests too deeply"),
    (json.dumps({"format": {"type": "any_text", "excludes": ["x" * 2049]}}),
     "format: the strings free text watches for are longer than 2048 characters in all"),
    ('{"format": ' + '{"type": "optional", "content": ' * 40 + "{}" + "}" * 41,
     "format" + ".content" * 32 + ": formats nest deeper than 32"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), BAD)
def test_what_cannot_be_a_grammar_is_refused_by_path(text: str, message: str) -> None:
    with pytest.raises(StructuralTagUnsupported) as caught:
        structural_tag_to_gbnf(text, fake_schema)
    assert str(caught.value) == message


def test_trigger_pattern_escapes_and_puts_longer_triggers_first() -> None:
    assert trigger_pattern(["[A]", "<|x|>", "[A]", "a.b*"]) == "<\\|x\\|>|a\\.b\\*|\\[A\\]"


def test_guard_lets_free_text_and_a_trigger_at_a_piece_end_through() -> None:
    guard = TriggerGuard(["[TOOL_CALLS]"], ["[TOOL_CALLS] ["])
    for piece in (b"Sure", b", [TOOL", b"_CALLS"):
        assert guard.allows(piece)
        guard.accept(piece)
        assert guard.is_awaiting
    assert guard.allows(b"]")
    guard.accept(b"]")
    assert not guard.is_awaiting


@pytest.mark.parametrize(
    ("piece", "allowed"),
    [
        (b"[TOOL_CALLS]", True),  # the replay is the trigger, a prefix of the begin
        (b"[TOOL_CALLS] [", True),  # the whole begin
        (b"x[TOOL_CALLS] ", True),  # text before the trigger is free
        (b"[TOOL_CALLS]x", False),  # llama.cpp would replay "[TOOL_CALLS]x" and abort
        (b"[TOOL_CALLS] [{", False),  # past the begin, into the content: refused
        (b"[TOOL", True),
    ],
)
def test_guard_refuses_a_piece_whose_replay_the_tag_would_refuse(
    piece: bytes, allowed: bool
) -> None:
    assert TriggerGuard(["[TOOL_CALLS]"], ["[TOOL_CALLS] ["]).allows(piece) is allowed


def test_guard_replays_from_the_leftmost_trigger() -> None:
    """Two triggers in one piece: llama.cpp's regex_search starts at the leftmost."""
    guard = TriggerGuard(["<b", "<a"], ["<a>", "<b>"])
    assert guard.allows(b"<b")
    assert not guard.allows(b"<a<b")  # the replay "<a<b" begins no tag
    guard.accept(b"x<")
    assert guard.allows(b"a>")
    guard.accept(b"a>")
    assert not guard.is_awaiting


_TYPES = [
    "const_string",
    "json_schema",
    "regex",
    "grammar",
    "any_text",
    "sequence",
    "or",
    "tag",
    "triggered_tags",
    "tags_with_separator",
    "optional",
    "star",
    "plus",
    "qwen_xml_parameter",
]
_KEYS = [
    "type",
    "value",
    "json_schema",
    "pattern",
    "grammar",
    "excludes",
    "elements",
    "content",
    "begin",
    "end",
    "triggers",
    "tags",
    "separator",
    "at_least_one",
    "stop_after_first",
]
_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 2),
    st.sampled_from(_TYPES),
    st.text("<a|b>", max_size=4),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_VALUES, st.fixed_dictionaries({"format": _VALUES})))
def test_any_document_compiles_or_is_refused_by_name(document: Any) -> None:
    """Whatever JSON arrives, the compiler answers a grammar or StructuralTagUnsupported (which
    the rpc layer makes INVALID_ARGUMENT), never another exception (INTERNAL)."""
    try:
        compiled = structural_tag_to_gbnf(json.dumps(document), fake_schema)
    except StructuralTagUnsupported:
        return
    assert compiled.gbnf.startswith("root ::= ")
    assert len(compiled.triggers) == 0 or len(compiled.starts) > 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("<ab>", max_size=4), max_size=12))
def test_guard_never_lets_a_replay_leave_the_begins(pieces: list[str]) -> None:
    """Random pieces against triggers "<a" and "b>": what the guard lets through and then
    switches on at always replays a prefix of a begin."""
    starts = ("<a>", "b>>")
    guard = TriggerGuard(["<a", "b>"], starts)
    text = ""
    for piece in pieces:
        if not guard.allows(piece.encode()):
            continue
        guard.accept(piece.encode())
        text += piece
        if not guard.is_awaiting:
            at = min(i for i in (text.find("<a"), text.find("b>")) if i >= 0)
            assert any(start.startswith(text[at:]) for start in starts)
            return
