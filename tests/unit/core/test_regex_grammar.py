"""core.constrained.regex_grammar: regex and choice constraints as GBNF, and the features it
refuses. The grammars' languages are checked as properties against Python's `re` (ASCII: \\d
\\w \\s are the ASCII classes, as the compiler writes them) with tests/support/gbnf.py's
recognizer: strings Hypothesis draws from a pattern are accepted, and mutations of them are
accepted exactly when `re.fullmatch` accepts them. Golden grammar texts remain for spellings the
languages do not show."""

from __future__ import annotations

import functools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_grpc_server.core.constrained.regex_grammar import (
    MAX_REPEAT,
    RegexUnsupported,
    choice_to_gbnf,
    regex_to_gbnf,
)
from tests.support.gbnf import Grammar
from tests.support.regex_grammar import REGEX_CASES

# More patterns for the properties: the e2e test's phone number, ambiguity, nested and bounded
# repetitions, escapes of every kind, negated classes, characters beyond ASCII and the BMP.
MORE_PATTERNS = [
    r"\(?[0-9]{3}\) [0-9]{3}-[0-9]{4}",
    r"[a-z]+@[a-z]+\.(com|org)",
    r"-?\d+(\.\d+)?([eE][+-]?\d+)?",
    "(ab|a)(bc|c)",
    "(a|ab)*b?",
    "(x|y){0,3}z{2,}",
    r"[^a-c]{2,4}x?",
    r"\w+\s\W?",
    r"[\d.]+",
    "(?:[A-F0-9]{2}:){5}[A-F0-9]{2}",
    r'\t|\n|\\|"|\r\f\v',
    r"[-+*/]|[\]\[]",
    "é+ñ?😀*",
    r"[^\n]*",
    r"\x41[\x30-\x39]\u00e9?",
    "a{0}b",
    "(?P<y>19|20)\\d{2}-(0[1-9]|1[0-2])",
]
PATTERNS = [pattern for pattern, _ in REGEX_CASES] + MORE_PATTERNS
# Spellings the languages do not show: one merged literal, llama.cpp's escapes in literals and
# classes, {0,n} for {,n} (llama.cpp has no {,n}), a literal '{', \U for a non-BMP character.
SPELLINGS = {
    "abc", r"\d{3}-\d{4}", "a|b|", "a{2}b{1,}c{0,3}d{,2}", "x{", "[]a]", "[a-]", r"[^\]\\]",
    "😀", 'say "hi"', r"\u00e9\x41\n\.", "(?P<word>ab)*?",
}  # fmt: skip
# characters a mutation inserts: the pattern's own, and some it never names
OTHERS = st.sampled_from(["a", "0", "-", " ", "\n", "é", "😀", "٣", "\x00"]) | st.characters(
    codec="utf-8"
)
PROPERTY = settings(max_examples=20, deadline=None)  # x 40 patterns: 800 strings, ~10 s


def test_golden_spellings_are_cases() -> None:
    assert {pattern for pattern, _ in REGEX_CASES} >= SPELLINGS


@pytest.mark.parametrize(("pattern", "body"), [c for c in REGEX_CASES if c[0] in SPELLINGS])
def test_regex_compiles_to_this_grammar(pattern: str, body: str) -> None:
    assert regex_to_gbnf(pattern) == f"root ::= {body}\n"


@st.composite
def mutation(draw: st.DrawFn, text: str) -> str:
    """`text` with one to three edits: a character inserted, deleted, replaced, or a slice
    of up to three characters doubled (inserted characters come from the text or from OTHERS)."""
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        own = st.sampled_from(text) if text else OTHERS
        c = draw(own | OTHERS)
        edit = draw(st.sampled_from(["insert", "delete", "replace", "double"]))
        if edit == "insert" or not text:
            text = text[:at] + c + text[at:]
        elif edit == "delete":
            at = min(at, len(text) - 1)
            text = text[:at] + text[at + 1 :]
        elif edit == "replace":
            at = min(at, len(text) - 1)
            text = text[:at] + c + text[at + 1 :]
        else:
            end = draw(st.integers(at, min(at + 3, len(text))))  # a short slice
            text = text[:end] + text[at:end] + text[end:]
    return text


@functools.cache
def _compiled(pattern: str) -> tuple[Grammar, re.Pattern[str], st.SearchStrategy[str]]:
    """The pattern's grammar, the pattern for `re` (Python 3.11 spells (?<name>...) with a P, as
    (?P<name>...)), and the strings it matches in full."""
    regex = re.compile(_NAMED.sub("(?P<", pattern), re.ASCII)
    return Grammar(regex_to_gbnf(pattern)), regex, st.from_regex(regex, fullmatch=True)


_NAMED = re.compile(r"\(\?<(?![=!])")


@pytest.mark.parametrize("pattern", PATTERNS)
@PROPERTY
@given(data=st.data())
def test_the_grammar_accepts_what_the_regex_does(pattern: str, data: st.DataObject) -> None:
    """A string drawn from the pattern is accepted; a mutation of it is accepted exactly when
    `re.fullmatch` accepts it (mostly not: the grammar is no looser than the regex, nor
    stricter)."""
    grammar, regex, strings = _compiled(pattern)
    text = data.draw(strings, "text")
    assert grammar.accepts(text)
    mutated = data.draw(mutation(text), "mutated")
    assert grammar.accepts(mutated) == bool(regex.fullmatch(mutated))
    for near in _edges(text):
        assert grammar.accepts(near) == bool(regex.fullmatch(near)), near


def _edges(text: str) -> set[str]:
    """The edits a random mutation seldom hits: each character deleted or doubled, and a
    character inserted at either end (one of the text's or of a few others)."""
    out = {text[:i] + text[i + 1 :] for i in range(len(text))}
    out |= {text[:i] + text[i] + text[i:] for i in range(len(text))}
    for c in set(text) | set("a0- \né"):
        out |= {c + text, text + c}
    return out


@pytest.mark.parametrize(
    ("pattern", "feature"),
    [
        ("", "the regex is empty"),
        ("a(b", "an unclosed group opened at position 1"),
        (r"(a)\1", "a backreference (\\1) at position 3"),
        ("a(?=b)", "a lookahead at position 1"),
        ("a(?!b)", "a negative lookahead at position 1"),
        ("(?<=a)b", "a lookbehind at position 0"),
        ("(?<!a)b", "a negative lookbehind at position 0"),
        ("(?P<x>a)(?P=x)", "a named backreference at position 8"),
        ("(?>a)", "an atomic group at position 0"),
        ("(?i)a", "inline flags or a conditional at position 0"),
        (r"\bword", "a word boundary (\\b) at position 0"),
        (r"a\B", "a non-boundary (\\B) at position 1"),
        (r"\Aa", "an anchor (\\A) at position 0"),
        ("a^b", "an anchor '^' inside the pattern (position 1)"),
        ("a$b", "an anchor '$' inside the pattern (position 1)"),
        ("a*+", "a possessive quantifier at position 2"),
        ("a{1001}", f"a repetition bound above {MAX_REPEAT} ({{1001}})"),
        ("[[:alpha:]]", "a POSIX class at position 1"),
        (r"[\D]", "a negated class escape (\\D) inside a class, at position 1"),
        ("()", "an empty group or pattern"),
    ],
)
def test_regex_refusals_name_the_feature(pattern: str, feature: str) -> None:
    with pytest.raises(RegexUnsupported) as caught:
        regex_to_gbnf(pattern)
    message = str(caught.value)
    if feature == "the regex is empty":
        assert message == feature
    else:
        assert message == f"the regex uses {feature}, which cannot be compiled to a grammar"


def test_choice_is_an_alternation_of_literals() -> None:
    """Each choice is one literal, escaped; duplicates appear once, in order."""
    grammar = choice_to_gbnf(["yes", "no", 'it"s', "yes", "é"])
    assert grammar == 'root ::= "yes" | "no" | "it\\x22s" | "\\u00E9"\n'


@PROPERTY
@given(choices=st.lists(st.text(min_size=1), min_size=1, max_size=5), data=st.data())
def test_the_choice_grammar_accepts_exactly_the_choices(
    choices: list[str], data: st.DataObject
) -> None:
    grammar = Grammar(choice_to_gbnf(choices))
    assert grammar.accepts(data.draw(st.sampled_from(choices)))
    other = data.draw(st.sampled_from(choices).flatmap(mutation) | st.text())
    assert grammar.accepts(other) == (other in choices)


@pytest.mark.parametrize(
    ("choices", "message"),
    [([], "the choice list is empty"), (["a", ""], "choice 1 is an empty string")],
)
def test_choice_refusals(choices: list[str], message: str) -> None:
    with pytest.raises(RegexUnsupported, match=f"^{message}$"):
        choice_to_gbnf(choices)
